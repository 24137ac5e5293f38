"""Pre-defined kernels: every kernel-level op a program computes outside custom kernels becomes a kernel.

Where it sits: before instantiation and codegen. A program as written (`rms_norm(X) @ W`) has no custom
kernels; to render, run and time it, each of its operators becomes one *pre-defined kernel*, expressed
as a small custom kernel of the same IR, so the one code generator, the block interpreter, the cost
model and the proofs all apply to it unchanged:

- element-wise chains: one kernel per chain (thread-level fusion at kernel level: an element-wise value
  with one element-wise user is computed inside its user's kernel); a row per block on grid axis x (up
  to 2^31 - 1 of them), the last dim in pieces on y (free size), one plane per block along z;
- matmul: blocks split the output's columns (x) and rows (y), and the batch dim before them (z, one
  per block); the loop walks the contracted dim and `acc_sum` adds the partial products; a product that
  only feeds an element-wise chain of its shape is computed in that chain's kernel, the chain after the
  loop (its epilogue: `_epilogues`);
- reductions: blocks split the kept dims; each block holds the reduced dim whole;
- row-wise ops (`rms_norm`, `layer_norm`, `softmax`): one block per group of rows, each row whole; or, for
  rows no block holds, two kernels: blocks take pieces of each row for its statistics, then combine them
  (`_long_rows`; `lowered_forms` offers both ways).

Grid sizes and loop ranges are fresh free symbols (`gx_NAME`, `F_NAME`), chosen at instantiation like
those of hand-written kernels. Kernel and store names come from the program's names for the values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np
import sympy

from ..ir.nodes import DType, Node, Program, dim_symbol
from .finishing import finish_sums
from .fusion import row_op
from .kernel import (AXES, DimMap, Kernel, Load, Store, TileMap, free_symbols, fresh_name, kernels_of,
                     output_shape, tile_shape)
from ..ir.ops import KERNEL_RANK, OPS, Kind
from ..ir.shapes import build, padded, rebuild, same
from ..base.errors import PrismError

_ELEMENTWISE = (Kind.UNARY, Kind.BINARY, Kind.MASK, Kind.TRANSPOSE)  # computed inside their user's kernel


def check_compilable(program: Program) -> None:
    """What the kernels cannot take in a program that `lang.check` accepts (`prismc run` evaluates it), said where the
    program (or the input) is declared, before a search: an output that is an input itself, which no kernel computes;
    one that is another output's value again, which its kernel stores once; an input of no dims (`f32[]`), whose tile
    no kernel's maps can address (one of shape [1] broadcasts alike: x * s is the same for s of shape [] and [1] where
    x has a dim), or of more than KERNEL_RANK; a constant f32 (their arithmetic) makes 0 or infinite, kernels' too."""
    for i, (name, node) in enumerate(program.outputs):
        if node.op == "input":
            raise PrismError(f"program '{program.name}': output '{name}' is input '{node.attr}' itself: there is "
                             "nothing to compute; return values the program computes", program.loc)
        if same := next((n for n, v in program.outputs[:i] if v is node), None):  # interned: equal values, one node
            raise PrismError(f"program '{program.name}': output '{name}' is the value of output '{same}', which its "
                             "kernel stores once; return each value once", program.loc)
    for node in program.inputs:
        if not node.shape:
            raise PrismError(f"program '{program.name}': input '{node.attr}' has no dims, which kernels cannot load; "
                             f"declare it {node.dtype.value}[1], which broadcasts the same way",
                             program.locs.get(node, program.loc))
        if node.rank > KERNEL_RANK:  # (no value has a rank its inputs do not: broadcasting and products keep it)
            raise PrismError(f"program '{program.name}': '{node.attr}' has rank {node.rank}; the kernels take tensors "
                             f"of rank {KERNEL_RANK} at most (`prismc run` evaluates it)",
                             program.locs.get(node, program.loc))
    for n in (n for n in program.nodes() + [n for k in kernels_of(program) for n in k.body()]
              if n.dtype is not DType.F64):  # (its kernel computes in f32)
        for c in (a for a in n.args if a.op == "const"):
            with np.errstate(over="ignore"):
                f32 = float(np.float32(c.attr))
            if (f32 == 0) != (c.attr == 0) or math.isinf(f32):
                raise PrismError(f"program '{program.name}': the constant {c.attr:g} is {'0' if f32 == 0 else 'infinite'} "
                                 "in the kernels' f32 arithmetic, which holds magnitudes from 1.4e-45 to 3.4e38: write "
                                 "one within that range, or 0", program.locs.get(c) or program.locs.get(n, program.loc))


