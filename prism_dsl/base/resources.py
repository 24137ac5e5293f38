"""Where the data shipped beside the code lives: the default axioms (`rules/`) and CUDA templates (`templates/`).

An installed package carries them as the subpackages `prism_dsl.library` and `prism_dsl.templates`
(see pyproject.toml's package-dir); in a source checkout (and an editable install) they are the
top-level folders beside the package.
"""

from __future__ import annotations

from pathlib import Path

from .errors import PrismError


def data_dir(package: str, checkout_dir: str) -> Path:
    here = Path(__file__).resolve().parents[1]
    for folder in (here / package, here.parent / checkout_dir):
        if folder.is_dir():
            return folder
    raise PrismError(f"the installation is incomplete: neither {here / package} nor {here.parent / checkout_dir} exists")
