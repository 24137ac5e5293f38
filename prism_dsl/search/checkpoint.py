"""The search's checkpoint: the proved programs of a complete search, kept in the user cache (`cache`).

An entry is keyed by the input program's structure (printed without its dim values), the rules' text, the
search limits, the dims the file declares and the hardware's shared memory per block (`checkpoint_key`), so a
new binding of the dims reuses it and only re-instantiates. Only complete
searches are saved (one cut short by the time limit is not reused). The saved programs are NOT trusted:
what is read here is checked for its form only (one program declaration each, nothing imported, the
input's name, inputs and outputs); whoever emits or times one proves it again first, and one that fails
its proof discards the entry (`discard`). A record that cannot be read, parsed or used is reported once
and ignored, and the search runs again.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict

from ..base import cache
from ..base.errors import PrismError
from ..ir.nodes import Program
from ..ir.shapes import same_shape
from ..kernels.hardware import Hardware
from ..lang import syntax_tree as ast
from ..lang.check import load
from ..lang.printer import print_program
from ..lang.syntax import parse_prism
from ..prove.prover import check_signatures
from ..prove.rules import Library
from .config import SearchConfig
from .driver import Result

SEARCH_VERSION = "4"  # bump when the search's meaning changes: old checkpoints (and tunings) are then ignored
STAT_COUNTS = ("generated", "candidates", "maps", "proofs", "proved")  # `Stats.as_dict`'s counters


def structure(program: Program, *, names: bool = False) -> str:
    """The program's text without its dims; with the names of its values where `names` (a tuning's parameters are
    named after the kernels, and those after the values), else as the search sees it, single-use values inline."""
    return print_program(program, with_dims=False, keep_names=names)


def checkpoint_key(program: Program, library: Library, config: SearchConfig, hardware: Hardware) -> str:
    """The entry of a search of `program`: besides its structure, the rules and the limits, what the search reads
    that the structure leaves out: the dims the file declares (the smallest tiles are fitted at them:
    `assembly.smallest_tiles_fit`) and the hardware's shared memory per block. The dims a compile binds are not
    in it: a new binding reuses the entry."""
    declared = json.dumps({d.name: d.default for d in program.dims}, sort_keys=True)
    return cache.digest("search", SEARCH_VERSION, _code(), structure(program), *library.texts,
                        json.dumps(asdict(config), sort_keys=True), declared, f"smem_per_block={hardware.smem_per_block}")


@functools.cache
def _code() -> str:
    """A digest of the code that searched and proved: a checkpoint of other code (a prover since fixed) is
    searched again rather than offered."""
    return cache.code_digest("search", "prove", "ir", "kernels", "semantics", "lang")


def has_checkpoint(key: str) -> bool:
    return os.path.isfile(cache.path_for("search", key))


def load_checkpoint(program: Program, key: str) -> tuple[list[Program], dict] | None:
    """The saved programs (with this program's dims) and the search's figures, or None; a bad entry is
    reported once. The programs are NOT trusted here (see the module doc)."""
    record = cache.read("search", key)
    if record is None:
        return None
    saved = _checkpoint(program, record)
    if isinstance(saved, str):
        cache.warn(cache.path_for("search", key), f"not a valid checkpoint ({saved})")
        return None
    return saved


def save_checkpoint(key: str, result: Result) -> None:
    cache.write("search", key, {"programs": [structure(p) for p in result.proved],
                                "stats": {**result.stats.as_dict(), "seconds": round(result.seconds, 3)}})


def discard(key: str, why: str) -> None:
    """Report the entry once and remove it, so that no later run meets it again (even when the search
    that replaces it is cut short and saves nothing)."""
    cache.warn(cache.path_for("search", key), why)
    cache.remove("search", key)


def _checkpoint(program: Program, record) -> tuple[list[Program], dict] | str:
    """The checkpoint's programs and figures, or what is wrong with it."""
    if not isinstance(record, dict):
        return "not a record"
    texts, stats = record.get("programs"), _stats(record.get("stats"))
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        return "its programs are not a list of texts"
    if isinstance(stats, str):
        return stats
    programs = []
    for i, text in enumerate(texts):
        saved = _saved_program(program, text)
        if isinstance(saved, str):
            return f"program {i + 1}: {saved}"
        programs.append(saved)
    return programs, stats


def _stats(stats) -> dict | str:
    """The search's figures as report.json shows them: only the known keys, each of its type."""
    if not isinstance(stats, dict):
        return "its figures are not a record"
    counts = {k: stats.get(k) for k in STAT_COUNTS}
    pruned, seconds = stats.get("pruned"), stats.get("seconds")
    if not all(is_count(v) for v in counts.values()):
        return "its counts are not all whole numbers"
    if not isinstance(pruned, dict) or not all(isinstance(k, str) and is_count(v) for k, v in pruned.items()):
        return "its pruning counts are not a record of whole numbers"
    if not is_time(seconds, zero=True):
        return "its search time is not a number of seconds"
    return {**counts, "pruned": pruned, "seconds": seconds}


def _saved_program(program: Program, text: str) -> Program | str:
    """One saved program, checked, with `program`'s dims; or why it is not usable in its place."""
    dims = ("dims " + ", ".join(f"{d.name} = {d.default}" for d in program.dims) + "\n") if program.dims else ""
    try:
        items = parse_prism(text, "<checkpoint>").items
        if len(items) != 1 or not isinstance(items[0], ast.ProgramDecl):
            return "not one program declaration"
        saved = load("<checkpoint>", dims + text).program()
        check_signatures(program, saved)
    except (PrismError, RecursionError) as e:
        return str(e).splitlines()[0] if str(e) else e.__class__.__name__
    outputs, theirs = dict(program.outputs), dict(saved.outputs)
    if saved.name != program.name or set(theirs) != set(outputs) or not all(
            same_shape(theirs[n].shape, outputs[n].shape) for n in outputs):
        return f"not a program '{program.name}' with its outputs"
    return saved


def is_count(v) -> bool:
    """A count in a cache record: a whole number from 0 (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_time(us, zero: bool = False) -> bool:
    """A time in a cache record: a finite number above zero, or zero where `zero` allows (not a bool, a
    string or NaN)."""
    if isinstance(us, bool) or not isinstance(us, (int, float)):
        return False
    try:
        return math.isfinite(us) and (us > 0 or zero and us == 0)
    except OverflowError:  # an integer too large for a float is no time either
        return False