def lower(program: Program, long_rows: bool | frozenset = False, rows_apart: bool = False) -> Program:
    """The program with every op outside custom kernels in a pre-defined kernel of its own (or fused into its
    element-wise user's), the element-wise work after a sum across blocks done as it is stored (`finish_sums`).
    A program with nothing left outside kernels comes back as it is. `long_rows`: each softmax or norm of rank 3
    at most (`_long`; or those of them in the set given) in two kernels that never hold a row whole (`_long_rows`),
    for rows a block's shared memory cannot hold (a vocabulary's logits); `lowered_forms` offers it, and the tuner
    takes it where the usual form has no valid parameters or is slower by the model (`pipeline.build.tune`,
    `pipeline.optimize.rank`). `rows_apart`: each softmax or norm in a kernel of its own, the element-wise chains
    before and after it (and a softmax or norm in its row) in kernels of theirs, so that a kernel holds one row's
    tiles, not each of a chain's."""
    check_compilable(program)
    program = finish_sums(program)
    nodes, users = program.nodes(), program.users()
    outputs = {id(node): name for name, node in reversed(program.outputs)}

    def long(n: Node) -> bool:  # in two kernels for its long rows
        return _long(n) and (long_rows is True or bool(long_rows) and n in long_rows)

    def loaded_swapped(n: Node) -> bool:  # the products load the tile of its operand transposed
        return _swaps_matrix(n) and id(n) not in outputs and all(OPS[u.op].kind is Kind.MATMUL for u in users[n])

    @functools.cache
    def stored(n: Node) -> bool:  # computed by a kernel of its own, or as the last value of its chain's
        if n.op in ("input", "const", "kernel") or loaded_swapped(n):
            return False
        if row_op(n) and id(n) not in outputs and not long(n) and not rows_apart:  # in the row another one
            return not in_row(n)  # works on, computed in that one's kernel (rms_norm(rms_norm(h) + x))
        if id(n) in outputs or OPS[n.op].kind not in _ELEMENTWISE:
            return True
        # fused into its one user, unless that user is a transpose the products load: then it must be stored; or
        # the row a softmax or norm works on, in its kernel (its prologue: softmax(x / t)), or in both of its two
        # kernels for long rows where the chain is of element-wise ops alone (no transpose: the loop walks the row)
        u = users[n][0] if len(users[n]) == 1 else None
        return not (u is not None and (OPS[u.op].kind in _ELEMENTWISE and not loaded_swapped(u)
                                       or row_op(u) and not rows_apart and (not long(u) or plain(n))
                                       and u.args[0] is n and _same_shape(n, u)))

    def in_row(n: Node) -> bool:  # n, through element-wise values of its shape each read by the next alone, is the
        m = n  # row a softmax or norm (in one kernel) works on
        while len(users[m]) == 1 and id(m) not in outputs:
            u = users[m][0]
            if row_op(u) and not long(u) and u.args[0] is m:
                return True
            if OPS[u.op].kind not in (Kind.UNARY, Kind.BINARY) or not _same_shape(u, n):
                return False
            m = u
        return False

    @functools.cache
    def plain(n: Node) -> bool:  # element-wise ops down to what is stored or read (inputs, constants)
        return n.op in ("input", "const", "kernel") or OPS[n.op].kind in (Kind.UNARY, Kind.BINARY) \
            and all(stored(a) or plain(a) for a in n.args)

    epilogues = _epilogues(nodes, users, outputs, stored, lambda n: long(n) or rows_apart and row_op(n))
    in_epilogue = {m for products in epilogues.values() for m in products}
    todo = [n for n in nodes if stored(n) and n not in in_epilogue]
    if not todo:
        return program
    lowered: dict[Node, Node] = {}  # program node -> the kernel output that computes it
    todo_set = set(todo)
    names = dict(program.names)
    taken = {n.attr for n in program.inputs} | {name for name, _ in program.outputs} | set(program.names.values())
    rebuilt: dict[int, object] = {}  # custom kernels re-pointed at lowered operands, by id of the original
    # names the new parameters and kernels avoid: the dims, the parameters and the kernels there are (`_kernel_name`)
    params = ({d.name for d in program.dims} | {s.name for s in free_symbols(program)}
              | {k.name for k in kernels_of(program)})
    i = -1  # the position in `todo`, for fresh names
    for n in nodes:
        if n.op == "kernel" and any(a in lowered for a in n.args):
            # A custom kernel that reads a value now computed by a pre-defined kernel reads its output.
            kernel, index = n.attr
            if id(kernel) not in rebuilt:
                rebuilt[id(kernel)] = replace(kernel, inputs=tuple(lowered.get(a, a) for a in kernel.inputs))
            k = rebuilt[id(kernel)]
            lowered[n] = Node("kernel", k.inputs, (k, index), n.dtype, n.shape)
            continue
        if n not in todo_set:
            continue
        i += 1
        store = outputs.get(id(n)) or program.names.get(n)
        if store is None or (store in taken and id(n) not in outputs and program.names.get(n) != store):
            store = fresh_name(f"t{i}", taken)
        taken.add(store)
        if long(n):
            node = _long_rows(n, store, lowered, params, taken)
        else:
            node = _kernel_for(n, store, lowered, params, epilogues.get(n, ()))
        lowered[n] = node
        names[node] = store
    outs = tuple((name, lowered.get(node, node)) for name, node in program.outputs)
    locs = {lowered[n]: program.locs[n] for n in todo if n in program.locs}  # a kernel is where its op was written
    return Program(program.name, program.dims, program.inputs, outs, locs, names, program.loc)


