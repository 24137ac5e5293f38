"""Custom kernels: the block-graph IR, symbolic tile shapes, constraints, and instantiation.

A custom kernel (ARCHITECTURE.md section 3) launches a grid of 1 to 3 axes; each block runs a loop of `F`
iterations. Per input, a `TileMap` says which grid axis splits each dim across blocks and whether the
loop splits it; per output, which axis's blocks write side by side along each dim (axes that write no
dim add their blocks' results). The body is a graph of ordinary `ir.Node`s whose leaves are `tile`
nodes (the loaded tiles), with accumulators (`acc_*`) ending the loop part. Grid sizes and `F` are
SymPy expressions: integers, program dims, or free kernel symbols that instantiation chooses.

In a program, each output of a kernel is a `kernel` node whose operands are the kernel's inputs and
whose attr is (Kernel, output index), so kernel-level graphs mix custom and pre-defined kernels freely.

Tile shape of input dim d (the formula the search uses, with Boolean map variables m):
    tile_d = D_d / prod_p(1 - m[p][d] + m[p][d] * g_p) / (1 - m[F][d] + m[F][d] * F)
`instantiate` binds every symbol and checks the constraints (exact division, shared memory, grid limits)
against a hardware target, returning a `Concrete` kernel or every violation in words.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Mapping

import sympy

from ..base.errors import PrismError
from ..ir.nodes import Node, Program
from ..ir.ops import OPS, Kind

AXES = ("x", "y", "z")
ONE = sympy.Integer(1)


def bind(expr, binding: Mapping[sympy.Symbol, int]) -> sympy.Expr:
    """`expr` with the bound symbols replaced by their (integer) values."""
    return sympy.sympify(expr).xreplace({k: sympy.Integer(v) for k, v in binding.items()})


def value(expr, binding: Mapping[sympy.Symbol, int]) -> int | Fraction | None:
    """The exact value of `expr` when `binding` gives every symbol in it, else None (an int when whole).

    The same number `bind` gives, without SymPy on the way: sizes, tiles, shared memory and constraints
    are evaluated many thousands of times while parameters are tuned, so each expression is compiled
    once into Python arithmetic on integers and fractions (`_compiled`)."""
    symbols, fn = _compiled(expr if isinstance(expr, sympy.Basic) else sympy.sympify(expr))
    try:
        v = fn(*[int(binding[s]) for s in symbols])
    except KeyError:
        return None
    return v


def int_value(expr, binding: Mapping[sympy.Symbol, int]) -> int:
    """`value` for an expression known to be a whole number under a complete binding."""
    v = value(expr, binding)
    if v is None or v.denominator != 1:
        raise ValueError(f"{expr} is not a whole number under this binding ({v})")
    return int(v)


@cache
def _compiled(expr: sympy.Expr):
    """(symbols in order, a function of their values) computing `expr` exactly: sizes are built from
    integers, symbols, sums, products and integer powers, nothing else. Integers stay Python ints; a
    quotient becomes a Fraction only when it does not divide."""
    symbols = tuple(sorted(expr.free_symbols, key=str))
    return symbols, _function(symbols, _source(expr, {s: i for i, s in enumerate(symbols)}))


def _function(symbols: tuple, body: str):
    params = ", ".join(f"v{i}" for i in range(len(symbols)))
    return eval(f"lambda {params}: {body}", {"F": Fraction, "Q": _quotient})


def _source(e: sympy.Expr, index: Mapping[sympy.Symbol, int]) -> str:
    if e.is_Integer:
        return str(int(e))
    if e.is_Rational:
        return f"F({e.p}, {e.q})"
    if e.is_Symbol:
        return f"v{index[e]}"
    if e.is_Add:
        return "(" + " + ".join(_source(a, index) for a in e.args) + ")"
    if e.is_Mul:
        up = [a for a in e.args if not (a.is_Pow and a.exp.is_Integer and a.exp < 0)]
        down = [a.base ** -a.exp for a in e.args if a not in up]
        num = "(" + " * ".join(_source(a, index) for a in up) + ")" if up else "1"
        return f"Q({num}, (" + " * ".join(_source(a, index) for a in down) + "))" if down else num
    if e.is_Pow and e.exp.is_Integer:
        return f"({_source(e.base, index)} ** {int(e.exp)})" if e.exp > 0 else f"Q(1, {_source(e.base ** -e.exp, index)})"
    raise ValueError(f"size expression {e} is not arithmetic on integers")


def _quotient(n, d):
    if isinstance(n, int) and isinstance(d, int) and n % d == 0:
        return n // d
    return Fraction(n, d)


# -- maps --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DimMap:
    """How one dim of a tile relates to the whole tensor: split by a grid axis, by the loop, or whole.

    Printed as in the surface syntax: `:` (whole), `x`, `loop`, or `x*loop` (the axis first: block b
    owns a 1/g slice and iteration i walks 1/F of that slice)."""

    axis: str | None = None
    loop: bool = False

    def __str__(self) -> str:
        parts = ([self.axis] if self.axis else []) + (["loop"] if self.loop else [])
        return "*".join(parts) or ":"


WHOLE = DimMap()


@dataclass(frozen=True)
class TileMap:
    dims: tuple[DimMap, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self.dims) + "]"

    def axes(self) -> set[str]:
        return {d.axis for d in self.dims if d.axis}

    def dim_of(self, axis: str) -> int | None:
        """The dim (counted from the end) that `axis` splits, if any."""
        for i, d in enumerate(reversed(self.dims)):
            if d.axis == axis:
                return -1 - i
        return None

    def loop_dim(self) -> int | None:
        for i, d in enumerate(reversed(self.dims)):
            if d.loop:
                return -1 - i
        return None


@dataclass(frozen=True)
class SymbolicMap:
    """A map whose entries are not chosen yet: one 0/1 variable per (grid axis or loop, dim), the form
    the search enumerates (`m[p][d]` = 1 when axis p splits dim d). Printed as a matrix, one row per axis.

    `tile_shape` gives the tile with the Boolean formula of the module doc; `assign` gives the concrete
    `TileMap` for values of the variables (each axis and the loop splitting at most one dim)."""

    name: str
    rank: int
    axes: tuple[str, ...]  # grid axes, then "loop" when the kernel has one

    def var(self, axis: str, dim: int) -> sympy.Symbol:
        return sympy.Symbol(f"m_{self.name}_{axis}_{dim}", integer=True, nonnegative=True)

    def tile_shape(self, shape: tuple[sympy.Expr, ...], kernel: "Kernel") -> tuple[sympy.Expr, ...]:
        out = []
        for d, size in enumerate(shape):
            m = {a: self.var(a, d) for a in self.axes if a != "loop"}
            m_loop = self.var("loop", d) if "loop" in self.axes else sympy.Integer(0)
            out.append(symbolic_tile_dim(size, m, m_loop, kernel))
        return tuple(out)

    def assign(self, values: Mapping[sympy.Symbol, int]) -> TileMap:
        dims = []
        for d in range(self.rank):
            axis = next((a for a in self.axes if a != "loop" and values.get(self.var(a, d), 0)), None)
            dims.append(DimMap(axis, "loop" in self.axes and bool(values.get(self.var("loop", d), 0))))
        for a in self.axes:
            if sum(values.get(self.var(a, d), 0) for d in range(self.rank)) > 1:
                raise PrismError(f"map {self.name}: {a} may split one dim, not several")
        return TileMap(tuple(dims))

    def __str__(self) -> str:
        rows = [f"{a}: [" + ", ".join(str(self.var(a, d)) for d in range(self.rank)) + "]" for a in self.axes]
        return f"{self.name} {{" + "; ".join(rows) + "}"


@dataclass(frozen=True)
class Load:
    tile: str  # the tile's name in the body
    source: int  # which operand of the kernel (its inputs, in order of first load)
    map: TileMap


@dataclass(frozen=True)
class Store:
    name: str  # the program-level name of the output
    value: Node  # the block-level value stored
    map: TileMap  # no loop entries; extra leading entries add dims where the tile has size 1
    add: bool  # written `+=`: blocks along axes that write no dim add their results


@dataclass(frozen=True)
class Kernel:
    name: str
    grid: tuple[tuple[str, sympy.Expr], ...]  # (axis, size), axes in order x, y, z
    loop: sympy.Expr | None  # the loop range F; None: no loop (one pass)
    loads: tuple[Load, ...]
    stores: tuple[Store, ...]
    inputs: tuple[Node, ...]  # the kernel-level tensors its loads read, in order

    @property
    def loop_range(self) -> sympy.Expr:
        return self.loop if self.loop is not None else ONE

    def size(self, axis: str) -> sympy.Expr:
        return dict(self.grid).get(axis, ONE)

    def load(self, tile: str) -> Load:
        return next(l for l in self.loads if l.tile == tile)

    def tile_node(self, name: str) -> Node | None:
        """The body's node for the tile loaded as `name` (None when nothing uses it)."""
        return next((n for n in self.body() if n.op == "tile" and n.attr == name), None)

    def body(self) -> list[Node]:
        """Every block-level node, operands first, each once (a fresh list; computed once per kernel)."""
        order = self.__dict__.get("_body")
        if order is None:
            order, seen = [], set()
            for s in self.stores:
                for n in s.value.walk():
                    if id(n) not in seen:
                        seen.add(id(n))
                        order.append(n)
            object.__setattr__(self, "_body", order)  # the kernel is immutable: so is its body
        return list(order)

    def symbols(self) -> set[sympy.Symbol]:
        out: set[sympy.Symbol] = set()
        for _, g in self.grid:
            out |= g.free_symbols
        if self.loop is not None:
            out |= self.loop.free_symbols
        return out


