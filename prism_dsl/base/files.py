"""The file system at the edges: bounded reads of regular files, atomic writes, and scratch directories
that can be swept.

Every file a user or the cache hands the tool is read through `read_regular` (or opened with
`open_regular`): a device (`/dev/zero`), a FIFO or a directory is refused before a byte is read (the
open is non-blocking and the type is checked on the open descriptor, so a FIFO cannot hang it and a
rename in between cannot swap one in), and no more than the limit plus one byte is ever read, so a
huge or growing file costs at most the limit.

A file is written through a temporary file renamed into place (`write_atomic`), so that no run leaves
one half-written.

Scratch directories are named `<prefix>prismc-<pid>-<random>` so that those of a run that was killed
(SIGKILL, a power cut: no `finally` ran) can be recognised by a later run: `abandoned` lists those whose
process is gone, owned by this user, and nothing else.
"""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
import stat
import subprocess
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Mapping

from .errors import PrismError

try:
    import fcntl
except ImportError:  # not a POSIX system: scratch directories are judged by their process's pid alone
    fcntl = None

MiB = 1 << 20
MAX_TEXT_BYTES = 16 * MiB  # the largest text the tool reads: a source, a cache record, a report.json
TAG = "prismc"  # in every scratch directory's name, before the pid


class NotRegularFile(OSError):
    """The path names a device, FIFO or socket: reading it could block or never end."""


class TooLarge(OSError):
    """The file is larger than the caller's limit."""


def describe(e: OSError | ValueError) -> str:
    """Why a path cannot be read, in words for a message: 'no such file', 'it is a directory', ..."""
    if isinstance(e, (NotRegularFile, TooLarge)):
        return e.strerror
    if isinstance(e, ValueError):  # os.open's answer to a NUL in a path
        return "its name contains a NUL character"
    if isinstance(e, FileNotFoundError):
        return "no such file"
    if isinstance(e, IsADirectoryError):
        return "it is a directory"
    if isinstance(e, PermissionError):
        return "permission denied"
    if isinstance(e, NotADirectoryError):
        return "a part of the path is not a directory"
    text = e.strerror or str(e)
    return text[:1].lower() + text[1:]  # inside a sentence: "No space left on device" as "no space ..."


def _kind(mode: int) -> str | None:
    """None for a regular file, else what the path is, for a message."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _refuse(mode: int, size: int, limit: int | None) -> None:
    kind = _kind(mode)
    if kind == "dir":
        raise IsADirectoryError(errno.EISDIR, "it is a directory")
    if kind is not None:
        raise NotRegularFile(errno.EINVAL, f"it is {kind}, not a regular file")
    if limit is not None and size > limit:
        raise TooLarge(errno.EFBIG, f"it is larger than {_size(limit)} ({_size(size)})")


def _size(n: int) -> str:
    return f"{n / MiB:.4g} MiB" if n >= MiB else f"{n:,} bytes"


def _open(path: str | os.PathLike, limit: int | None) -> int:
    """A descriptor of `path` opened for reading, known to be a regular file within `limit` bytes."""
    try:
        st = os.stat(path)
    except OSError:
        pass  # the open below fails the same way, and says why
    else:  # not even an open of a device: some act on open (a tape rewinds, a terminal attaches)
        _refuse(st.st_mode, st.st_size, limit)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)  # what was opened, whatever the path names by now
        _refuse(st.st_mode, st.st_size, limit)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (a file that grew past it is refused).

    Raises OSError (FileNotFoundError, IsADirectoryError, NotRegularFile, TooLarge, ...) or ValueError (a
    NUL in the path); `describe` turns either into words."""
    fd = _open(path, limit)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(errno.EFBIG, f"it is larger than {_size(limit)}")
    return data


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """The regular file `path` open for binary reading (for formats read piecewise, such as zip archives);
    raises as `read_regular` does."""
    return os.fdopen(_open(path, None), "rb")


# -- scratch directories ----------------------------------------------------------------------------------

_RANDOM = r"[a-z0-9_]{8}"  # what tempfile.mkdtemp puts after the prefix


def scratch_prefix(prefix: str) -> str:
    """The start of a scratch directory's name for this process: `<prefix>prismc-<pid>-`."""
    return f"{prefix}{TAG}-{os.getpid()}-"


def scratch_pattern(prefix: str) -> re.Pattern:
    """The names `scratch_prefix` gives (for any pid), with `prefix` a regular expression; groups: `pid`,
    and `old` ("old-") in the name of a directory set aside while another takes its place (`pipeline.output`)."""
    return re.compile(rf"{prefix}{TAG}-(?P<pid>\d+)-(?P<old>old-)?{_RANDOM}")


_LOCK = ".prismc-lock"  # in a scratch directory: held (flock) by the process that works in it


@contextmanager
def temp_scratch(kind: str) -> Iterator[Path]:
    """A new private directory `prism-<kind>-prismc-<pid>-XXXXXXXX` under the system's temporary directory,
    removed when the block ends; those that runs killed earlier left there are removed first.

    Its process holds a lock on a file in it while it works: a run in another PID namespace (a container
    sharing the temporary directory) cannot see that process, and takes the directory as abandoned only
    where it can take the lock."""
    base = Path(tempfile.gettempdir())
    for stale in abandoned(base, scratch_pattern(re.escape(f"prism-{kind}-"))):
        shutil.rmtree(stale, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=scratch_prefix(f"prism-{kind}-"), dir=base))
    lock = os.open(path / _LOCK, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield path
    except OSError as e:
        if e.filename is None and e.errno in (errno.ENOSPC, errno.EDQUOT):  # a write's refusal names no file
            raise PrismError(f"cannot write in the temporary directory {base}: {describe(e)} (TMPDIR sets "
                             "another)") from None
        raise
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)


