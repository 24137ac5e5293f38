"""The user cache directory: small JSON records written atomically and read defensively.

Location: `$PRISM_CACHE_DIR` (`~` expanded), else `$XDG_CACHE_HOME/prism-dsl`, else `~/.cache/prism-dsl`; a
relative path in either variable is ignored, and without a home there is no cache (`cache_dir`). Nothing is ever
written to the current directory. A cache may make the tool faster, never wrong, and never stop it:

- a record is read only from a regular file of at most MAX_RECORD_BYTES (a FIFO, a device or a link to
  one is refused unread), and must be JSON without NaN or infinities, nested at most MAX_NESTING deep,
  holding {"key": <its key>, "value": ...}; a caller may also pass `valid` to check the value's form.
  A record that fails is ignored and reported once per process and file;
- a cache directory that cannot be read or written is reported once per process, and then not tried
  again: no warning per entry;
- a write goes to a temporary file (`.tmp-prismc-<pid>-...`) renamed into place; those left by a killed
  run are removed by a later write to the same directory.

One kind of entry is not JSON: the emulation's compiled runtime (`backend.emulate.runtime_object`), an object
file beside a record that holds its SHA-256, which every use checks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from .files import (MAX_TEXT_BYTES, NotRegularFile, TooLarge, describe, read_regular, rename_filled, scratch_pattern,
                    scratch_prefix, sweep_files)

MAX_RECORD_BYTES = MAX_TEXT_BYTES  # a search checkpoint of thousands of programs stays far below
MAX_NESTING = 64  # records are a few levels deep; json's parser recurses once per level

_said: dict[str, str] = {}  # each warning printed, by what it is about (an entry's path, a directory): once each
_off: dict[str, set[str]] = {}  # per cache directory: "read", "write", what failed there, not tried again
_swept: set[Path] = set()  # directories whose abandoned temporary files were removed
_TMP = re.compile(scratch_pattern(r"\.tmp-").pattern + r"\.json")  # `.tmp-prismc-<pid>-XXXXXXXX.json`


NOWHERE = Path(os.devnull) / "prism-dsl"  # the cache where there is none: nothing can be made under a device


def cache_dir() -> Path:
    """PRISM_CACHE_DIR (`~` expanded), else $XDG_CACHE_HOME/prism-dsl, else ~/.cache/prism-dsl. A relative path in
    either variable is ignored (said once): it would put the cache in whatever directory prismc runs in. Without
    a home (HOME unset with no passwd entry, as under `docker run --user N`, or empty, or relative), NOWHERE: no
    cache, said once."""
    root = os.environ.get("PRISM_CACHE_DIR")
    if root and os.path.isabs(expanded := os.path.expanduser(root)):
        return Path(expanded)
    if root:
        _say("PRISM_CACHE_DIR", f"prismc: warning: ignoring PRISM_CACHE_DIR={root!r}: not an absolute path (the "
             "cache would go wherever prismc runs)")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # a relative one is ignored
        return Path(xdg) / "prism-dsl"
    home = os.environ.get("HOME", os.path.expanduser("~"))  # (unset: the passwd entry's, '~' where there is none)
    if home and os.path.isabs(home):
        return Path(home) / ".cache" / "prism-dsl"
    _off[str(NOWHERE)] = {"read", "write"}
    _say(str(NOWHERE), f"prismc: warning: no cache directory: HOME is {'not set' if home == '~' else repr(home)}, "
         "and neither PRISM_CACHE_DIR nor XDG_CACHE_HOME names one; going on without a cache")
    return NOWHERE


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


PACKAGE = Path(__file__).resolve().parents[1]


def code_digest(*paths: str, extra: Path | None = None) -> str:
    """A digest of the package's sources under `paths` (files or folders, relative to the package; a folder
    gives its Python and TOML files), plus the files of folder `extra`: what a cached figure was made by."""
    files: list[Path] = []
    for path in (PACKAGE / p for p in paths):
        files += sorted([*path.rglob("*.py"), *path.rglob("*.toml")]) if path.is_dir() else [path]
    files += sorted(p for p in extra.iterdir() if p.is_file()) if extra else []
    return digest(*(f.read_text() for f in files))


def path_for(kind: str, key: str) -> Path:
    return cache_dir() / kind / f"{key[:32]}.json"


def read(kind: str, key: str, valid: Callable[[Any], bool] | None = None) -> Any | None:
    """The value stored under `key`, or None if absent, unreadable, stale or (with `valid`) of the wrong
    form; anything but absence is reported once."""
    if "read" in _off.get(str(cache_dir()), ()):
        return None
    path = path_for(kind, key)
    try:
        data = read_regular(path, MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
    except (NotRegularFile, TooLarge, IsADirectoryError) as e:
        warn(path, describe(e))
        return None
    except OSError as e:
        if not os.access(path.parent, os.R_OK | os.X_OK):  # the directory, not this entry
            unusable("read", f"{describe(e)}")
        elif e.errno in _NOT_OURS:  # a cache shared with another user, who wrote it: said once per directory
            _say(f"{path.parent}:unreadable", f"prismc: warning: ignoring the cache entries in {path.parent} that "
                 f"this user cannot read ({describe(e)}; another user's?)")
        else:
            warn(path, f"unreadable ({describe(e)})")
        return None
    record = parse(data)
    if record is None:
        warn(path, "unreadable (not a JSON record of the expected form)")
        return None
    if not isinstance(record, dict) or record.get("key") != key or "value" not in record:
        warn(path, "does not match its key")
        return None
    if valid is not None and not _holds(valid, record["value"]):
        warn(path, "its fields are not of the expected types")
        return None
    return record["value"]


def parse(data: bytes) -> Any | None:
    """A record's JSON, or None when it is not JSON of the kind `write` writes (finite numbers, shallow)."""
    if _nesting(data) > MAX_NESTING:
        return None
    try:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None