def tile_dim(size: sympy.Expr, dim: DimMap, kernel: Kernel) -> sympy.Expr:
    """`size` divided by what splits it: the formula of the module doc with the map's 0/1 values."""
    m = {a: ONE if dim.axis == a else sympy.Integer(0) for a, _ in kernel.grid}
    return symbolic_tile_dim(size, m, ONE if dim.loop else sympy.Integer(0), kernel)


def symbolic_tile_dim(size: sympy.Expr, m: Mapping[str, sympy.Expr], m_loop: sympy.Expr, kernel: Kernel) -> sympy.Expr:
    """The tile size with Boolean map variables (0/1 values or symbols): the search's symbolic form."""
    divisor = sympy.Mul(*[(1 - m[a] + m[a] * g) for a, g in kernel.grid])
    divisor *= 1 - m_loop + m_loop * kernel.loop_range
    return size / divisor


def tile_shape(shape: tuple[sympy.Expr, ...], tmap: TileMap, kernel: Kernel) -> tuple[sympy.Expr, ...]:
    return tuple(tile_dim(s, d, kernel) for s, d in zip(shape, tmap.dims))


def output_shape(tile: tuple[sympy.Expr, ...], tmap: TileMap, kernel: Kernel) -> tuple[sympy.Expr, ...]:
    """A stored tile's full shape: the tile (left-padded with 1s to the map's rank) times the grid along
    each mapped dim. The caller has checked that extra leading tile dims are 1."""
    rank = len(tmap.dims)
    padded = (ONE,) * max(0, rank - len(tile)) + tuple(tile[-rank:] if rank else ())
    return tuple(t * (kernel.size(d.axis) if d.axis else 1) for t, d in zip(padded, tmap.dims))


