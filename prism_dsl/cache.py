"""The user cache directory: small JSON records written atomically and read defensively.

Location: `$PRISM_CACHE_DIR`, else `$XDG_CACHE_HOME/prism-dsl`, else `~/.cache/prism-dsl`. Nothing is
ever written to the current directory. A record that cannot be read or does not carry the expected
key is reported once (per process and file) and ignored: a cache may make the tool faster, never wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_warned: set[str] = set()


def cache_dir() -> Path:
    root = os.environ.get("PRISM_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "prism-dsl"


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def path_for(kind: str, key: str) -> Path:
    return cache_dir() / kind / f"{key[:32]}.json"


def read(kind: str, key: str) -> Any | None:
    """The value stored under `key`, or None if absent, unreadable or stale (reported once)."""
    path = path_for(kind, key)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warn(path, f"unreadable ({e.__class__.__name__})")
        return None
    if not isinstance(record, dict) or record.get("key") != key or "value" not in record:
        warn(path, "does not match its key")
        return None
    return record["value"]


def write(kind: str, key: str, value: Any) -> None:
    """Store `value` atomically (temporary file + rename); a cache that cannot be written is skipped."""
    path = path_for(kind, key)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        warn(path, f"not writable ({e.strerror or e})")
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def warn(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        print(f"prismc: warning: ignoring cache entry {path}: {why}", file=sys.stderr)
