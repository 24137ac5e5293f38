"""What the checkers share: the names a file sees, the message for a name that is not there, and POISON.

`check` checks programs and `check_kernel` the kernels declared inside them; both read the same `Scope`
(dims and defs, the file's own and its imports'), word unknown names the same way, and give an
expression that already produced an error the value POISON, so that its uses stay quiet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import syntax_tree as ast
from ..ir.ops import CALLABLE
from .syntax import suggest


@dataclass
class Scope:
    """What a file sees: its own and its imports' dims and defs (each with where it was declared)."""

    dims: dict[str, ast.DimDecl] = field(default_factory=dict)
    defs: dict[str, ast.Def] = field(default_factory=dict)
    broken: set[str] = field(default_factory=set)  # defs whose body has an error, reported where declared
    incomplete: bool = False  # an import failed: names it would have declared are unknown


def unknown_name(name: str, known, scope: Scope) -> str:
    """Why `name` has no value here, in words: a function or dim used as a value, or a likely typo."""
    if name in CALLABLE or name in scope.defs:
        return f"'{name}' is a function; call it as {name}(...)"
    if name in scope.dims:
        return f"'{name}' is a dim; dims appear only in input shapes"
    return f"undefined name '{name}'{suggest(name, known)}"


def unknown_function(name: str, scope: Scope) -> str:
    return f"unknown function '{name}'{suggest(name, set(CALLABLE) | set(scope.defs))}"


class Poison:
    """The value of an expression that already produced an error: uses of it stay quiet."""


POISON = Poison()