def loop_varying(kernel: Kernel) -> set[Node]:
    """Body nodes whose value changes from one loop iteration to the next (before any accumulator)."""
    varying: set[Node] = set()
    for n in kernel.body():
        if n.op == "tile":
            if kernel.load(n.attr).map.loop_dim() is not None:
                varying.add(n)
        elif OPS[n.op].kind is not Kind.ACCUMULATE and any(a in varying for a in n.args):
            varying.add(n)
    return varying


def after_loop(body: list[Node]) -> set[Node]:
    """Nodes computed after the loop: accumulators, what depends on them, and tiles only they read."""
    after: set[Node] = set()
    for n in body:
        if OPS[n.op].kind is Kind.ACCUMULATE or any(a in after for a in n.args):
            after.add(n)
    in_loop = [n for n in body if n not in after or OPS[n.op].kind is Kind.ACCUMULATE]
    users_in_loop = {a for n in in_loop for a in n.args}
    for n in body:
        if n.op == "tile" and n not in users_in_loop and any(n in m.args for m in after):
            after.add(n)
    return after


# -- targets -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    arch: str
    sms: int
    smem_per_block: int
    smem_per_sm: int
    max_threads_per_block: int
    max_grid: tuple[int, int, int]
    l2_bytes: int
    bandwidth_gbs: float
    launch_overhead_us: float
    peak_tflops: Mapping[str, float]
    l2_bandwidth_gbs: float
    iteration_latency_us: float
    max_threads_per_sm: int
    max_blocks_per_sm: int

    def __hash__(self) -> int:
        return hash(self.name)


