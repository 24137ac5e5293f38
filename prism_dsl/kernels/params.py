"""Kernel parameters: values for the free grid sizes and loop ranges of a program's kernels.

`resolve_params` reads them from the command line (`--grid`, `--loop`); `choose` and `complete` pick
valid values for the rest by a simple preference (fill the SMs, loop tiles near 64 wide), before the
cost model's tuning; `candidates` lists the values worth trying for one symbol.
"""

import itertools
import math
from typing import Mapping

import sympy

from ..base.errors import PrismError
from ..ir.nodes import Program
from .constraints import constraints, instantiate_program, valid, written_at
from .hardware import Hardware
from .kernel import AXES, free_symbols, kernels_of, splits, tile_dim
from .sizes import int_value, value


def choose(program: Program, dims: Mapping[sympy.Symbol, int], fixed: Mapping[sympy.Symbol, int],
           hardware: Hardware, prefer: str = "fill") -> dict[sympy.Symbol, int]:
    """Values for the kernel symbols not in `fixed`: a valid choice. With `prefer="fill"`, a grid that
    fills the SMs without many more blocks than that and loop tiles near 64 wide (a cost model comes
    later); with `prefer="split"`, every symbol above 1 where possible, and small: the choice that
    exercises every split and loop at the least cost, for checking kernels numerically.

    Candidates for each symbol are the divisors of the sizes it splits (or 1..8 when it splits none).
    Raises PrismError, with the violations of the last candidate tried, when no choice is valid.
    """
    free = [s for s in free_symbols(program) if s not in fixed]
    binding = {**dims, **fixed}
    if not free:
        instantiate_program(program, binding, hardware)
        return {}
    cands = {s: candidates(program, s, binding) for s in free}
    best, best_key, last_problem = None, None, None
    for values in itertools.islice(itertools.product(*(cands[s] for s in free)), 20000):
        trial = {**binding, **dict(zip(free, values))}
        if not all(valid(k, trial, hardware) for k in kernels_of(program)):
            last_problem = trial
            continue
        if prefer == "split":
            key = (-sum(v > 1 for v in values), sum(values))
        else:
            key = _preference(program, trial, hardware)
        if best_key is None or key < best_key:
            best, best_key = dict(zip(free, values)), key
    if best is None:
        given = "".join(f", {s} = {v}" for s, v in fixed.items())
        tried = ", ".join(f"{s} = {last_problem[s]}" for s in free) if last_problem else ""
        violated = [(k, v) for k in kernels_of(program) for c in constraints(k, hardware)
                    if (v := c.violation(last_problem))] if last_problem else []
        raise PrismError("no choice of " + ", ".join(str(s) for s in free) + (f" (with{given[1:]} as given)" if given else "")
                         + " satisfies the constraints" + (f"; at the last one tried, {tried}" if tried else "") + ":\n  "
                         + "\n  ".join([v for _, v in violated] or ["no candidates"]),
                         written_at(program, *violated[0]) if violated else None)  # the first's tile or store
    return best


def complete(program: Program, dims: Mapping[sympy.Symbol, int], params: Mapping[str, int], hardware: Hardware,
             prefer: str = "fill") -> dict[str, int]:
    """Every kernel parameter of the program by name: those in `params`, and valid choices (`choose`)
    for the rest. A name that is no kernel parameter is an error."""
    symbols = {s.name: s for s in free_symbols(program)}
    unknown = sorted(set(params) - set(symbols))
    if unknown:
        known = ", ".join(symbols) or "none"
        raise PrismError(f"program '{program.name}' has no kernel parameter {', '.join(unknown)} (its parameters: {known})")
    fixed = {symbols[n]: v for n, v in params.items()}
    chosen = choose(program, dims, fixed, hardware, prefer)
    return {**params, **{s.name: v for s, v in chosen.items()}}


def candidates(program: Program, sym: sympy.Symbol, binding) -> list[int]:
    """The values worth trying for `sym`: the divisors of the sizes it splits (1..8 when it splits none)."""
    sizes = set()
    for k in kernels_of(program):
        for size, splitters in splits(k):
            if any(sym in s.free_symbols for s in splitters) and (whole := value(size, binding)) is not None:
                sizes.add(int(whole))
    if not sizes:
        return list(range(1, 9))
    return divisors(math.gcd(*sizes))