# Rows of at most this many elements take one kernel (a block a row, or a group of rows): the form for long rows is
# not tuned for them. Two launches cost more than such a row's work (8192 f32 are 32 KiB), and both of a softmax
# whose rows fit were priced: the two kernels won first at rows of f32 29696 (20.5 us against 9.2, spills).
SHORT_ROW = 8192


def lowered_forms(program: Program, binding=None) -> list[Program]:
    """The ways `program` can be lowered, the usual first: a program with a softmax or norm outside its kernels also
    with each in a kernel of its own (`lower(rows_apart=True)`, where the usual form computes chains or other norms
    in its kernel: a deep chain's tiles, or nested norms' buffers, may not fit where one row does), and with each
    choice of them in the form for long rows (`lower(long_rows=...)`), which the tuner takes where the
    usual one has no valid parameters (a vocabulary's rows, more than a block's shared memory holds) or is slower
    by the model (f32 rows of 29696: one block a row spilled registers, 20.5 us against 9.2). With `binding` (the
    dims' symbols to sizes), rows of SHORT_ROW elements or fewer keep the usual form."""
    usual, longs = lower(program), [n for n in program.nodes() if _long(n)]
    apart = lower(program, rows_apart=True)  # where the usual form's kernels of rows hold more than one row's tiles
    forms = [usual] + ([apart] if len(kernels_of(apart)) != len(kernels_of(usual)) else [])
    if binding is not None:  # at these dims, only rows past SHORT_ROW
        def row(n: Node):
            return sympy.sympify(n.shape[-1]).xreplace({k: sympy.Integer(v) for k, v in binding.items()})
        longs = [n for n in longs if not (row(n).is_number and int(row(n)) <= SHORT_ROW)]
    if len(longs) <= 3:  # each choice of which rows are long (a vocabulary's softmax beside one over short rows, which
        # one kernel takes faster)
        picks = sorted((frozenset(n for i, n in enumerate(longs) if mask >> i & 1)
                        for mask in range(1, 1 << len(longs))),
                       key=len, reverse=True)  # all of them first: the form a failure reports (`build.tune`)
    else:  # all of them, or one
        picks = [frozenset(longs)] + [frozenset([n]) for n in longs]
    return forms + [lower(program, long_rows=pick) for pick in picks]


def _long(n: Node) -> bool:
    """A softmax or a norm `lower(long_rows=True)` lowers in two kernels: of rank 3 at most, a softmax's pieces a
    grid axis beside its rows' (at rank 4, attention's scores, the search's online softmax is the way)."""
    return n.op in _PIECES and n.rank <= 3


def lowered_for(program: Program, params) -> Program:
    """The form of `program` (`lowered_forms`) whose kernel parameters are `params`' names (the usual where none is)."""
    forms = lowered_forms(program)
    return next((f for f in forms if {s.name for s in free_symbols(f)} == set(params)), forms[0])


