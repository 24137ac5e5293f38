"""The write pass: a compile's files into the output directory, which is replaced whole, or not at all.

`-o DIR` is built in a scratch directory beside it (`.DIR.prismc-<pid>-XXXXXXXX`), which takes DIR's place
only when every file is written; an earlier DIR (only one that `check_output` allows) is then removed, so
no stale file of an earlier compile remains and a failed or killed compile leaves the old DIR as it was. A
compile whose check failed writes its files for inspection, but not over an earlier compile that was verified
(`verified_before`).
Scratch directories of killed compiles are swept by the next compile beside them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import keyword
import os
import pprint
import re
import secrets
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Callable, Mapping

from ..backend import cuda_plan, cuda_runtime
from ..backend.codegen import HEADER, header_source, template_env
from ..base import cache, files
from ..base.errors import PrismError
from ..lang.printer import print_program
from . import build

_LEGACY = re.compile(r"[^/]+\.cu|prism\.cuh|launcher\.py|prism_runtime\.py|cuda_plan\.py|[^/]+\.prism|report\.json")
_SCRATCH = files.scratch_pattern(r"\.(?P<name>.+)\.")  # `.DIR.prismc-<pid>-XXXXXXXX` beside DIR


def check_output(out: Path) -> None:
    """Refuse an output directory prismc may not write, before any work (and again before the swap).

    `-o DIR` is replaced whole, so DIR must be new, empty, or one that prismc wrote: its report.json is
    prismc's (the keys prismc writes), and DIR holds only the files that report lists under "files" (a
    report without that list, from an older prismc: the names prismc gives its files), and Python's
    `__pycache__`. Anything else (a file of the user's, a directory where prismc writes a file) makes
    prismc refuse and touch nothing.
    """
    shown = str(out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise PrismError(f"cannot write to '{shown}': it exists and is not a directory "
                         "(-o names the directory the results go into)")
    probe = out.parent
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not os.path.isdir(probe):
        raise PrismError(f"cannot write to '{shown}': '{probe}' is not a directory")
    try:  # where `write` makes its scratch directory (or the directories above it): a read-only place is said now
        os.rmdir(tempfile.mkdtemp(prefix=files.scratch_prefix(f".{out.name}."), dir=probe))
    except OSError as e:
        raise PrismError(f"cannot write to '{shown}': {files.describe(e)}") from None
    here, target = Path.cwd().resolve(), out.resolve()
    if target == here or target in here.parents:
        raise PrismError(f"cannot write to '{shown}': it holds the current directory, and prismc replaces its "
                         "output directory whole; give a directory inside it, e.g. -o out")
    kept = cache.cache_dir().resolve()
    if target == kept or target in kept.parents:
        raise PrismError(f"cannot write to '{shown}': it holds prismc's cache ({kept}), and prismc replaces its "
                         "output directory whole; give another directory, or move the cache (PRISM_CACHE_DIR)")
    if kept in target.parents:  # (the search would write its own entries there, then find them foreign)
        raise PrismError(f"cannot write to '{shown}': it is inside prismc's cache ({kept}); give a directory outside it")
    if os.path.isdir(out) and not os.access(out, os.W_OK | os.X_OK):  # what it holds could not be removed
        raise PrismError(f"cannot write to '{shown}': it is not writable, and prismc replaces its output "
                         "directory whole")
    if os.path.isdir(out) and (foreign := _foreign(target)):
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        why = (" (its report.json, which would say what prismc wrote, is not a report of prismc's: damaged, or another "
                "program's)"
               if os.path.isfile(target / "report.json") and "report.json" in foreign else "")
        raise PrismError(f"cannot write to '{shown}': it holds what prismc did not write ({listed}){why}; prismc "
                         "replaces its output directory whole, so give a new or empty directory, or one "
                         "an earlier compile wrote")


def verified_before(out: Path) -> bool:
    """Whether `out` holds an earlier compile whose report says it was verified (which a failed one leaves alone)."""
    try:
        report = json.loads(files.read_regular(out / "report.json", files.MAX_TEXT_BYTES))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(report, dict) and report.get("verified") is True and _mine(out)("report.json")


def _foreign(directory: Path) -> list[str]:
    """What in an existing directory prismc did not write (sorted; directories end with '/')."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as e:
        raise PrismError(f"cannot write to '{directory}': {files.describe(e)}") from None
    mine = _mine(directory)
    return [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries
            if not (e.is_file(follow_symlinks=False) and mine(e.name))
            and not (e.name == "__pycache__" and _bytecode_only(e))]


# The keys every report.json of prismc has: today's, and those of outputs written before `hardware`/`checked`.
_REPORT_KEYS = ({"program", "hardware", "kernels", "checked", "verified"},
                {"program", "target", "kernels", "checks", "verified"})


def _mine(directory: Path) -> Callable[[str], bool]:
    """Whether a file name is one prismc wrote in `directory`: one its report.json lists (any name an older
    prismc gave its files, when it lists none); none, without a report.json of prismc's form."""
    try:
        report = json.loads(files.read_regular(directory / "report.json", files.MAX_TEXT_BYTES))
    except (OSError, ValueError, RecursionError):
        report = None
    if not (isinstance(report, dict) and any(keys <= report.keys() for keys in _REPORT_KEYS)):
        return lambda name: False
    listed = report.get("files")
    if isinstance(listed, list) and all(isinstance(n, str) for n in listed):
        return {*listed, "report.json"}.__contains__
    return lambda name: _LEGACY.fullmatch(name) is not None


def _bytecode_only(entry: os.DirEntry) -> bool:
    """A `__pycache__` that Python made when launcher.py was imported: only .pyc files."""
    if not entry.is_dir(follow_symlinks=False):
        return False
    try:
        return all(e.is_file(follow_symlinks=False) and e.name.endswith(".pyc") for e in os.scandir(entry.path))
    except OSError:
        return False


def _sweep(parent: Path) -> None:
    """Scratch directories that killed compiles left beside their outputs: removed, except a directory set
    aside during a swap whose output is missing (killed between the two renames), which is put back."""
    for path in files.abandoned(parent, _SCRATCH):
        m = _SCRATCH.fullmatch(path.name)
        home = parent / m.group("name")
        if m.group("old") and not os.path.lexists(home):
            with contextlib.suppress(OSError):
                os.rename(path, home)
                continue
        shutil.rmtree(path, ignore_errors=True)


class _Raced(Exception):
    """`out` appeared between `check_output` and the rename: another process wrote it meanwhile."""


def _swap_in(scratch: Path, out: Path) -> None:
    """`scratch` becomes `out`: renamed into place, an existing `out` set aside first and removed after. An `out`
    that appears between the look and the rename (another compile into the same new directory) is left as it is:
    what it holds was not checked (`check_output`), so it is not removed (`_Raced`)."""
    if not os.path.lexists(out):
        try:
            os.rename(scratch, out)
            return
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise _Raced from None
            raise
    aside = out.parent / (files.scratch_prefix(f".{out.name}.") + "old-" + secrets.token_hex(4))
    with _signals_held():
        os.rename(out, aside)
        try:
            os.rename(scratch, out)
        except OSError:
            os.rename(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM held while the old DIR is set aside, the new one renamed in and the old removed: one that
    arrives then takes effect after (DIR holds the new compile, nothing is left beside it), where it once stopped
    the removal half done and left the old copy. Their handlers are set aside for it (masking the signals would
    not do: another thread of the process takes them); only the main thread may, which is where a compile writes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # (None: not set from Python)
        if arrived:
            signal.raise_signal(arrived[0])


def launcher_call(inputs) -> str:
    """The arguments of a call of the launcher's `run` in its docstring: by keyword, or as a dict where an input's
    name is a Python keyword (`lambda`, `None`)."""
    if all(name.isidentifier() and not keyword.iskeyword(name) for name in inputs):
        return ", ".join(f"{name}=..." for name in inputs)
    return "**{" + ", ".join(f"{name!r}: ..." for name in inputs) + "}"


def format_plan(plan: dict) -> str:
    """The runtime plan as readable Python literal text, for writing into a generated launcher.py."""
    return pprint.pformat(plan, width=110, sort_dicts=False)


def launcher_source(plan: dict) -> str:
    """launcher.py for the plan of a build (`build.plan_of`): its docstring names each input and output with its
    element type and its shape as the caller passes or gets it."""
    shaped = {name: f"{name}: {spec['dtype']}{list(cuda_plan.used(spec))}" for name, spec in plan["tensors"].items()}
    return template_env().get_template("launcher.py.j2").render(
        plan=plan, program=plan["program"], plan_literal=format_plan(plan), call=launcher_call(plan["inputs"]),
        inputs=", ".join(shaped[n] for n in plan["inputs"]), outputs=", ".join(shaped[n] for n in plan["outputs"]))


def contents(built: build.Build, extra: Mapping[str, str]) -> dict[str, str]:
    """Every file of an output but report.json, name -> text: prism.cuh and the kernels, the runtime (with the
    plan module it loads from beside itself) and a launcher for it, the program as compiled, and `extra` (the
    search's best.prism). The .prism files declare the sizes given as their dims' defaults."""
    plan = build.plan_of(built)
    launcher = launcher_source(plan)
    return {HEADER: header_source(), **{k.file: k.source for k in built.kernels},
            "prism_runtime.py": Path(cuda_runtime.__file__).read_text(), "launcher.py": launcher,
            "cuda_plan.py": Path(cuda_runtime.__file__).with_name("cuda_plan.py").read_text(),  # the runtime's, beside it
            f"{built.program.name}.prism": print_program(built.program.at(build.callers_dims(built))), **extra}


def write(out: Path, texts: Mapping[str, str]) -> None:
    """`texts` (file name -> text) as the files of `out`, replacing it whole (see the module doc)."""
    shown = str(out)
    out = out.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep(out.parent)
        scratch = Path(tempfile.mkdtemp(prefix=files.scratch_prefix(f".{out.name}."), dir=out.parent))
        try:
            for name, text in texts.items():
                (scratch / name).write_text(text)
            mode = out.stat().st_mode if os.path.isdir(out) else 0o777 & ~files.umask()
            os.chmod(scratch, stat.S_IMODE(mode))  # mkdtemp's directory is private; keep the usual mode
            check_output(Path(shown))  # the user may have put something there while the compile ran
            _swap_in(scratch, out)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError as e:
        raise PrismError(f"cannot write to '{shown}': {files.describe(e)}") from None
    except _Raced:
        raise PrismError(f"cannot write to '{shown}': it was made while this compile ran (another prismc writing the "
                         "same directory?); it is left as it is, and nothing of this compile was written: run it "
                         "again") from None
