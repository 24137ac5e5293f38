"""Size expressions evaluated exactly and fast: grid sizes, loop ranges, tiles and shared memory.

Kernel sizes are SymPy expressions over program dims and free kernel symbols. While parameters are
tuned they are evaluated many thousands of times, so each expression is compiled once into Python
arithmetic on integers and fractions; the result is the number `bind` gives, without SymPy on the way.
"""

from fractions import Fraction
from functools import cache
from typing import Callable, Mapping, Sequence

import sympy


def bind(expr, binding: Mapping[sympy.Symbol, int]) -> sympy.Expr:
    """`expr` with the bound symbols replaced by their (integer) values."""
    return sympy.sympify(expr).xreplace({k: sympy.Integer(v) for k, v in binding.items()})


def value(expr, binding: Mapping[sympy.Symbol, int]) -> int | Fraction | None:
    """The exact value of `expr` when `binding` gives every symbol in it, else None (an int when whole)."""
    return call(_compiled(expr if isinstance(expr, sympy.Basic) else sympy.sympify(expr)), binding, None)


def int_value(expr, binding: Mapping[sympy.Symbol, int]) -> int:
    """`value` for an expression known to be a whole number under a complete binding."""
    v = value(expr, binding)
    if v is None or v.denominator != 1:
        raise ValueError(f"{expr} is not a whole number under this binding ({v})")
    return int(v)


def call(compiled: tuple, binding: Mapping[sympy.Symbol, int], missing):
    """A compiled function (`compile_sizes`) applied to the binding's values: `missing` when one is
    unbound."""
    symbols, fn = compiled
    try:
        return fn(*[int(binding[s]) for s in symbols])
    except KeyError:
        return missing


@cache
def _compiled(expr: sympy.Expr) -> tuple:
    return compile_sizes((expr,), lambda sources: sources[0])


def compile_sizes(exprs: Sequence[sympy.Expr], body: Callable[[list[str]], str]) -> tuple:
    """(the symbols of `exprs` in order, a function of their values) computing `body` of the expressions'
    Python sources. Sizes are built from integers, symbols, sums, products, integer powers and maxima,
    nothing else; integers stay Python ints, and a quotient becomes a Fraction only when it does not divide."""
    symbols = tuple(sorted(set().union(*(e.free_symbols for e in exprs)), key=str))
    index = {s: i for i, s in enumerate(symbols)}
    params = ", ".join(f"v{i}" for i in range(len(symbols)))
    source = body([_source(e, index) for e in exprs])
    return symbols, eval(f"lambda {params}: {source}", {"F": Fraction, "Q": _quotient})


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
    if isinstance(e, sympy.Max):
        return "max(" + ", ".join(_source(a, index) for a in e.args) + ")"
    raise ValueError(f"size expression {e} is not arithmetic on integers")


def _quotient(n, d):
    if isinstance(n, int) and isinstance(d, int) and n % d == 0:
        return n // d
    return Fraction(n, d)