MAX_DIVISORS = 64  # candidates per symbol: every divisor of real sizes (4096 has 13, 12288 has 26)


def divisors(n: int, limit: int = MAX_DIVISORS) -> list[int]:
    """The divisors of `n` in increasing order, found by factoring (so n = 2^32 costs microseconds, not a
    loop to n). Beyond `limit` of them (a highly composite size), a geometric spread from 1 to n: every
    kept divisor at least (n ** (1 / limit)) times the one before, so small and large tiles both stay."""
    every = sympy.divisors(int(n))
    if len(every) <= limit:
        return every
    ratio = float(n) ** (1.0 / limit)
    kept = [1]
    for d in every[1:-1]:
        if d >= kept[-1] * ratio:
            kept.append(d)
    return kept + [int(n)]


def _preference(program: Program, binding, hardware: Hardware) -> tuple:
    blocks, loop_tiles = 0, []
    for k in kernels_of(program):
        blocks = max(blocks, math.prod(int_value(g, binding) for _, g in k.grid))
        for load in k.loads:
            d = load.map.loop_dim()
            if d is not None:
                loop_tiles.append(int(value(tile_dim(k.inputs[load.source].shape[d], load.map.dims[d], k), binding)))
    fill = abs(math.log(blocks / hardware.sms)) if blocks else 99.0
    width = sum(abs(math.log(t / 64)) for t in loop_tiles)  # tiles whose width is fixed add a constant
    return (round(fill, 1), round(width, 1))


def resolve_params(program: Program, grid: Mapping[str, int], loop: Mapping[str, int]) -> dict[str, int]:
    """Kernel parameters by symbol name, from the command line's `--grid` and `--loop` values.

    A `--grid` name is a grid symbol (`gx=96`) or an axis (`x=96`: every kernel whose axis x has a free
    symbol for its size); a `--loop` name is a loop symbol, or "" (a bare `--loop 64`: every kernel's
    loop symbol). Anything that names no parameter is an error that lists the parameters there are.
    """
    dims = {d.symbol for d in program.dims}
    kernels = kernels_of(program)
    grid_syms = {s.name for k in kernels for _, g in k.grid for s in g.free_symbols - dims}
    loop_syms = {s.name for k in kernels if k.loop is not None for s in k.loop.free_symbols - dims}
    out: dict[str, int] = {}

    def known() -> str:
        listed = ", ".join(sorted(grid_syms | loop_syms)) or (
            "none: every grid size and loop range is fixed" if kernels else "none: it has no custom kernels; `prismc "
            "compile` lowers its operators into kernels with parameters of their own (--search none to keep them)")
        return f" (kernel parameters of '{program.name}': {listed})"

    def put(names: list[str], given: int, none: str = "") -> None:
        """`given` for every parameter in `names`; the error `none` when there is none."""
        if not names:
            raise PrismError(none + known())
        for name in names:
            if given < 1:
                raise PrismError(f"{name} must be at least 1, got {given}")
            if out.get(name, given) != given:
                raise PrismError(f"{name} is given two values ({out[name]} and {given})")
            out[name] = given

    for name, given in grid.items():
        if name in grid_syms:
            put([name], given)
        elif name in AXES:
            put([s.name for k in kernels for a, g in k.grid if a == name for s in g.free_symbols - dims if g.is_Symbol],
                given, f"no kernel has a grid axis {name} of free size")
        elif program.dim(name) is not None:
            raise PrismError(f"'{name}' is a dim of the program; set it with --dims{known()}")
        elif name in loop_syms:
            raise PrismError(f"'{name}' is a loop range; set it with --loop{known()}")
        else:
            raise PrismError(f"--grid {name}=...: no grid axis or grid symbol '{name}'{known()}")
    for name, given in loop.items():
        if name == "":
            put([s.name for k in kernels if k.loop is not None and k.loop.is_Symbol for s in k.loop.free_symbols - dims],
                given, "no kernel has a loop of free range")
        elif name in loop_syms:
            put([name], given)
        elif program.dim(name) is not None:
            raise PrismError(f"'{name}' is a dim of the program; set it with --dims{known()}")
        elif name in grid_syms:
            raise PrismError(f"'{name}' is a grid size; set it with --grid{known()}")
        else:
            raise PrismError(f"--loop {name}=...: no loop symbol '{name}'{known()}")
    return out