def _held(directory: str) -> bool:
    """Whether a live process holds the lock of scratch directory `directory` (see `temp_scratch`)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(os.path.join(directory, _LOCK), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False  # none (a file entry, or a directory that is not temp_scratch's): judged by its pid alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # and the lock taken with it


def run_in(cmd: list[str], workdir: Path) -> subprocess.CompletedProcess:
    """A compiler run in `workdir` with its output captured, its own temporary files there too (TMPDIR): one
    stopped by a signal is killed before it can remove them, and they go with the workdir."""
    env = {**os.environ, "TMPDIR": str(Path(workdir).resolve())}
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, errors="replace", env=env)


def process_gone(pid: int) -> bool:
    """Whether no process `pid` exists (False when unsure: another user's, or a platform that cannot tell)."""
    if pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return False


def abandoned(directory: Path, pattern: re.Pattern, *, dirs: bool = True) -> list[Path]:
    """The directories (with `dirs=False`: the regular files) in `directory` whose whole name matches
    `pattern` (see `scratch_pattern`), owned by this user, whose process is gone; sorted. Symbolic links
    and other users' entries never are."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    found = []
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or not process_gone(int(m.group("pid"))):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        kind = stat.S_ISDIR(st.st_mode) if dirs else stat.S_ISREG(st.st_mode)
        if kind and (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not (dirs and _held(entry.path)):
            found.append(Path(entry.path))
    return sorted(found)


def sweep_files(directory: Path, pattern: re.Pattern) -> None:
    """Remove the regular files in `directory` that killed runs left there (see `abandoned`); one that
    cannot be removed stays, for a later run to try again."""
    for path in abandoned(directory, pattern, dirs=False):
        with suppress(OSError):
            os.unlink(path)


# -- writing ----------------------------------------------------------------------------------------------


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(path: str) -> None:
    """Fail before any work (and before any other output is written) if `path` cannot be written.

    The path (a link is followed) must be a regular file or not exist, in an existing directory: it is then
    replaced atomically. A character device or a FIFO (`/dev/null`, `/dev/stdout` in a pipe) is written
    directly; anything else (a directory, a block device, a socket) is refused."""
    target = Path(path)
    if os.path.isdir(target):
        raise PrismError(f"cannot write '{path}': it is a directory")
    try:
        mode = os.stat(target).st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        raise PrismError(f"cannot write '{path}': it is not a regular file")
    if mode is None and not os.path.isdir(Path(os.path.realpath(target)).parent):
        probe = target.parent
        while not os.path.lexists(probe) and probe != probe.parent:
            probe = probe.parent
        if os.path.isdir(probe):
            raise PrismError(f"cannot write '{path}': directory '{target.parent}' does not exist")
        raise PrismError(f"cannot write '{path}': '{probe}' is not a directory")


def check_apart(writes: Mapping[str, str | None], reads: Mapping[str, str | None]) -> None:
    """Refuse, before any work, two of a command's outputs (`writes`: what each is, e.g. "--out", by the path given)
    naming one file, and an output naming a file the command reads (`reads`, by what it is): the second write
    would lose the first, or the command its own input. Devices and FIFOs (`/dev/null`) may take several."""
    def same(a: str, b: str) -> bool:
        try:
            return os.path.samefile(a, b)
        except OSError:  # one of them does not exist yet
            return os.path.realpath(a) == os.path.realpath(b)

    def regular(path: str) -> bool:
        return not os.path.exists(path) or os.path.isfile(path)

    named = [(what, path) for what, path in writes.items() if path and regular(path)]
    for i, (what, path) in enumerate(named):
        for other, where in named[:i]:
            if same(path, where):
                raise PrismError(f"{other} and {what} name the same file '{path}': give each its own")
        for source, read in reads.items():
            if read and os.path.exists(read) and same(path, read):
                raise PrismError(f"cannot write '{path}' ({what}): it is {source}, which this command reads")


_PARTIAL = re.compile(scratch_pattern(r"\..+\.").pattern + r"\.tmp")  # `.NAME.prismc-<pid>-XXXXXXXX.tmp`


def write_atomic(path: str, fill: Callable[[BinaryIO], object]) -> None:
    """`fill` a temporary file in the same directory, then rename it to `path`: never a half-written file.
    A link is followed (the file it names is replaced); a device or FIFO is written directly (see
    `check_writable`). Temporary files that killed runs left in that directory are removed first."""
    check_writable(path)
    target = Path(os.path.realpath(path))
    try:
        if os.path.exists(path) and not os.path.isfile(path):  # a device or FIFO (`check_writable`)
            data = io.BytesIO()  # a .npz is written with seeks, which a device or a pipe cannot do
            fill(data)
            with open(path, "wb") as f:
                f.write(data.getvalue())
            return
        sweep_files(target.parent, _PARTIAL)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=scratch_prefix(f".{target.name}."), suffix=".tmp")
        rename_filled(fd, tmp, target, fill, 0o666 & ~umask())  # mkstemp makes the file private: the usual mode
    except OSError as e:
        raise PrismError(f"cannot write '{path}': {describe(e)}") from None


def rename_filled(fd: int, tmp: str, target: Path, fill: Callable[[BinaryIO], object], mode: int | None = None) -> None:
    """`fill` the new temporary file `tmp` (open as `fd`), give it `mode` (if any) and rename it to `target`
    (so that no reader ever meets a half-written file); `tmp` is removed if a step fails. Raises OSError."""
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def write_bytes(path: str, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data))
