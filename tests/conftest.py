"""Shared fixtures for the front-end tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture
def write(tmp_path):
    """write(text, name="t.prism") -> the path of a new file under tmp_path holding `text`."""

    def _write(text: str | bytes, name: str = "t.prism") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path

    return _write


@pytest.fixture
def default_recursion_limit():
    """Python's default recursion limit for the test, whatever an earlier in-process `main()` raised it to.

    The front end must handle absurd nesting without relying on a raised limit, as a library caller has none.
    """
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(old)
