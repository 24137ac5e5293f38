"""The words `prismc check` and `prismc rules` print: a rule per line, a program in one line, counts; and the
check that rule files given together name no rule twice, as `prove --rules` refuses."""

from __future__ import annotations

from ..base.errors import Diagnostic, PrismError


def print_rules(rules, statuses=None, *, words: bool = True) -> None:
    """One line per rule: name, arrow, file:line:col, in aligned columns.

    With `statuses` (rule name -> "symbolic" or "numeric", from the soundness check), each rule's status
    in words before its location, or, with `words=False`, a '*' after the location of each rule that was
    tested numerically only (the caller says once what the mark means).
    """
    from ..prove.soundness import NUMERIC_ONLY, STATUS_WORDS

    width = max((len(r.name) for r in rules), default=0)
    shown = max((len(w) for w in STATUS_WORDS.values()), default=0)
    for r in rules:
        status = (statuses or {}).get(r.name)
        if statuses is not None and words:
            print(f"  {r.name:<{width}}  {r.arrow:<3}  {STATUS_WORDS.get(status, ''):<{shown}}  {r.loc}")
        else:
            print(f"  {r.name:<{width}}  {r.arrow:<3}  {r.loc}" + ("  *" if status == NUMERIC_ONLY else ""))


def summary(prog) -> str:
    from ..kernels.kernel import kernels_of

    ops = sum(1 for n in prog.nodes() if n.op not in ("input", "const", "kernel"))
    kernels = len(kernels_of(prog))
    dims = ", ".join(f"{d.name}={d.default}" for d in prog.dims)
    parts = [count(len(prog.inputs), "input"), count(len(prog.outputs), "output"),
             *([count(kernels, "custom kernel")] if kernels else []), count(ops, "op"),
             *([f"dims {dims}"] if dims else [])]
    return f"program {prog.name} ({', '.join(parts)})"


def count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def clashing(mine: list, named: dict) -> None:
    """Refuses (PrismError) a rule of one file named as a rule of another file given with it, which `named`
    (rule name -> rule) holds; then adds this file's rules to `named`."""
    clashes = [Diagnostic(r.loc, f"duplicate rule name '{r.name}'", (
        f"also defined at {named[r.name].loc}, a file given with this one: prove --rules takes them together",))
        for r in mine if r.name in named and named[r.name].loc.path != r.loc.path]
    named.update({r.name: r for r in mine if r.name not in named})
    if clashes:
        raise PrismError(clashes)