def _epilogues(nodes: list[Node], users: dict[Node, list[Node]], outputs: dict[int, str],
               stored, long) -> dict[Node, list[Node]]:
    """Products, or a softmax or norm, computed in the kernel of the element-wise value they feed (its epilogue:
    `gelu(X @ W + B)` one kernel, not a product's kernel that stores X @ W and another that reads it back;
    `rms_norm(X) * G` one kernel of rows), by that value: the last of the chain `stored` ends at. A product or
    row-wise op joins it where it is no output, its one user is that chain's, and every value on its way there
    has its shape (no broadcast makes it larger, no transpose or mask moves its elements); where several
    products do (`silu(X @ Wg) * (X @ Wu)`), the loop walks one contracted dim for all, so those that contract a
    dim of another size are stored by kernels of their own, as are a second row-wise op, one beside products,
    and one that `long` says is lowered apart (in two kernels for its long rows, or each in a kernel of its own)."""
    epilogues: dict[Node, list[Node]] = {}
    for m in nodes:
        row = row_op(m) and not long(m)
        if not (OPS[m.op].kind is Kind.MATMUL or row) or id(m) in outputs or len(users[m]) != 1 or m.rank > KERNEL_RANK:
            continue
        n = users[m][0]
        while (OPS[n.op].kind in (Kind.UNARY, Kind.BINARY) and n.rank == m.rank
               and all(same(a, b) for a, b in zip(n.shape, m.shape))):
            if stored(n):
                products = epilogues.setdefault(n, [])
                if not products or not row and products[0].op == "matmul" \
                        and same(products[0].args[0].shape[-1], m.args[0].shape[-1]):
                    products.append(m)
                break
            n = users[n][0]
    return epilogues


def _same_shape(a: Node, b: Node) -> bool:
    return a.rank == b.rank and all(same(x, y) for x, y in zip(a.shape, b.shape))


def _kernel_name(base: str, taken: set[str]) -> str:
    """A kernel's name, `base` unless a kernel (or a parameter) has it: `matmul_add_Y` is the epilogue kernel of the
    sum stored as Y and the product kernel of a value named `add_Y` alike."""
    name = fresh_name(base, taken)
    taken.add(name)
    return name


class _Builder:
    """Collects a kernel's loads while its body is rebuilt over tiles."""

    def __init__(self, name: str, grid, loop, lowered: dict[Node, Node]):
        grid = list(grid) or [("x", sympy.Integer(1))]  # a rank-1 value: one block
        self.shell = Kernel(name, tuple(grid), loop, (), (), ())
        self.lowered = lowered
        self.sources: list[Node] = []
        self.loads: list[Load] = []

    def tile(self, source: Node, dims: tuple[DimMap, ...]) -> Node:
        source = self.lowered.get(source, source)
        tmap = TileMap(dims)
        for load in self.loads:
            if self.sources[load.source] is source and load.map == tmap:
                return _tile_node(load, source, self.shell)
        if source not in self.sources:
            self.sources.append(source)
        load = Load(f"{_tile_name(source)}_{len(self.loads)}", self.sources.index(source), tmap)
        self.loads.append(load)
        return _tile_node(load, source, self.shell)

    def kernel(self, value: Node, store: str, tmap: TileMap, add: bool = False) -> Node:
        s = self.shell
        k = Kernel(s.name, s.grid, s.loop, tuple(self.loads), (Store(store, value, tmap, add),), tuple(self.sources))
        return Node("kernel", k.inputs, (k, 0), value.dtype, output_shape(value.shape, tmap, k))


def _tile_name(source: Node) -> str:
    if source.op == "input":
        return source.attr.lower()
    return source.attr[0].stores[source.attr[1]].name.lower()


def _tile_node(load: Load, source: Node, shell: Kernel) -> Node:
    return Node("tile", (), load.tile, source.dtype, tile_shape(source.shape, load.map, shell))


def _map(shape, split: dict[int, str], loop_dim: int | None = None, out_shape=None) -> tuple[DimMap, ...]:
    """A tile map for an operand of `shape` read by a kernel whose output dims (counted from the end) in
    `split` are split by grid axes, and `loop_dim` by the loop: operand dims that broadcast (size 1 where the output
    is not) stay whole."""
    dims = []
    rank = len(shape)
    for d in range(rank):
        from_end = d - rank
        broadcast = out_shape is not None and -from_end <= len(out_shape) and not same(shape[d], out_shape[from_end])
        dims.append(DimMap(None if broadcast else split.get(from_end), loop_dim == from_end and not broadcast))
    return tuple(dims)


