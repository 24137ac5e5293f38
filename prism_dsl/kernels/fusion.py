"""Thread-level fusion and buffer planning for a custom kernel: where each block-level value lives.

A pass, not a search (docs/ARCHITECTURE.md): given a kernel's block graph it decides, for every
body node, one placement:

- `SMEM`: the value is computed by all the block's threads into a shared-memory buffer (loaded tiles,
  matrix products, reductions, row-wise ops, and element-wise values that a non-element-wise op reads);
- `INLINE`: an element-wise value whose every user is element-wise too, an accumulator that reads each
  element once (`Accumulator.reads_once`: RMSNorm's x * x into its row sum), or a row-wise op that works on it
  (each of its passes evaluates it again: softmax(x / t)); it is never stored, each user
  evaluates it in registers at the element it needs (chains of unary and binary ops fuse this way); a
  transpose is always inline, a view whose readers swap two indices;
- `STATE`: an accumulator: its running state lives in shared memory across the loop, and its value after
  the loop is read from the state;
- `FUSED`: a matrix product whose only user is `acc_sum`: the product is added straight into the
  accumulator's state, never stored on its own;
- `STORED`: a row-wise op (softmax, a norm) that the kernel stores whole, or an element-wise chain of it
  (`rms_norm(x) * g`), and nothing else reads: the pass that writes each row writes it, through the chain,
  straight to the output (`Plan.writes`), never to shared memory (a softmax over a vocabulary's f16 logits then
  needs only the row's 2 bytes an element, not 6).

A row-wise op also has a small scratch buffer, `ROW_SCRATCH` of its passes' values a warp, for the rows that
several warps share (`backend/row_parts.py`).

`plan(kernel)` also lists the buffers a block needs, with symbolic shapes: this is what the generated
CUDA allocates, and what the shared-memory constraint of `constraints.constraints` bounds (buffers are
128-byte aligned in the kernel, so each counts 128 bytes of padding; rows of loaded 16-bit tiles count
`ROW_PAD` bytes more, the most the generated code pads them). The online-softmax accumulators on the same
scores share one running row max, one rescaling factor per row and one tile of exp(s - max).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cache

import sympy

from ..ir.accumulators import ACCUMULATORS, ONLINE_SOFTMAX
from ..ir.nodes import DType, Node
from .kernel import Kernel, after_loop, fresh_name, loop_varying, storage
from .sizes import call, compile_sizes
from ..ir.ops import OPS, Kind

ALIGN = 128  # bytes: shared-memory buffers start at multiples of this (tensor-core loads need 32)
# bytes added to every row of a loaded 16-bit tile of two or more dims: rows whose length is a multiple of 128
# bytes would put the 8 rows of an ldmatrix (or wmma) load in the same banks; 16 bytes more per row puts
# them in 8 different ones, and keeps every row 16-byte aligned for cp.async.
ROW_PAD = 16
# a row-wise op's scratch: for each of its passes (a norm's two statistics, a softmax's max and sum) a value per warp
ROW_SCRATCH = (2, 32)


class Place(Enum):
    SMEM = "smem"
    INLINE = "inline"
    STATE = "state"
    FUSED = "fused"
    STORED = "stored"


@dataclass(frozen=True)
class Buffer:
    """One shared-memory buffer: `name` is a C identifier fragment, unique within the kernel."""

    name: str
    shape: tuple[sympy.Expr, ...]
    dtype: DType  # how its elements are stored
    node: Node | None  # the value it holds (None for softmax scratch)
    role: str  # "tile", "value", "state", "scratch", "warps" (a row-wise op's `ROW_SCRATCH`)
    pad: int = 0  # elements after each row (the last dim) in shared memory: `ROW_PAD`

    @property
    def elements(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def bytes(self) -> sympy.Expr:
        """What it occupies in shared memory, row padding included."""
        rows = sympy.Mul(*self.shape[:-1]) if self.shape else sympy.Integer(1)
        return (self.elements + rows * self.pad) * self.dtype.bytes


@dataclass(frozen=True)
class Plan:
    place: dict[Node, Place]
    buffers: tuple[Buffer, ...]
    state: dict[Node, dict[str, Buffer]]  # accumulator -> its state buffers by role ("m", "l", "o", "acc"...)
    groups: dict[Node, dict[str, Buffer]]  # scores s -> shared online-softmax buffers ("m", "scale", "p")
    users: dict[Node, list[Node]]
    writes: dict[Node, int]  # a `STORED` row-wise op -> the store its pass that writes makes

    def computed(self, node: Node) -> bool:
        """Whether a step of its own computes `node` (into its buffer, or straight to the output it is stored in)."""
        return self.place[node] in (Place.SMEM, Place.STORED)

    def buffer(self, node: Node) -> Buffer:
        return next(b for b in self.buffers if b.node is node and b.role in ("tile", "value"))


# Users that read an element-wise value one element at a time, at most once per element they make
# (and the accumulators that fold that way: `Accumulator.reads_once`).
_ELEMENTWISE_USERS = {Kind.UNARY, Kind.BINARY, Kind.MASK, Kind.TRANSPOSE}


def compute_dtype(kernel: Kernel) -> DType:
    """Arithmetic happens in f32, or f64 when the kernel touches an f64 tensor."""
    f64 = any(n.dtype is DType.F64 for n in kernel.body()) or any(i.dtype is DType.F64 for i in kernel.inputs)
    return DType.F64 if f64 else DType.F32


@cache
def plan(kernel: Kernel) -> Plan:
    body = kernel.body()
    users: dict[Node, list[Node]] = {n: [] for n in body}
    for n in body:
        for a in n.args:
            if n not in users[a]:
                users[a].append(n)
    stored = {s.value for s in kernel.stores}
    real = compute_dtype(kernel)
    place: dict[Node, Place] = {}
    buffers: list[Buffer] = []
    state: dict[Node, dict[str, Buffer]] = {}
    groups: dict[Node, dict[str, Buffer]] = {}
    writes: dict[Node, int] = {}

    def add(base: str, shape, dtype: DType, node: Node | None, role: str) -> Buffer:
        pad = ROW_PAD // dtype.bytes if role in ("tile", "value") and dtype.bytes == 2 and len(shape) >= 2 \
            and shape[-1] != 1 else 0
        buffers.append(Buffer(fresh_name(base, {b.name for b in buffers}), tuple(shape), dtype, node, role, pad))
        return buffers[-1]

    softmax_scores = {n.args[0] for n in body if n.op in ONLINE_SOFTMAX}
    for i, n in enumerate(body):
        kind = OPS[n.op].kind
        if kind is Kind.TILE:
            place[n] = Place.SMEM
            add(n.attr, n.shape, storage(kernel.inputs[kernel.load(n.attr).source]), n, "tile")  # as stored
        elif kind in (Kind.CONST, Kind.TRANSPOSE):  # a transpose is a view: its readers swap the two indices
            place[n] = Place.INLINE
        elif kind in (Kind.UNARY, Kind.BINARY, Kind.MASK) or OPS[n.op].per_element:
            # A product operand made from 16-bit tiles is kept in a 16-bit buffer for tensor cores (even when
            # a transpose reads it); other values that only element-wise users read are evaluated in place.
            staged = _operand_dtype(kernel, n, users[n], stored, users)
            inline = staged is None and all(OPS[u.op].kind in _ELEMENTWISE_USERS or _accumulator(u, "reads_once")
                                            or _row_operand(u, n) for u in users[n])
            place[n] = Place.INLINE if inline else Place.SMEM
            if not inline:
                add(f"v{i}", n.shape, staged or real, n, "value")
        elif kind is Kind.MATMUL and len(users[n]) == 1 and _accumulator(users[n][0], "adds_products") and n not in stored:
            place[n] = Place.FUSED
        elif kind is Kind.ACCUMULATE:
            place[n] = Place.STATE
            state[n] = _state_buffers(n, i, add, real, groups, softmax_scores)
        else:  # matmul, reductions, row-wise ops
            place[n] = Place.SMEM
            add(f"v{i}", n.shape, real, n, "value")
            if kind is Kind.ROWWISE:
                add(f"v{i}_warps", ROW_SCRATCH, real, n, "warps")
    for n in body:  # once every value's place is known: the row-wise ops that write their output themselves
        if row_op(n) and (at := _written_out(kernel, n, users, place)) is not None:
            place[n], writes[n] = Place.STORED, at
    buffers = [b for b in buffers if not (b.role == "value" and b.node is not None and b.node in writes)]
    return Plan(place, tuple(buffers), state, groups, users, writes)


def _written_out(kernel: Kernel, n: Node, users: dict[Node, list[Node]], place: dict[Node, Place]) -> int | None:
    """The store a row-wise op `n` may make itself (`Place.STORED`): of `n`, or of the end of the chain of
    element-wise values of its shape that is its one reader (`rms_norm(x) * g`), each value on the way read only by
    the next; stored once, plainly (not added into its output), by a map of the value's rank (the pass that writes
    indexes the output by the row's indices), made once (outside the loop), no other value of the chain stored (its
    store would read `n`). The chain's other operands are what the pass can read where `n` is made, each at the
    element itself: constants, tiles loaded by then, and values evaluated in place from those (not a value another
    step computes, such as another row-wise op or an accumulator after the loop, nor a transposed read). None where
    there is no such store."""
    varying, after, chain = loop_varying(kernel), after_loop(kernel.body()), [n]

    def ready(a: Node) -> bool:
        return all(m.op == "const" or m.op == "tile" and (m not in after or n in after)
                   or place.get(m) is Place.INLINE and OPS[m.op].kind in (Kind.UNARY, Kind.BINARY) for m in a.walk())

    while users[chain[-1]]:
        u = users[chain[-1]][0]
        if (len(users[chain[-1]]) != 1 or OPS[u.op].kind not in (Kind.UNARY, Kind.BINARY)
                or tuple(u.shape) != tuple(n.shape) or u in varying
                or not all(ready(a) for a in u.args if a is not chain[-1])):
            return None
        chain.append(u)
    at = [i for i, s in enumerate(kernel.stores) if any(s.value is m for m in chain)]
    if len(at) != 1 or n in varying:
        return None
    store = kernel.stores[at[0]]
    return at[0] if store.value is chain[-1] and not store.add and len(store.map.dims) == n.rank else None


def row_op(n: Node) -> bool:
    """A softmax or a norm: a row-wise op with passes over its row (not RoPE, which is per element). The lowering
    (`lower`) asks the same of the ops it fuses with their chains."""
    return OPS[n.op].kind is Kind.ROWWISE and not OPS[n.op].per_element


def _operand_dtype(kernel: Kernel, n: Node, users: list[Node], stored: set[Node], readers) -> DType | None:
    """The 16-bit type an element-wise value (or RoPE's) is kept in when only matrix products read it: as
    their left operand, or transposed (its last two dims) as their right one; and it and the products'
    other operands come from tiles stored in that type (RMSNorm's gain times x before the projection;
    RoPE applied to Q and K before Q @ K^T): the products then run on tensor cores, with one rounding of
    the value, as a framework computing in f16 rounds it. `readers`: every body node's users. None: the
    value is kept in the arithmetic type."""
    if n in stored or len(n.shape) < 2 or not users:
        return None
    products = []  # (product, the other operand)
    for u in users:
        if u.op == "matmul" and u.args[0] is n:
            products.append((u, u.args[1]))
        elif matrix_transpose(u) and u not in stored and readers[u] and all(p.op == "matmul" and p.args[1] is u and p.args[0] is not u
                                                                   for p in readers[u]):
            products += [(p, p.args[0]) for p in readers[u]]
        else:
            return None
    kinds = {_made_from(kernel, n, views=False)}
    kinds |= {_made_from(kernel, other, views=True) for _, other in products}
    return kinds.pop() if len(kinds) == 1 and kinds <= {DType.F16, DType.BF16} else None


def matrix_transpose(n: Node) -> bool:
    """Whether `n` is a transpose of the last two dims: a product's operand read as stored, transposed."""
    return n.op == "transpose" and len(n.shape) >= 2 and set(n.attr) == {len(n.shape) - 2, len(n.shape) - 1}


def _made_from(kernel: Kernel, n: Node, views: bool) -> DType | None:
    """The storage type of the tiles `n` is made from by element-wise (or per-element) ops, and transposes
    where `views` (what it is kept in when it is kept in 16 bits); None if they differ or other ops make it."""
    def through(m: Node) -> bool:
        spec = OPS[m.op]
        return (m.op == "tile" or spec.kind in (Kind.UNARY, Kind.BINARY) or spec.per_element
                or (views and spec.kind is Kind.TRANSPOSE))
    under = [m for m in n.walk() if m.op != "const"]
    if not all(through(m) for m in under):
        return None
    kinds = {storage(kernel.inputs[kernel.load(m.attr).source]) for m in under if m.op == "tile"}
    return kinds.pop() if len(kinds) == 1 else None


def _row_operand(u: Node, n: Node) -> bool:
    """Whether `n` is only the row a row-wise op `u` works on (softmax(x / t), rms_norm(h + x)): evaluated in place
    in each of its passes (a statistic's, then the one that writes), never stored in shared memory."""
    return row_op(u) and u.args[0] is n and not any(a is n for a in u.args[1:])


def _accumulator(n: Node, flag: str) -> bool:
    """Whether `n` is an accumulator whose table entry has `flag` set."""
    return n.op in ACCUMULATORS and getattr(ACCUMULATORS[n.op], flag)


def _state_buffers(n: Node, i: int, add, real: DType, groups, softmax_scores) -> dict[str, Buffer]:
    """The accumulator's state buffers by role (`Accumulator.state`; the last holds its value). Online
    softmax over the same scores shares one running max (its "m"), rescaling factor and exp(s - max)."""
    acc, s = ACCUMULATORS[n.op], n.args[0]
    shared = {}
    if acc.online and s in softmax_scores:
        if s not in groups:
            rows = s.shape[:-1] + (sympy.Integer(1),)
            groups[s] = {"m": add(f"a{i}_max", rows, real, None, "scratch"),
                         "scale": add(f"a{i}_scale", rows, real, None, "scratch"),
                         "p": add(f"a{i}_p", s.shape, real, None, "scratch")}
        shared = {"m": groups[s]["m"]}

    def own(role: str) -> Buffer:  # the value's buffer is named after the accumulator, the others after it
        if role == acc.state[-1]:
            return add(f"a{i}", n.shape, real, n, "state")
        return add(f"a{i}_max" if role == "m" else f"a{i}_{role}", n.shape, real, None, "state")
    return {role: shared[role] if role in shared else own(role) for role in acc.state}


# -- the buffers' shapes at a binding ---------------------------------------------------------------------------


@cache
def _buffer_dims(kernel) -> tuple:
    """Every plan buffer's dims in order, one compiled function of the binding (`sizes.compile_sizes`)."""
    exprs = [sympy.sympify(s) for b in plan(kernel).buffers for s in b.shape]
    return compile_sizes(exprs, lambda sources: "(" + "".join(f"{x}, " for x in sources) + ")")


def buffer_shapes(c) -> dict[str, tuple[int, ...]]:
    """The plan's buffers' shapes at this binding, by name (the cost model lays out thousands of choices)."""
    return _shapes_at(c.kernel, c.binding)


def _shapes_at(kernel, binding) -> dict[str, tuple[int, ...]] | None:
    """`buffer_shapes` of a kernel at a binding, before it is a concrete kernel; None where a dim is unbound."""
    flat, out, i = call(_buffer_dims(kernel), binding, None), {}, 0
    if flat is None:
        return None
    for b in plan(kernel).buffers:
        out[b.name] = tuple(int(v) for v in flat[i:i + len(b.shape)])
        i += len(b.shape)
    return out


def least_smem(kernel, binding) -> int | None:
    """Bytes of shared memory that every layout of `kernel` at `binding` takes at least (None where a dim is
    unbound): its loaded tiles as stored, without padding or alignment; the largest of them, and the loop's
    tiles together, which are all in use in each iteration (`lifetimes`: one class or two stacked). The
    tuner passes over a choice above the limit without laying it out (most of those it tries that do not fit);
    the back end's `launch.layout` adds padding, alignment and stages."""
    if (dims := _shapes_at(kernel, binding)) is None:
        return None
    varying, largest, together = loop_varying(kernel), 0, 0
    for b in plan(kernel).buffers:
        size = math.prod(dims[b.name]) * b.dtype.bytes
        if b.role == "tile":
            largest = max(largest, size)
            together += size if b.node in varying else 0
    return max(largest, together)
