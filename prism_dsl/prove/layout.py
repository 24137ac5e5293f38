"""Custom kernels as terms with layout operators, for the prover.

A kernel's tiles are seen all at once as one *tile family*: a tensor whose last KERNEL_RANK dims hold
a tile's data and whose dims before that index the blocks (grid axis x at dim -6, y at -7, z at -8) and
the loop's iterations (dim -9). A tensor whose family has size 1 along a block dim is the same for
every block there (replicated: broadcasting does the rest). Then:

- a load is `split` applied per mapped dim: `split(T, d, -6, gx)` cuts dim d into gx equal pieces and
  lays them along x; the grid axis splits first, the loop (`split(.., d, -9, F)`) within that;
- body ops are the same ops on families (element-wise ops and matmul broadcast over the block dims;
  reductions keep their dim counted from the end);
- a mask places its tiles: `causal(s)` in a body is `causal_at(s, r, c)`, where r and c are the places
  of s's rows and columns counted from the end of the whole tensors (`from_end`), loaded (split) like the
  tile each dim comes from (`kernels.position`), as the block interpreter and the code generator place them;
- an accumulator is its `acc_*` operator, which folds the loop dim -9 (its meaning is an axiom);
- a store is `concat` along each mapped axis (the pieces side by side again) and a `sum` over the block
  dim of each axis that writes no dim (the blocks' results added), innermost axis first.

Every one of these operators has NumPy semantics (`semantics.reference.NUMPY`), so the translated
program can be evaluated and compared with the block interpreter, and the layout axioms
(rules/layout.rules) are checked numerically like all others. The sizes stay symbolic (grid symbols, F), so a proof over the
translated program holds for every valid instantiation.
"""

from __future__ import annotations

import sympy

from ..ir.nodes import Node, Program
from ..kernels.kernel import AXES, ONE, Kernel
from ..kernels.position import origin
from ..ir.ops import BLOCK_DIMS, LOOP_DIM
from ..ir.shapes import build, dim_params, same


def _from_end(n: Node, args: list[Node]) -> Node:
    """`n`'s op over `args`, a reduction's dim counted from the end: a family has more dims than `n`."""
    return build(n.op, args, dim_params(n))


def kernel_terms(kernel: Kernel, operands: list[Node]) -> list[Node]:
    """The family term of each of the kernel's outputs, over the (translated) operand terms."""
    fam: dict[Node, Node] = {}
    for load in kernel.loads:
        t = operands[load.source]
        for axis, g in kernel.grid:
            d = load.map.dim_of(axis)
            if d is not None and not same(g, ONE):
                t = build("split", [t], [d, BLOCK_DIMS[axis], g])
        d = load.map.loop_dim()
        if d is not None and not same(kernel.loop_range, ONE):
            t = build("split", [t], [d, LOOP_DIM, kernel.loop_range])
        tile = kernel.tile_node(load.tile)
        if tile is not None:  # a tile loaded but never used contributes nothing
            fam[tile] = t
    for n in kernel.body():
        if n in fam:
            continue
        if n.op == "const":
            fam[n] = n
            continue
        if n.op == "causal":
            s = fam[n.args[0]]
            fam[n] = build("causal_at", [s, _places(kernel, operands, n, -2, s), _places(kernel, operands, n, -1, s)])
            continue
        fam[n] = _from_end(n, [fam[a] for a in n.args])
    outs = []
    for store in kernel.stores:
        v = fam[store.value]
        for axis in reversed(AXES):
            g = kernel.size(axis)
            if axis not in dict(kernel.grid) or same(g, ONE):
                continue
            d = store.map.dim_of(axis)
            v = build("concat", [v], [d, BLOCK_DIMS[axis]]) if d is not None else build("sum", [v], [BLOCK_DIMS[axis]])
        outs.append(v)
    return outs


def _places(kernel: Kernel, operands: list[Node], n: Node, dim: int, family: Node) -> Node:
    """The places of body value `n`'s elements along `dim` in the whole tensor, counted from its end, as a
    family: the tile dim it comes from, split by the grid axis and the loop as its load splits it (a dim
    that comes from no tile is whole: its own size)."""
    o = origin(kernel, n, dim)
    if o is None:
        return build("from_end", [family], [dim])
    whole = operands[o.load.source]
    if o.dim != dim:  # the tile's dim lies along another dim of n (a transposed operand)
        whole = build("transpose", [whole], [o.dim, dim])
    t = build("from_end", [whole], [dim])
    dm = o.dm
    g = dict(kernel.grid).get(dm.axis) if dm.axis else None
    if g is not None and not same(g, ONE):
        t = build("split", [t], [dim, BLOCK_DIMS[dm.axis], g])
    if dm.loop and not same(kernel.loop_range, ONE):
        t = build("split", [t], [dim, LOOP_DIM, kernel.loop_range])
    return t


def to_terms(program: Program) -> Program:
    """The program with every custom kernel replaced by its layout terms (unchanged if it has none)."""
    if not any(n.op == "kernel" for n in program.nodes()):
        return program
    memo: dict[Node, Node] = {}
    outputs: dict[int, list[Node]] = {}
    for n in program.nodes():
        if n.op in ("input", "const"):
            memo[n] = n
        elif n.op == "kernel":
            kernel, index = n.attr
            if id(kernel) not in outputs:
                outputs[id(kernel)] = kernel_terms(kernel, [memo[a] for a in n.args])
            memo[n] = outputs[id(kernel)][index]
        else:
            memo[n] = _from_end(n, [memo[a] for a in n.args])
    return Program(program.name, program.dims, program.inputs,
                   tuple((name, memo[node]) for name, node in program.outputs), {}, {}, program.loc)


def bind_counts(program: Program, binding) -> Program:
    """The translated program with every split count bound to a number, so that NumPy can evaluate it
    (tests compare it with the block interpreter: the translation must mean what the kernel computes)."""
    memo: dict[Node, Node] = {}

    def go(n: Node) -> Node:
        if n not in memo:
            attr = n.attr
            if n.op == "split":
                attr = (attr[0], attr[1], int(sympy.sympify(attr[2]).xreplace({k: sympy.Integer(v) for k, v in binding.items()})))
            memo[n] = Node(n.op, tuple(go(a) for a in n.args), attr, n.dtype, n.shape)
        return memo[n]

    for n in program.nodes():
        go(n)
    return Program(program.name, program.dims, program.inputs,
                   tuple((name, memo[node]) for name, node in program.outputs), {}, {}, program.loc)
