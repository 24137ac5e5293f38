"""Shared fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """The tests never read or write the user's cache: a stale or foreign record must not decide a test. The
    workers of one run (pytest-xdist) share theirs, as processes of one user do: what one proved, searched or
    compiled (the default rules' soundness verdicts, search checkpoints, the emulation's runtime) the others
    reuse; every write is atomic, and a test that needs an empty cache makes its own."""
    old = os.environ.get("PRISM_CACHE_DIR")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / "cache" if os.environ.get("PYTEST_XDIST_WORKER") else base / "cache"
    shared.mkdir(exist_ok=True)
    os.environ["PRISM_CACHE_DIR"] = str(shared)
    yield
    if old is None:
        del os.environ["PRISM_CACHE_DIR"]
    else:
        os.environ["PRISM_CACHE_DIR"] = old


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