TARGETS_DIR = Path(__file__).parent / "targets"


def target_names() -> list[str]:
    return sorted(p.stem for p in TARGETS_DIR.glob("*.toml"))


@cache
def load_target(name: str = "h100") -> Target:
    path = TARGETS_DIR / f"{name.lower()}.toml"
    if not path.is_file():
        raise PrismError(f"unknown target '{name}' (known: {', '.join(target_names())})")
    try:
        data = tomllib.loads(path.read_text())
        data["max_grid"] = tuple(data["max_grid"])
        return Target(**data)
    except (tomllib.TOMLDecodeError, TypeError, KeyError) as e:
        raise PrismError(f"target file {path} is malformed: {e}") from None


# -- shared memory -----------------------------------------------------------------------------------

@cache
def shared_memory(kernel: Kernel) -> sympy.Expr:
    """Bytes of shared memory one block needs: every buffer the generated kernel allocates.

    `fusion.plan` decides them (loaded tiles in their tensor's dtype, values that must be materialized,
    accumulator state in f32; element-wise chains fused into registers take none), so this bound and the
    generated CUDA agree exactly. Buffers are not reused across the body: simple, and exact.
    """
    from .fusion import plan  # fusion reads the kernel IR defined here

    return plan(kernel).smem_bytes()


# -- instantiation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Constraint:
    """One condition on the symbols, as data: `what` in words, and how to test it under an assignment."""

    kind: str  # "divides", "smem", "grid", "positive"
    expr: sympy.Expr  # for "divides": the quotient that must be an integer; else the value to bound
    limit: int | None
    what: str

    def violation(self, binding: Mapping[sympy.Symbol, int]) -> str | None:
        v = value(self.expr, binding)
        if v is None:
            missing = ", ".join(sorted(str(s) for s in self.expr.free_symbols if s not in binding))
            return f"{self.what}: no value for {missing}"
        if self.kind == "divides":
            if v.denominator != 1:
                return f"{self.what}: {self.expr} = {sympy.Rational(v.numerator, v.denominator)} is not a whole number"
            return None
        if self.kind == "positive":
            return None if v >= 1 else f"{self.what} must be at least 1, got {sympy.Rational(v.numerator, v.denominator)}"
        if v > self.limit:
            return f"{self.what} is {int(v)}, above the limit of {self.limit}"
        return None


@cache
def constraints(kernel: Kernel, target: Target) -> list[Constraint]:
    out: list[Constraint] = []
    for axis, g in kernel.grid:
        out.append(Constraint("positive", g, None, f"kernel '{kernel.name}': grid axis {axis} ({g})"))
        limit = target.max_grid[AXES.index(axis)]
        out.append(Constraint("grid", g, limit, f"kernel '{kernel.name}': grid axis {axis} ({g} blocks)"))
    if kernel.loop is not None:
        out.append(Constraint("positive", kernel.loop, None, f"kernel '{kernel.name}': the loop range ({kernel.loop})"))
    for load in kernel.loads:
        source = kernel.inputs[load.source]
        for i, (size, dm) in enumerate(zip(source.shape, load.map.dims)):
            if dm == WHOLE:
                continue
            by = " and ".join(([f"grid axis {dm.axis} ({kernel.size(dm.axis)})"] if dm.axis else [])
                             + ([f"the loop ({kernel.loop_range})"] if dm.loop else []))
            out.append(Constraint("divides", tile_dim(size, dm, kernel), None,
                                  f"kernel '{kernel.name}': tile '{load.tile}' splits dim {i} of size {size} by {by}"))
    out.append(Constraint("smem", shared_memory(kernel), target.smem_per_block,
                          f"kernel '{kernel.name}': shared memory per block (bytes)"))
    return out


