"""How far the search reaches for a program: the ops a loop value may have (`loop_ops`), and the steps a chain of
element-wise ops takes after a kernel (`chain`). Both grow with what the input program itself writes, so that the
search can fuse what the user wrote, and no further.
"""

from __future__ import annotations

from ..ir.nodes import Node, Program
from ..ir.ops import OPS, Kind

# Ops in the loop value an accumulator folds (extracted from the e-graph): at least this many, more where
# the input program writes a longer one (`loop_ops`: attention's scores with RoPE on both operands).
MAX_LOOP_OPS = 3

# What a loop value may be made of: ops on the elements of its tiles (and per-element ops: RoPE), products.
_LOOP_KINDS = (Kind.UNARY, Kind.BINARY, Kind.MASK, Kind.TRANSPOSE, Kind.MATMUL)


def loop_ops(program: Program) -> int:
    """The ops a loop value may have: MAX_LOOP_OPS, or the most that one of the input program's values
    made from its inputs by loop-value ops alone has (so the search can fuse what the user wrote)."""
    size: dict[Node, int | None] = {}
    for n in program.nodes():
        if n.op in ("input", "const"):
            size[n] = 0
        elif OPS[n.op].kind in _LOOP_KINDS or OPS[n.op].per_element:
            parts = [size[a] for a in n.args]
            size[n] = None if None in parts else 1 + sum(parts)
        else:
            size[n] = None
    return max([MAX_LOOP_OPS] + [v for v in size.values() if v is not None])


def chain(program: Program) -> int:
    """The most element-wise ops of the program one after another, each the only reader of the one before: the
    search takes a step more for each past two, which a kernel before them takes as its epilogue or its store
    (`generate._epilogue`, `kernels.finishing`)."""
    users = program.users()
    longest: dict[Node, int] = {}
    for n in reversed(program.nodes()):
        if OPS[n.op].kind in (Kind.UNARY, Kind.BINARY):
            longest[n] = 1 + (longest.get(users[n][0], 0) if len(set(users[n])) == 1 else 0)
    return max(longest.values(), default=0)