def _kernel_for(n: Node, store: str, lowered: dict[Node, Node], taken: set[str], products=()) -> Node:
    """The pre-defined kernel that computes `n`, with the products, or the row-wise op, of its epilogue
    (`_epilogues`): a row-wise op's kernel then (a block a group of rows, each whole) computes the chain after it."""
    kind = OPS[n.op].kind
    if n.rank > KERNEL_RANK:
        raise PrismError(f"'{store}' has rank {n.rank}; pre-defined kernels handle rank {KERNEL_RANK} at most")
    row = products[0] if products and OPS[products[0].op].kind is Kind.ROWWISE else None
    kname = _kernel_name(f"{products[0].op}_{n.op}_{store}" if products else f"{n.op}_{store}", taken)

    def sym(base: str) -> sympy.Symbol:
        return _param(base, store, taken)

    shape = n.shape
    if (kind is Kind.MATMUL or products) and row is None:
        grid = [("x", sym("gx")), ("y", sym("gy"))] + ([("z", shape[-3])] if n.rank >= 3 else [])
        split = {-1: "x", -2: "y", -3: "z"}
        bld = _Builder(kname, grid, sym("F"), lowered)
        sums = {}  # each product's running sum over the loop's slices of the contracted dim
        for m in products or (n,):
            at = _operand(bld, m.args[0], {-2: "y", -3: "z"}, -1, shape, lowered)
            bt = _operand(bld, m.args[1], {-1: "x", -3: "z"}, -2, shape, lowered)
            sums[m] = build("acc_sum", [build("matmul", [at, bt])])
        value = _rebuild(n, bld, split, shape, lowered, top=True, computed=sums) if products else sums[n]
        return bld.kernel(value, store, TileMap(_out_map(n.rank, split)))
    if kind is Kind.REDUCE:
        split = dict(zip([d for d in range(-1, -n.rank - 1, -1) if d != n.attr - n.rank], AXES))
        if (n.op, n.attr - n.rank) in _FOLDED:
            return _folded(n, kname, store, split, sym("F"), lowered, sym)
    elif kind is Kind.ROWWISE or row is not None:
        split = dict(zip(range(-2, -n.rank - 1, -1), AXES))
    elif kind in _ELEMENTWISE:  # a row a block on x (up to 2^31 - 1 of them, where y and z take 65535), the
        # pieces of the last dim on y (on x for a single row), the dim before the rows on z
        split = {-1: "y", -2: "x", -3: "z"} if n.rank >= 2 else {-1: "x"}
        split = {d: a for d, a in split.items() if -d <= n.rank}
    else:
        raise PrismError(f"no pre-defined kernel for '{n.op}'")
    pieces = -1 if kind in _ELEMENTWISE and row is None else None  # the dim whose pieces a parameter counts (else x's)
    grid = sorted((a, sym(f"g{a}") if d == pieces or pieces is None and a == "x" else shape[d])
                  for d, a in split.items())
    bld = _Builder(kname, grid, None, lowered)
    if kind in _ELEMENTWISE and row is None:
        value = _rebuild(n, bld, split, shape, lowered, top=True)
    else:  # a reduction or a row-wise op: its operand's tile holds what it works along whole; a row-wise
        # op's other operands (rope's tables; an epsilon is a constant) are read alike where not broadcast
        r = row or n
        x, *rest = r.args
        rest = [a if a.op == "const" else bld.tile(a, _map(a.shape, split, out_shape=shape)) for a in rest]
        if kind is Kind.REDUCE:
            x = bld.tile(x, _map(x.shape, split))
        else:  # its row, or the element-wise chain that makes it (its prologue), over tiles of what that reads
            x = _rebuild(x, bld, split, shape, lowered)
        value = rebuild(r, [x, *rest])
        if row is not None:  # then the chain, in the same rows
            value = _rebuild(n, bld, split, shape, lowered, top=True, computed={row: value})
    return bld.kernel(value, store, TileMap(_out_map(n.rank, split)))


# Reductions a loop folds, by op and dim (over the last dim: a row accumulator). The loop walks the reduced dim,
# so no block holds it whole (rows of 65536 floats would not fit in shared memory); a loop range of 1 is the
# kernel that holds it whole.
_FOLDED = {("sum", -1): "acc_sum_last", ("max", -1): "acc_max_last", ("mean", -1): "acc_mean_last"}