@dataclass(frozen=True)
class Concrete:
    """A kernel with every symbol bound: concrete grid, loop range and shapes."""

    kernel: Kernel
    grid: tuple[tuple[str, int], ...]
    loop: int
    binding: Mapping[sympy.Symbol, int]
    smem_bytes: int

    def shape(self, node: Node) -> tuple[int, ...]:
        return tuple(int_value(s, self.binding) for s in node.shape)

    def output_shape(self, index: int) -> tuple[int, ...]:
        store = self.kernel.stores[index]
        return tuple(int_value(s, self.binding) for s in output_shape(store.value.shape, store.map, self.kernel))

    def blocks(self) -> int:
        return math.prod(g for _, g in self.grid)


def valid(kernel: Kernel, binding: Mapping[sympy.Symbol, int], target: Target) -> bool:
    """Whether `instantiate` would succeed: every constraint at once, compiled (`_checker`)."""
    symbols, fn = _checker(kernel, target)
    try:
        return fn(*[int(binding[s]) for s in symbols])
    except KeyError:
        return False


@cache
def _checker(kernel: Kernel, target: Target):
    """(symbols, a function of their values) true when every constraint of `kernel` holds."""
    checks = constraints(kernel, target)
    symbols = tuple(sorted(set().union(*(sympy.sympify(c.expr).free_symbols for c in checks)), key=str))
    index = {s: i for i, s in enumerate(symbols)}
    tests = []
    for c in checks:
        e = _source(sympy.sympify(c.expr), index)
        tests.append(f"({e}).denominator == 1" if c.kind == "divides" else f"({e}) >= 1" if c.kind == "positive"
                     else f"({e}) <= {c.limit}")
    return symbols, _function(symbols, " and ".join(tests) or "True")


def instantiate(kernel: Kernel, binding: Mapping[sympy.Symbol, int], target: Target) -> Concrete | list[str]:
    """The kernel with all symbols bound, or every violated constraint in words."""
    if not valid(kernel, binding, target):
        return [v for c in constraints(kernel, target) if (v := c.violation(binding))]
    grid = tuple((a, int_value(g, binding)) for a, g in kernel.grid)
    smem = int_value(shared_memory(kernel), binding)
    return Concrete(kernel, grid, int_value(kernel.loop_range, binding), dict(binding), smem)


def kernels_of(program: Program) -> list[Kernel]:
    """The program's custom kernels, in the order they run."""
    seen: dict[int, Kernel] = {}
    for n in program.nodes():
        if n.op == "kernel":
            seen.setdefault(id(n.attr[0]), n.attr[0])
    return list(seen.values())


def free_symbols(program: Program) -> list[sympy.Symbol]:
    """The kernel symbols (grid sizes and loop ranges that are not program dims), in order of appearance."""
    dims = {d.symbol for d in program.dims}
    out: list[sympy.Symbol] = []
    for k in kernels_of(program):
        for _, g in k.grid + ((("loop", k.loop),) if k.loop is not None else ()):
            for s in sorted(g.free_symbols - dims, key=str):
                if s not in out:
                    out.append(s)
    return out


def instantiate_program(program: Program, binding: Mapping[sympy.Symbol, int], target: Target) -> dict[str, Concrete]:
    """Every kernel instantiated; raises one PrismError listing every violated constraint."""
    out: dict[str, Concrete] = {}
    problems: list[str] = []
    for k in kernels_of(program):
        c = instantiate(k, binding, target)
        if isinstance(c, list):
            problems += c
        else:
            out[k.name] = c
    if problems:
        raise PrismError("the kernel parameters are not valid:\n  " + "\n  ".join(problems))
    return out


