"""Constraints on a kernel's symbols, and instantiation: binding every symbol for a GPU.

Each kernel brings conditions, as data (`Constraint`): grid sizes and the loop range at least 1, grid
axes within the hardware's limits, every split tile dim a whole number, every tile a block computes within
what the generated code counts in an int (INT_MAX elements), and the shared memory that the fusion plan
allocates within the hardware's per-block limit. `instantiate` checks them all and returns a
`Concrete` kernel or every violation in words; `valid` answers the same question compiled, for tuning.
The shared-memory bound holds however the code is generated; the backend, which knows what its layout
keeps in registers, may instead have the kernel's generated shared memory checked (`instantiate`'s
`generated`).
"""

import math
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Callable, Mapping

import sympy

from ..base.errors import Diagnostic, Loc, PrismError
from ..ir.nodes import Node, Program
from .fusion import ALIGN, plan
from .hardware import Hardware
from .kernel import AXES, WHOLE, Kernel, kernels_of, output_shape, tile_dim
from .lifetimes import class_sums, lifetimes, total
from .sizes import call, compile_sizes, int_value, value


@cache
def shared_memory(kernel: Kernel) -> sympy.Expr:
    """Bytes of shared memory one block needs, at most: every buffer the generated kernel allocates, those
    never in use at once sharing bytes (`lifetimes.arrange`).

    `fusion.plan` decides the buffers (loaded tiles in their tensor's dtype, values that must be
    materialized, accumulator state in f32; element-wise chains fused into registers take none) and
    `lifetimes` when each is in use. The bound counts every buffer with its full row padding and 128 bytes
    of alignment; the generated code lays out the same classes, some without padding or dropped (online
    softmax in registers) or later-lived (state held in registers through the loop), so it never needs
    more.
    """
    return _arranged(kernel, {b.name: b.bytes for b in plan(kernel).buffers}, _bound)


def shared_memory_at(kernel: Kernel, binding: Mapping[sympy.Symbol, int]) -> int | None:
    """`shared_memory` at a binding (None where it leaves a symbol free), from each buffer's bytes there: the
    search asks it of kernels it builds by the hundred, most never instantiated, whose symbolic bound costs
    SymPy's arithmetic on every buffer."""
    sizes = {b.name: value(b.bytes, binding) for b in plan(kernel).buffers}
    return None if None in sizes.values() else _arranged(kernel, sizes, max)


def _arranged(kernel: Kernel, sizes: Mapping[str, object], maximum):
    """The bytes of the plan's buffers of these `sizes` (by name, in the plan's order), each with its
    alignment, arranged by their lifetimes (`maximum`: `max`, or `_bound` for the symbolic bound)."""
    return total(class_sums(list(sizes), {n: v + ALIGN for n, v in sizes.items()}, lifetimes(kernel)), maximum)


def _bound(*terms: sympy.Expr) -> sympy.Expr:
    """The largest of `terms`, symbolic: a term that another exceeds for every value of the (positive) symbols,
    by a sum of positive terms, is dropped (a zero; a class that holds another's buffers and more), the rest
    kept unevaluated. `sympy.Max` would compare every pair under the symbols' assumptions, which costs the
    search seconds per program and changes no value."""
    terms = list(dict.fromkeys(sympy.sympify(t) for t in terms))
    kept = [t for t in terms if not any(u is not t and _positive(u - t) for u in terms)]
    return kept[0] if len(kept) == 1 else sympy.Max(*kept, evaluate=False)


def _positive(e: sympy.Expr) -> bool:
    """Whether `e` is positive by its form: positive numbers and symbols, and sums, products and powers of
    them (False where that takes more, which only keeps a term `_bound` could have dropped)."""
    if e.is_Number or e.is_Symbol:
        return bool(e.is_positive)
    if e.is_Add or e.is_Mul:
        return all(_positive(a) for a in e.args)
    return bool(e.is_Pow) and _positive(e.base)


