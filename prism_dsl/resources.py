"""Where the data shipped beside the code lives: the default axioms (`rules/`) and CUDA templates (`templates/`).

In a source checkout they are the top-level folders; an installed package carries them as the
subpackages `prism_dsl.library` and `prism_dsl.templates` (see pyproject.toml's package-dir).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def data_dir(package: str, checkout_dir: str) -> Path:
    checkout = Path(__file__).resolve().parent.parent / checkout_dir
    if checkout.is_dir():
        return checkout
    return Path(str(importlib.resources.files(f"prism_dsl.{package}")))