def _folded(n: Node, kname: str, store: str, split: dict[int, str], loop: sympy.Symbol, lowered, sym) -> Node:
    """A reduction in a loop kernel: blocks split the kept dims, as the kernel that holds the reduced dim whole
    does, and the loop walks the reduced one."""
    dim = n.attr - n.rank
    bld = _Builder(kname, [(a, sym("gx") if a == "x" else n.shape[d]) for d, a in split.items()], loop, lowered)
    x = n.args[0]
    xt = bld.tile(x, _map(x.shape, split, loop_dim=dim))
    return bld.kernel(build(_FOLDED[(n.op, dim)], [xt]), store, TileMap(_out_map(n.rank, split)))


def _param(base: str, store: str, taken: set[str]) -> sympy.Symbol:
    """A fresh kernel parameter, named after the value it computes: no dim's, other parameter's or kernel's name."""
    name = fresh_name(f"{base}_{store}", taken)
    taken.add(name)
    return dim_symbol(name)


def _combine_softmax(t: dict[str, Node], xt: Node) -> Node:
    """A row's pieces' max and sums of exp(x - max) combined (the largest max, each sum rescaled to it:
    sum_i l_i * exp(m_i - max)), and a piece of the row's softmax from them."""
    top = build("max", [t["max"]], [-1])
    whole = build("sum", [build("mul", [t["sum"], build("exp", [build("sub", [t["max"], top])])])], [-1])
    return build("div", [build("exp", [build("sub", [xt, top])]), whole])


def _combine_norm(t: dict[str, Node], xt: Node, e: Node | None = None) -> Node:
    """A row's pieces' statistics combined (the pieces are equal in size: the mean of their means; the mean of their
    variances about the whole mean, var_i + (mean_i - mean)^2; the mean of their mean squares), and a piece of the
    row normalised by them (less its mean, for LayerNorm; the epsilon `e` added where there is one)."""
    top, square = xt, build("mean", [t["ms"]], [-1]) if "ms" in t else None
    if square is None:
        mean = build("mean", [t["mean"]], [-1])
        deviation = build("square", [build("sub", [t["mean"], mean])])
        top, square = build("sub", [xt, mean]), build("mean", [build("add", [t["var"], deviation])], [-1])
    return build("div", [top, build("sqrt", [square if e is None else build("add", [square, e])])])


# Per op lowered for long rows (`_long`): what each block stores of its piece of a row (by part, from the piece's
# tile; kept in f32 by `kernel.stored_dtype`, a split's partial results, or online softmax's sums), and how the
# element-wise kernel combines a row's pieces into its piece of the value (`_combine_*`).
_PIECES = {
    "softmax": (lambda xt: {"max": build("acc_max_last", [xt]), "sum": build("acc_softmax_sum", [xt])},
                _combine_softmax),
    "layer_norm": (lambda xt: {"mean": build("acc_mean_last", [xt]), "var": build("acc_var_last", [xt])},
                   _combine_norm),
    "rms_norm": (lambda xt: {"ms": build("acc_mean_last", [build("square", [xt])])}, _combine_norm),
    "rms_norm_eps": (lambda xt: {"ms": build("acc_mean_last", [build("square", [xt])])}, _combine_norm),
}


