"""The syntax tree of both languages, as parsed, before any checking.

Expressions are shared by `.prism` and `.rules`: every operator application, infix or not, is a `Call`
with the operator's name (`a + b` is `Call("add", (a, b))`), so later passes see one form. Every node
carries its `Loc`; locations are not part of equality.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base.errors import Loc

# -- expressions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    value: float
    text: str
    loc: Loc = field(compare=False)


@dataclass(frozen=True)
class Name:
    id: str
    loc: Loc = field(compare=False)


@dataclass(frozen=True)
class Call:
    fn: str
    args: tuple["Expr", ...]
    loc: Loc = field(compare=False)
    form: str = field(default="call", compare=False)  # "call", "infix" or "prefix": how it was written


Expr = Num | Name | Call

# -- .prism items ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    path: str
    loc: Loc


@dataclass(frozen=True)
class DimDecl:
    name: str
    value: int
    loc: Loc


@dataclass(frozen=True)
class Def:
    name: str
    params: tuple[str, ...]
    body: Expr
    loc: Loc


@dataclass(frozen=True)
class ShapeDim:
    """One entry of a declared shape: a dim name or an integer literal."""

    value: str | int
    loc: Loc


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str
    shape: tuple[ShapeDim, ...]
    loc: Loc
    dtype_loc: Loc


@dataclass(frozen=True)
class Stmt:
    name: str
    expr: Expr
    loc: Loc


@dataclass(frozen=True)
class Return:
    names: tuple[tuple[str, Loc], ...]
    loc: Loc


@dataclass(frozen=True)
class MapEntry:
    """One dim of a load or store map: the names that split it (`x`, `loop`, `x*loop`); () is `:`."""

    names: tuple[str, ...]
    loc: Loc


@dataclass(frozen=True)
class LoadStmt:
    tile: str
    source: str
    entries: tuple[MapEntry, ...]
    loc: Loc
    source_loc: Loc


@dataclass(frozen=True)
class StoreStmt:
    name: str
    entries: tuple[MapEntry, ...]
    add: bool  # `+=`
    expr: Expr
    loc: Loc


@dataclass(frozen=True)
class Size:
    """A grid size or loop range as written: an integer, a dim, or a kernel symbol."""

    value: str | int
    loc: Loc


@dataclass(frozen=True)
class KernelDecl:
    name: str
    grid: tuple[tuple[str, Size, Loc], ...]  # (axis, size, where the axis is named)
    loop: Size | None
    body: tuple["LoadStmt | Stmt | StoreStmt", ...]
    loc: Loc


@dataclass(frozen=True)
class ProgramDecl:
    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt | KernelDecl, ...]
    ret: Return
    loc: Loc


Item = Import | DimDecl | Def | ProgramDecl


@dataclass(frozen=True)
class Module:
    path: str
    items: tuple[Item, ...]