def choose(program: Program, dims: Mapping[sympy.Symbol, int], fixed: Mapping[sympy.Symbol, int],
           target: Target, prefer: str = "fill") -> dict[sympy.Symbol, int]:
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
        instantiate_program(program, binding, target)
        return {}
    cands = {s: _candidates(program, s, binding) for s in free}
    best, best_key, last_problem = None, None, None
    for values in _product(cands, free, limit=20000):
        trial = {**binding, **dict(zip(free, values))}
        if not all(valid(k, trial, target) for k in kernels_of(program)):
            last_problem = trial
            continue
        if prefer == "split":
            key = (-sum(v > 1 for v in values), sum(values))
        else:
            key = _preference(program, trial, target)
        if best_key is None or key < best_key:
            best, best_key = dict(zip(free, values)), key
    if best is None:
        given = "".join(f", {s} = {v}" for s, v in fixed.items())
        raise PrismError("no choice of " + ", ".join(str(s) for s in free) + (f" (with{given[1:]} as given)" if given else "")
                         + " satisfies the constraints:\n  "
                         + "\n  ".join([v for k in kernels_of(program) for c in constraints(k, target)
                                        if (v := c.violation(last_problem))] if last_problem else ["no candidates"]))
    return best


def complete(program: Program, dims: Mapping[sympy.Symbol, int], params: Mapping[str, int], target: Target,
             prefer: str = "fill") -> dict[str, int]:
    """Every kernel parameter of the program by name: those in `params`, and valid choices (`choose`)
    for the rest. A name that is no kernel parameter is an error."""
    symbols = {s.name: s for s in free_symbols(program)}
    unknown = sorted(set(params) - set(symbols))
    if unknown:
        known = ", ".join(symbols) or "none"
        raise PrismError(f"program '{program.name}' has no kernel parameter {', '.join(unknown)} (its parameters: {known})")
    fixed = {symbols[n]: v for n, v in params.items()}
    chosen = choose(program, dims, fixed, target, prefer)
    return {**params, **{s.name: v for s, v in chosen.items()}}


def _candidates(program: Program, sym: sympy.Symbol, binding) -> list[int]:
    sizes = set()
    for k in kernels_of(program):
        for load in k.loads:
            for size, dm in zip(k.inputs[load.source].shape, load.map.dims):
                splitters = ([k.size(dm.axis)] if dm.axis else []) + ([k.loop_range] if dm.loop else [])
                if any(sym in s.free_symbols for s in splitters):
                    whole = value(size, binding)
                    if whole is not None:
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


def _product(cands, order, limit):
    import itertools

    for i, values in enumerate(itertools.product(*(cands[s] for s in order))):
        if i >= limit:
            return
        yield values


def _preference(program: Program, binding, target: Target) -> tuple:
    blocks, loop_tiles = 0, []
    for k in kernels_of(program):
        blocks = max(blocks, math.prod(int_value(g, binding) for _, g in k.grid))
        for load in k.loads:
            d = load.map.loop_dim()
            if d is not None:
                loop_tiles.append(int(value(tile_dim(k.inputs[load.source].shape[d], load.map.dims[d], k), binding)))
    fill = abs(math.log(blocks / target.sms)) if blocks else 99.0
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

    def put(name: str, value: int) -> None:
        if value < 1:
            raise PrismError(f"{name} must be at least 1, got {value}")
        if out.get(name, value) != value:
            raise PrismError(f"{name} is given two values ({out[name]} and {value})")
        out[name] = value

    def known() -> str:
        listed = ", ".join(sorted(grid_syms | loop_syms)) or "none: every grid size and loop range is fixed"
        return f" (kernel parameters of '{program.name}': {listed})"

    for name, value in grid.items():
        if name in grid_syms:
            put(name, value)
        elif name in AXES:
            targets = [s.name for k in kernels for a, g in k.grid if a == name for s in g.free_symbols - dims
                       if g.is_Symbol]
            if not targets:
                raise PrismError(f"no kernel has a grid axis {name} of free size{known()}")
            for t in targets:
                put(t, value)
        elif program.dim(name) is not None:
            raise PrismError(f"'{name}' is a dim of the program; set it with --dims{known()}")
        else:
            raise PrismError(f"--grid {name}=...: no grid axis or grid symbol '{name}'{known()}")
    for name, value in loop.items():
        if name == "":
            targets = [s.name for k in kernels if k.loop is not None and k.loop.is_Symbol
                       for s in k.loop.free_symbols - dims]
            if not targets:
                raise PrismError(f"no kernel has a loop of free range{known()}")
            for t in targets:
                put(t, value)
        elif name in loop_syms:
            put(name, value)
        else:
            raise PrismError(f"--loop {name}=...: no loop symbol '{name}'{known()}")
    return out
