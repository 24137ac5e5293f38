"""The operator set, as data.

`OPS` says what each operator is: its kind (which decides its shape rule), how many tensor operands it
takes, its integer parameters, and how it is written. Other concerns keep their own table keyed by the
same names: NumPy semantics in `reference.NUMPY`, shape rules by kind in `shapes.RULES`. Adding an
element-wise op is one line here and one line in each table that renders or evaluates it. The loop
accumulators (`acc_*`) are declared in `accumulators.ACCUMULATORS`; their entries here come from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .accumulators import ACCUMULATORS


class Kind(Enum):
    INPUT = "input"  # a named program input; attr = name
    CONST = "const"  # a scalar literal; attr = value (float)
    UNARY = "unary"  # element-wise, one operand
    BINARY = "binary"  # element-wise with numpy broadcasting
    MATMUL = "matmul"  # numpy matmul: last two dims contract, leading dims broadcast
    REDUCE = "reduce"  # reduce one dim, keeping it with size 1; attr = the dim (non-negative)
    ROWWISE = "rowwise"  # a function of the whole last dim (rms_norm, softmax, rope); operands after the
    # first broadcast against it (an epsilon, rope's tables)
    TRANSPOSE = "transpose"  # layout: two dims swapped; attr = (dim, dim), non-negative
    MASK = "mask"  # the value at an element depends on its position (causal); operands after the first
    # (causal_at's positions) broadcast against it
    POSITION = "position"  # where each element sits along one dim, counted from its end; attr = the dim (< 0)
    ACCUMULATE = "accumulate"  # a loop accumulator of a custom kernel (see `accumulators`)
    SPLIT = "split"  # layout: a dim's equal pieces laid along a block dim; attr = (dim, block dim, count)
    CONCAT = "concat"  # layout: the pieces along a block dim put back side by side; attr = (dim, block dim)
    TILE = "tile"  # inside a custom kernel: the tile a block loads; attr = the tile's name
    KERNEL = "kernel"  # an output of a custom kernel; attr = (Kernel, output index)


# gelu_tanh's constants, as the reference, the symbolic formulas, rules/definitions.rules (gelu_tanh_def) and
# templates/prism.cuh (gelu_tanh_) spell them; tests/test_programs.py checks that the last two agree
GELU_TANH_SCALE = 0.7978845608028654  # sqrt(2 / pi) in double precision
GELU_TANH_CUBIC = 0.044715


@dataclass(frozen=True)
class OpSpec:
    name: str
    kind: Kind
    operands: int  # tensor operands
    params: tuple[str, ...] = ()  # integer literal parameters that follow the operands
    infix: str | None = None  # how the op is written between operands, if it is
    doc: str = ""
    # Per operand, the values it is meant for ("positive", "nonzero"), or "" for any. The numeric
    # soundness check of axioms draws values from these domains, as a real program's values would be.
    domains: tuple[str, ...] = ()
    # Where the op may be written: "any" (programs, kernel bodies, rules), "block" (kernel bodies and
    # rules: the loop accumulators), "rules" (rules only: the layout operators proofs are made of), or
    # "internal" (built by the compiler only).
    where: str = "any"
    written: str = ""  # the name a call is written with, where it is not `name` (see `resolve`)
    constants: int = 0  # how many of the last operands must be constants (an epsilon)
    # A row-wise op whose value at an element reads only a fixed few elements of its row (RoPE: the element
    # and its partner half a row away): kernels compute it one element at a time, like an element-wise op.
    per_element: bool = False

    @property
    def arity(self) -> int:
        return self.operands + len(self.params)


def _table(*specs: OpSpec) -> dict[str, OpSpec]:
    return {s.name: s for s in specs}


OPS: dict[str, OpSpec] = _table(
    OpSpec("input", Kind.INPUT, 0),
    OpSpec("const", Kind.CONST, 0),
    OpSpec("add", Kind.BINARY, 2, infix="+"),
    OpSpec("sub", Kind.BINARY, 2, infix="-"),
    OpSpec("mul", Kind.BINARY, 2, infix="*"),
    OpSpec("div", Kind.BINARY, 2, infix="/", domains=("", "nonzero")),
    OpSpec("matmul", Kind.MATMUL, 2, infix="@"),
    OpSpec("neg", Kind.UNARY, 1, doc="-x"),
    OpSpec("exp", Kind.UNARY, 1),
    OpSpec("sqrt", Kind.UNARY, 1, domains=("positive",)),
    OpSpec("rsqrt", Kind.UNARY, 1, doc="1 / sqrt(x)", domains=("positive",)),
    OpSpec("square", Kind.UNARY, 1, doc="x * x"),
    OpSpec("sigmoid", Kind.UNARY, 1, doc="1 / (1 + exp(-x))"),
    OpSpec("silu", Kind.UNARY, 1, doc="x * sigmoid(x)"),
    OpSpec("gelu", Kind.UNARY, 1, doc="x / 2 * (1 + erf(x / sqrt(2))), the exact form"),
    OpSpec("relu", Kind.UNARY, 1, doc="max(x, 0)"),
    OpSpec("tanh", Kind.UNARY, 1, doc="the hyperbolic tangent"),
    OpSpec("gelu_tanh", Kind.UNARY, 1, doc="x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), GPT-2's form "
           "(sqrt(2 / pi) as the double GELU_TANH_SCALE)"),
    OpSpec("sum", Kind.REDUCE, 1, params=("dim",)),
    OpSpec("max", Kind.REDUCE, 1, params=("dim",)),
    OpSpec("mean", Kind.REDUCE, 1, params=("dim",)),
    OpSpec("rms_norm", Kind.ROWWISE, 1, doc="x / sqrt(mean(square(x), -1)), no epsilon"),
    OpSpec("rms_norm_eps", Kind.ROWWISE, 2, written="rms_norm", constants=1,
           doc="rms_norm(x, eps) = x / sqrt(mean(square(x), -1) + eps), eps a constant"),
    OpSpec("layer_norm", Kind.ROWWISE, 2, constants=1,
           doc="(x - mean(x, -1)) / sqrt(mean(square(x - mean(x, -1)), -1) + eps), eps a constant"),
    OpSpec("softmax", Kind.ROWWISE, 1, doc="exp(x - max(x, -1)) / sum(exp(x - max(x, -1)), -1)"),
    OpSpec("rope", Kind.ROWWISE, 3, per_element=True, doc="rope(x, c, s) = x * c + rotate_half(x) * s, rotate_half(x) the last dim's "
           "second half negated, then its first half (an even last dim); c and s broadcast against x"),
    OpSpec("transpose", Kind.TRANSPOSE, 1, params=("dim", "other dim"), doc="transpose(x, i, j) swaps dims i and j"),
    OpSpec("causal", Kind.MASK, 1, doc="causal(s): s with -inf where column j > row i + (columns - rows) over "
           "the last two dims (the query rows aligned to the end of the keys)"),
    # Loop accumulators of custom kernels, from their table (see `accumulators`; rules/layout.rules
    # says what each one means).
    *(OpSpec(a.name, Kind.ACCUMULATE, a.operands, where="block", doc=a.doc) for a in ACCUMULATORS.values()),
    # Layout operators: how the tiles of a custom kernel relate to whole tensors (see `layout`).
    OpSpec("from_end", Kind.POSITION, 1, params=("dim",), where="rules",
           doc="from_end(x, d): each index along dim d of x counted from the end of that dim (size - 1 - i), "
               "in a tensor of rank -d whose other dims have size 1"),
    OpSpec("causal_at", Kind.MASK, 3, where="rules",
           doc="causal_at(s, r, c): s with -inf where c < r; r and c hold the rows' and columns' places counted "
               "from the end of the whole tensors (a kernel's mask of tiles placed in whole tensors)"),
    OpSpec("split", Kind.SPLIT, 1, params=("dim", "block dim", "count"), where="rules"),
    OpSpec("concat", Kind.CONCAT, 1, params=("dim", "block dim"), where="rules"),
    OpSpec("tile", Kind.TILE, 0, where="internal"),
    OpSpec("kernel", Kind.KERNEL, 0, where="internal"),
)

# The prover's e-graph records the sizes of a tensor's last MAX_RANK dims; programs and rules stay within it.
# A custom kernel's tiles, seen as one tensor for the proof, keep their data in the last KERNEL_RANK dims
# and put the blocks along the grid axes and the loop's iterations in the dims before (see `layout`).
KERNEL_RANK = 5
BLOCK_DIMS = {"x": -6, "y": -7, "z": -8}
LOOP_DIM = -9
MAX_RANK = 9
DIMS = tuple(range(-1, -MAX_RANK - 1, -1))  # every dim the prover tracks, counted from the end

# Names a user may call in a program, in a kernel body, and in a rule.
CALLABLE = frozenset(name for name, spec in OPS.items() if spec.where == "any" and spec.kind not in (Kind.INPUT, Kind.CONST))
BLOCK_CALLABLE = CALLABLE | {name for name, spec in OPS.items() if spec.where == "block"}
RULE_CALLABLE = BLOCK_CALLABLE | {name for name, spec in OPS.items() if spec.where == "rules"}


# Operators written with the same name and a different number of arguments: (written name, arguments) -> op.
OVERLOADS = {(s.written, s.arity): name for name, s in OPS.items() if s.written}


def resolve(written: str, arguments: int) -> str:
    """The operator a call `written(...)` with that many arguments means (`rms_norm(x, eps)` is rms_norm_eps)."""
    return OVERLOADS.get((written, arguments), written)


def written(op: str) -> str:
    """How a call to `op` is written (a name that is no operator, a def's, as it is)."""
    return OPS[op].written or op if op in OPS else op


def arity_words(spec: OpSpec) -> str:
    """What an operator takes, in words: "1 tensor operand and an integer dim"; for a name written with
    several arities, each ("1 tensor operand, or 1 tensor operand and a constant eps")."""
    def words(s: OpSpec) -> str:
        tensors = s.operands - s.constants
        parts = [f"{tensors} tensor operand" + ("s" if tensors != 1 else "")]
        parts += ["a constant eps"] * s.constants
        parts += [f"a {p}" if p == "count" else f"an integer {p}" for p in s.params]
        return " and ".join(parts)
    same = [OPS[op] for (w, _), op in OVERLOADS.items() if w == written(spec.name)]
    same = sorted({s.name: s for s in [OPS[written(spec.name)], *same]}.values(), key=lambda s: s.arity)
    return ", or ".join(words(s) for s in same)