def _nesting(data: bytes) -> int:
    """An upper bound of the JSON's nesting (brackets inside strings count too: a bound is enough)."""
    if data.count(b"[") + data.count(b"{") <= MAX_NESTING:
        return 0
    depth = deepest = 0
    for m in re.finditer(rb"[\[\]{}]", data):
        depth += 1 if m.group() in b"[{" else -1
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            break
    return deepest


def _no_constant(name: str):
    raise ValueError(f"{name} is not a cached figure")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _holds(valid: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(valid(value))
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
        return False


def write(kind: str, key: str, value: Any) -> None:
    """Store `value` atomically (temporary file + rename); a cache that cannot be written is skipped."""
    if "write" in _off.get(str(cache_dir()), ()):
        return
    path = path_for(kind, key)
    try:
        text = json.dumps({"key": key, "value": value}, allow_nan=False)
    except ValueError:  # a NaN or infinity: `read` would refuse it, so it is not worth keeping
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent not in _swept:  # once per process and directory
            _swept.add(path.parent)
            sweep_files(path.parent, _TMP)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=scratch_prefix(".tmp-"), suffix=".json")
    except OSError as e:
        unusable("write", describe(e))
        return
    try:
        rename_filled(fd, tmp, path, lambda f: f.write(text.encode()))
    except OSError as e:
        if e.errno in _FULL:  # every entry would fail alike: said once, and no more tries
            unusable("write", describe(e))
        elif e.errno in _NOT_OURS:
            _say(f"{path.parent}:unwritable", f"prismc: warning: not replacing the cache entries in {path.parent} "
                 f"that this user cannot write ({describe(e)}; another user's?)")
        else:
            warn(path, f"not writable ({describe(e)})")


_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}  # a full disk, a quota reached, a read-only file system
_NOT_OURS = {errno.EACCES, errno.EPERM}  # an entry another user owns


def remove(kind: str, key: str) -> None:
    """Drop the record under `key` (one found false), so that no later run meets it again."""
    try:
        os.unlink(path_for(kind, key))
    except OSError:
        pass


def warn(path: Path, why: str) -> None:
    _say(str(path), f"prismc: warning: ignoring cache entry {path}: {why}")


def _say(about: str, message: str) -> None:
    if about not in _said:
        _said[about] = message
        print(message, file=sys.stderr)


def said() -> dict[str, str]:
    """The warnings printed so far in this process, by what each is about: for `relay`."""
    return dict(_said)


def relay(reports: dict[str, str]) -> None:
    """Warnings another process gave (a forked one: `said` there), printed here as if given here: once each."""
    for about, message in reports.items():
        _say(about, message)


def unusable(what: str, why: str) -> None:
    """The cache directory cannot be read or written: say so once, and stop trying (reads and writes
    after a failed read; writes after a failed write)."""
    off = _off.setdefault(str(cache_dir()), set())
    first = not off
    off.update(("read", "write") if what == "read" else ("write",))
    if first:
        doing = "read" if what == "read" else "written"
        _say(str(cache_dir()), f"prismc: warning: the cache directory {cache_dir()} cannot be {doing} ({why}); "
             f"going on without {'it' if what == 'read' else 'saving results'}")