@dataclass(frozen=True)
class Constraint:
    """One condition on the symbols, as data: `what` in words, and how to test it under an assignment."""

    kind: str  # "divides", "smem", "grid", "elements", "positive"
    expr: sympy.Expr  # for "divides": the quotient that must be an integer; else the value to bound
    limit: int | None
    what: str

    def violation(self, binding: Mapping[sympy.Symbol, int]) -> str | None:
        v = value(self.expr, binding)
        if v is None:
            missing = ", ".join(sorted(str(s) for s in self.expr.free_symbols if s not in binding))
            return f"{self.what}: no value for {missing}"
        shown = sympy.Rational(v.numerator, v.denominator)
        if self.kind == "divides":
            if v.denominator == 1:
                return None
            top, bottom = (value(e, binding) for e in sympy.fraction(sympy.together(self.expr)))  # (not reduced: 96/768)
            if top is not None and bottom is not None and top.denominator == bottom.denominator == 1 and bottom != v.denominator:
                shown = f"{top}/{bottom} = {shown}"
            return f"{self.what}: {self.expr} = {shown} is not a whole number"
        if self.kind == "positive":
            return None if v >= 1 else f"{self.what} must be at least 1, got {shown}"
        return f"{self.what} is {int(v)}, above the limit of {self.limit}" if v > self.limit else None


INT_MAX = 2**31 - 1  # the generated code counts a block's elements, and offsets in tensors an int reaches, in int