def _long_rows(n: Node, store: str, lowered, params: set[str], taken: set[str]) -> Node:
    """softmax, layer_norm or rms_norm over rows too long for a block to hold, in two kernels (FlashDecoding's split,
    over a row): blocks take pieces of each row (`gp` of them, on the grid axis after the rows': y, z at rank 3, x
    for one row; the rows on x, whose limit is 2^31 - 1, not 65535: 131072 tokens' logits, and on y), each walking
    its piece in a loop for its statistics (`_PIECES`: a softmax's running max and sum of exp(x - max), online
    softmax's accumulators; a LayerNorm's mean and variance about it, Chan's merge, `acc_var_last`; an RMSNorm's
    mean of squares), stored for the row, so that a few long rows still fill the SMs; then each block of an
    element-wise kernel reads its row's pieces whole, combines them and writes its piece of the row. The
    statistics are kept in f32 (`kernel.stored_dtype`): 128256 equal logits sum past f16's range, and an f16 mean
    of rows 1000 from zero that vary by 4 is 0.5 off. The two kernels take the same pieces: two parameters, which
    the tuner tries every pair of (`tuning.tune`), where a third for the second kernel's slices left it to a
    descent that settled on one piece walked one element an iteration."""
    x, shape = n.args[0], n.shape
    pieces_of, combine = _PIECES[n.op]
    rows = dict(zip(range(-2, -n.rank - 1, -1), ("x", "y")))  # the rows on x (and y); the next axis takes the
    on = AXES[len(rows)]  # pieces: the innermost of the stores' concats, which the loads' splits of the rows undo
    split = {**rows, -1: on}
    grid = sorted([(on, _param("gp", store, params))] + [(a, shape[d]) for d, a in rows.items()])
    bld = _Builder(_kernel_name(f"{n.op}_stats_{store}", params), grid, _param("F", store, params), lowered)
    parts = pieces_of(_rebuild(x, bld, split, shape, lowered, loop_dim=-1))  # x, or the chain that makes it
    names = [fresh_name(f"{store}_{part}", taken) for part in parts]
    taken.update(names)
    tmap, s = TileMap(_out_map(n.rank, split)), bld.shell
    stats = Kernel(s.name, s.grid, s.loop, tuple(bld.loads),
                   tuple(Store(name, v, tmap, False) for name, v in zip(names, parts.values())), tuple(bld.sources))
    apply = _Builder(_kernel_name(f"{n.op}_{store}", params), grid, None, lowered)
    tiles = {part: apply.tile(Node("kernel", stats.inputs, (stats, i), v.dtype, output_shape(v.shape, tmap, stats)),
                              _map(v.shape, rows))  # the row's pieces, whole
             for i, (part, v) in enumerate(parts.items())}
    rest = [e if e.op == "const" else apply.tile(e, _map(e.shape, split, out_shape=shape)) for e in n.args[1:]]
    value = combine(tiles, _rebuild(x, apply, split, shape, lowered), *rest)  # (an epsilon: a constant, or read as x)
    return apply.kernel(value, store, TileMap(_out_map(n.rank, split)))


def _swaps_matrix(n: Node) -> bool:
    """Whether `n` transposes the last two dims of its operand."""
    return n.op == "transpose" and sorted(d - n.rank for d in n.attr) == [-2, -1]


def _operand(bld: _Builder, a: Node, split: dict[int, str], loop_dim: int, out_shape, lowered) -> Node:
    """A product operand's tile; a transposed matrix is loaded as it is stored and transposed in the body."""
    if _swaps_matrix(a) and a not in lowered:
        x = a.args[0]
        swap = {-1: -2, -2: -1}
        tile = bld.tile(x, _map(x.shape, {swap.get(d, d): axis for d, axis in split.items()}, loop_dim=swap[loop_dim],
                                out_shape=_pad(x, out_shape)))
        return rebuild(a, [tile])
    return bld.tile(a, _map(a.shape, split, loop_dim=loop_dim, out_shape=_pad(a, out_shape)))


def _pad(operand: Node, out_shape) -> tuple:
    """The output's shape seen from an operand's batch dims (the last two dims are the operand's own)."""
    return tuple(out_shape[:-2]) + tuple(operand.shape[-2:])


def _out_map(rank: int, split: dict[int, str]) -> tuple[DimMap, ...]:
    return tuple(DimMap(split.get(d - rank)) for d in range(rank))


def _rebuild(n: Node, bld: _Builder, split, out_shape, lowered, top: bool = False, computed=None,
             loop_dim: int | None = None) -> Node:
    """The element-wise chain ending at `n`, over tiles of the values it reads (or over what the kernel computes
    of them: `computed`, an epilogue's products); `loop_dim`: the dim the kernel's loop walks (no transpose in the
    chain then)."""
    if computed and n in computed:
        return computed[n]
    if n.op == "const":
        return n
    if not top and (n.op in ("input", "kernel") or n in lowered):
        return bld.tile(n, _map(n.shape, split, loop_dim=loop_dim, out_shape=out_shape))
    if n.op == "transpose":  # its operand's dims i and j are the value's j and i
        i, j = (d - n.rank for d in n.attr)
        swap = {i: j, j: i}
        split = {swap.get(d, d): axis for d, axis in split.items()}
        out_shape = list(padded(out_shape, i, j))
        out_shape[i], out_shape[j] = out_shape[j], out_shape[i]
        return rebuild(n, [_rebuild(n.args[0], bld, split, tuple(out_shape), lowered, computed=computed)])
    return rebuild(n, [_rebuild(a, bld, split, out_shape, lowered, computed=computed, loop_dim=loop_dim)
                       for a in n.args])


