"""The intermediate representation: one frozen, interned node type, and programs over it.

A `Node` is an operator application with its operands, one hashable attribute (an input's name, a
constant's value, a reduction's dim), a dtype and a symbolic shape (a tuple of SymPy expressions).
Nodes are interned: building the same node twice returns the same object, so graph equality is object
identity and common subexpressions are shared for free. Source locations and the user's names for
intermediate values are side tables on `Program`, never part of a node's identity.

Later levels (custom kernels and their block graphs) reuse this node type with more ops.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Iterator, Mapping

import sympy

from ..base.errors import Loc
from .ops import OPS, Kind


class DType(Enum):
    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"
    F64 = "f64"

    @property
    def bytes(self) -> int:
        return _BYTES[self._value_]  # the tuner asks a million times: no dict built, no enum descriptor

    def __str__(self) -> str:
        return self.value


DTYPES = {d.value: d for d in DType}
_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}

Shape = tuple[sympy.Expr, ...]


def dim_symbol(name: str) -> sympy.Symbol:
    """Program dims are positive integer symbols; the assumptions make `Max(n, 1)` simplify to `n`."""
    return sympy.Symbol(name, integer=True, positive=True)


class _Interned(type):
    """Metaclass that returns the existing node when an equal one is built again."""

    def __init__(cls, *args):
        super().__init__(*args)
        cls._cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __call__(cls, op: str, args: tuple = (), attr: Any = None, dtype: DType | None = None, shape: Shape = ()):
        key = (op, tuple(args), attr if not isinstance(attr, float) else ("f", attr), dtype, tuple(shape))
        node = cls._cache.get(key)
        if node is None:
            node = super().__call__(op, tuple(args), attr, dtype, tuple(shape))
            cls._cache[key] = node
        return node


@dataclass(frozen=True, eq=False, repr=False)
class Node(metaclass=_Interned):
    op: str
    args: tuple["Node", ...]
    attr: Any
    dtype: DType | None  # None only for literals, whose type adapts to the other operand
    shape: Shape
    __weakref__: Any = field(init=False, compare=False)

    def __post_init__(self) -> None:
        assert self.op in OPS, self.op

    @property
    def kind(self) -> Kind:
        return OPS[self.op].kind

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        inner = ", ".join([repr(a) for a in self.args] + ([repr(self.attr)] if self.attr is not None else []))
        return f"{self.op}({inner})"

    def walk(self) -> Iterator["Node"]:
        """Every node reachable from this one, operands before users, each once."""
        seen: set[int] = set()
        stack: list[tuple[Node, bool]] = [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in seen:
                continue
            if expanded:
                seen.add(id(node))
                yield node
            else:
                stack.append((node, True))
                stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)


def const(value: float) -> Node:
    return Node("const", (), float(value), None, ())


@dataclass(frozen=True)
class Dim:
    symbol: sympy.Symbol
    default: int

    @property
    def name(self) -> str:
        return self.symbol.name


@dataclass(frozen=True, eq=False)
class Program:
    """A checked tensor program: named inputs (input nodes, in order) and named outputs.

    `locs` and `names` map nodes to where they were written and what the user called them; they help
    messages and printing and are not part of the program's identity (`same_as` ignores them).
    """

    name: str
    dims: tuple[Dim, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[tuple[str, Node], ...]
    locs: Mapping[Node, Loc] = field(default_factory=dict)
    names: Mapping[Node, str] = field(default_factory=dict)
    loc: Loc | None = None

    def at(self, sizes: Mapping[str, int]) -> "Program":
        """The program with `sizes` as its dims' defaults (what a compiled directory's .prism files declare)."""
        return replace(self, dims=tuple(Dim(d.symbol, sizes.get(d.name, d.default)) for d in self.dims))

    def same_as(self, other: "Program") -> bool:
        return (
            self.name == other.name
            and self.dims == other.dims
            and self.inputs == other.inputs
            and tuple((n, id(v)) for n, v in self.outputs) == tuple((n, id(v)) for n, v in other.outputs)
        )

    def nodes(self) -> list[Node]:
        """All nodes of the program in a topological order (operands first), each once."""
        roots = list(self.inputs) + [n for _, n in self.outputs]
        return list(dict.fromkeys(node for root in roots for node in root.walk()))

    def users(self) -> dict[Node, list[Node]]:
        """Each node's users (an operand twice: twice), in the order of `nodes`."""
        users: dict[Node, list[Node]] = {n: [] for n in self.nodes()}
        for n in users:
            for a in n.args:
                users[a].append(n)
        return users

    def input_names(self) -> tuple[str, ...]:
        return tuple(n.attr for n in self.inputs)

    def dim(self, name: str) -> Dim | None:
        return next((d for d in self.dims if d.name == name), None)

    def default_binding(self) -> dict[sympy.Symbol, int]:
        return {d.symbol: d.default for d in self.dims}