@cache
def constraints(kernel: Kernel, hardware: Hardware) -> list[Constraint]:
    out: list[Constraint] = []
    for axis, g in kernel.grid:
        out.append(Constraint("positive", g, None, f"kernel '{kernel.name}': grid axis {axis} ({g})"))
        limit = hardware.max_grid[AXES.index(axis)]
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
    for n in (n for n in kernel.body() if n.op == "rope"):  # it pairs each element with one half a row away
        out.append(Constraint("divides", sympy.sympify(n.shape[-1]) / 2, None,
                              f"kernel '{kernel.name}': rope's rows in a tile ({n.shape[-1]} elements) must be even"))
    # a block's threads walk each tile by one flat int index (a tile of 57344 x 57344 elements wraps it); a tile
    # with a shared buffer is bounded far below by the shared memory's limit
    held = {b.node for b in plan(kernel).buffers}
    for elements in dict.fromkeys(sympy.Mul(*n.shape) for n in kernel.body() if n not in held):
        out.append(Constraint("elements", elements, INT_MAX,
                              f"kernel '{kernel.name}': elements of one block's tile ({elements})"))
    out.append(Constraint("smem", shared_memory(kernel), hardware.smem_per_block,
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
    _shapes: dict = field(default_factory=dict, compare=False, repr=False)  # id(node) -> (node, its shape)
    # what the backend derives from the kernel alone, by key (`backend.launch.layout`'s, per codegen config);
    # kept by `replace(c, smem_bytes=...)`, which nothing derived depends on
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def shape(self, node: Node) -> tuple[int, ...]:
        """The node's shape at this binding, remembered (the cost model asks for the same nodes many times;
        the entry holds the node, so its id is not reused while it is there). The first call evaluates the
        shapes of every node of the body and every input at once (`_shapes_of`)."""
        if not self._shapes:
            nodes, outputs, compiled = _shapes_of(self.kernel)
            dims = iter(_whole(call(compiled, self.binding, None), compiled))
            for n in nodes:
                self._shapes[id(n)] = (n, tuple(next(dims) for _ in n.shape))
            self._shapes["outputs"] = (None, [tuple(next(dims) for _ in shape) for shape in outputs])
        got = self._shapes.get(id(node))
        if got is None or got[0] is not node:
            got = self._shapes[id(node)] = (node, tuple(int_value(s, self.binding) for s in node.shape))
        return got[1]

    def output_shape(self, index: int) -> tuple[int, ...]:
        if not self._shapes:
            self.shape(self.kernel.stores[index].value)
        return self._shapes["outputs"][1][index]

    def blocks(self) -> int:
        return math.prod(g for _, g in self.grid)


@cache
def _shapes_of(kernel: Kernel) -> tuple[list[Node], list[tuple], tuple]:
    """The kernel's block-level nodes and inputs, its stores' full shapes, and a compiled function
    (`sizes.compile_sizes`) of the binding giving every dim of all of them, in that order, as one tuple."""
    nodes = list(dict.fromkeys([*kernel.body(), *kernel.inputs]))
    outputs = [output_shape(s.value.shape, s.map, kernel) for s in kernel.stores]
    dims = [sympy.sympify(d) for n in nodes for d in n.shape] + [sympy.sympify(d) for shape in outputs for d in shape]
    return nodes, outputs, compile_sizes(dims, lambda sources: "(" + "".join(f"{x}, " for x in sources) + ")")


def _whole(dims: tuple | None, compiled: tuple) -> tuple[int, ...]:
    """`dims` (a `_shapes_of` result), checked whole: a kernel's shapes are under any binding it is instantiated
    with (the constraints say so); raises ValueError otherwise, as `int_value` does."""
    if dims is None:
        raise ValueError(f"no value for every symbol of {', '.join(map(str, compiled[0]))}")
    if any(getattr(d, "denominator", 1) != 1 for d in dims):
        raise ValueError(f"a shape is not a whole number under this binding: {dims}")
    return tuple(int(d) for d in dims)


def valid(kernel: Kernel, binding: Mapping[sympy.Symbol, int], hardware: Hardware, smem: bool = True) -> bool:
    """Whether `instantiate` would succeed: every constraint at once, compiled (`_checker`); with `smem`
    False, every one but the shared-memory bound."""
    return call(_checker(kernel, hardware, smem), binding, False)


@cache
def _checker(kernel: Kernel, hardware: Hardware, smem: bool = True) -> tuple:
    """(symbols, a function of their values) true when every constraint of `kernel` holds (the shared-memory
    bound left out where `smem` is False)."""
    checks = [c for c in constraints(kernel, hardware) if smem or c.kind != "smem"]
    forms = {"divides": "({}).denominator == 1", "positive": "({}) >= 1"}  # "smem", "grid": at most the limit
    test = lambda sources: " and ".join(  # noqa: E731
        forms.get(c.kind, f"({{}}) <= {c.limit}").format(e) for c, e in zip(checks, sources)) or "True"
    return compile_sizes([sympy.sympify(c.expr) for c in checks], test)


def instantiate(kernel: Kernel, binding: Mapping[sympy.Symbol, int], hardware: Hardware,
                generated: Callable[[Concrete], int] | None = None) -> Concrete | list[str]:
    """The kernel with all symbols bound, or every violated constraint in words.

    `generated`: the bytes of shared memory the code generated for a concrete kernel takes (the backend's
    layout, which knows what the code generator keeps in registers). The bound (`shared_memory`) holds
    however the code is generated; where it is over the limit, the kernel is still valid if what is
    generated for it fits, and its `smem_bytes` are those."""
    grid = tuple((a, int_value(g, binding)) for a, g in kernel.grid)
    if valid(kernel, binding, hardware):
        smem = int_value(shared_memory(kernel), binding)
        return Concrete(kernel, grid, int_value(kernel.loop_range, binding), dict(binding), smem)
    problems = [v for c in constraints(kernel, hardware) if (v := c.violation(binding))]
    if generated is None or not valid(kernel, binding, hardware, smem=False):
        return problems
    c = Concrete(kernel, grid, int_value(kernel.loop_range, binding), dict(binding), 0)
    used = generated(c)
    if used > hardware.smem_per_block:
        return [f"{p}; as generated, {used}" for p in problems]
    return replace(c, smem_bytes=used)


def instantiate_program(program: Program, binding: Mapping[sympy.Symbol, int], hardware: Hardware,
                        generated: Callable[[Concrete], int] | None = None) -> dict[str, Concrete]:
    """Every kernel instantiated (`generated` as `instantiate` takes it); raises one PrismError listing every
    violated constraint, each where the program writes the kernel (`written_at`) if it does."""
    out: dict[str, Concrete] = {}
    problems: list[Diagnostic] = []
    for k in kernels_of(program):
        c = instantiate(k, binding, hardware, generated)
        if isinstance(c, list):
            problems += [Diagnostic(written_at(program, k, p), f"the kernel parameters are not valid: {p}") for p in c]
        else:
            out[k.name] = c
    if problems:
        raise PrismError(problems)
    return out


def written_at(program: Program, kernel: Kernel, problem: str) -> Loc | None:
    """Where the program writes what `problem` is about: the load of the tile it names, else the kernel's first
    store; for a pre-defined kernel (`lower`), where the op it computes was written; else None."""
    tiles = [n for n in kernel.body() if n.op == "tile" and f"tile '{n.attr}'" in problem]
    stores = [n for n in program.nodes() if n.op == "kernel" and n.attr[0] is kernel]
    return next((program.locs[n] for n in [*tiles, *stores] if n in program.locs), None)
