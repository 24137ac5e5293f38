"""IR back to `.prism` text that parses to the identical IR.

Values used more than once, outputs, and values whose inline text would nest too deep become statements
(named as the user named them where known); everything else is written inline with the fewest
parentheses the precedence allows.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping

from ..ir.nodes import Node, Program
from ..ir.ops import OPS, Kind, written
from ..ir.shapes import dim_params
from ..kernels.finishing import unfinished

# Binding strength, as in the grammar: sums < products < unary minus < atoms.
_PREC = {"add": 1, "sub": 1, "mul": 2, "div": 2, "matmul": 2, "neg": 3}
_ATOM = 4

# Inline text nests at most this deep; a deeper value gets a statement of its own, so that printing a
# long chain of statements neither overflows the stack nor exceeds the parser's nesting bound.
_INLINE_DEPTH = 50


def format_number(value: float) -> str:
    return repr(float(value))  # repr round-trips exactly through float()


def node_text(node: Node, names: Mapping[Node, str]) -> str:
    """`node` on one line, for people: `names` where given, every infix operation in parentheses,
    reduction dims counted from the end (generated code's comments and `prismc show`; not parsed back)."""
    if node in names:
        return names[node]
    if node.op == "const":
        return format_number(node.attr)
    if node.op == "tile":
        return node.attr
    args = [node_text(a, names) for a in node.args]
    spec = OPS[node.op]
    if spec.infix:
        return f"({args[0]} {spec.infix} {args[1]})"
    args += [str(d) for d in dim_params(node)]
    return f"{written(node.op)}({', '.join(args)})"


def print_program(program: Program, *, with_dims: bool = True, keep_names: bool = True) -> str:
    """`program` as .prism text that reads back as the same program. A value the program names (`Program.names`)
    keeps its statement where `keep_names`: lowering names a pre-defined kernel and its output after it, so the text
    read back lowers to the same kernels (a compiled directory's best.prism against its .cu files); the search's
    candidates, whose every value has a made-up name, are printed without (`keep_names=False`), their single-use
    values inline. The work a lowered kernel's store does after its sum across blocks is written as the ops after
    the kernel (`kernels.finishing.unfinished`)."""
    program = unfinished(program)
    lines = []
    if with_dims and program.dims:
        lines.append("dims " + ", ".join(f"{d.name} = {d.default}" for d in program.dims))
        lines.append("")
    params = ", ".join(f"{n.attr}: {n.dtype}[{', '.join(str(s) for s in n.shape)}]" for n in program.inputs)
    lines.append(f"program {program.name}({params}) {{")
    names = _statement_names(program, keep_names)
    text_of: dict[Node, str] = {n: n.attr for n in program.inputs}
    printed: set[int] = set()
    for node in program.nodes():
        if node.op == "kernel":
            kernel = node.attr[0]
            if id(kernel) not in printed:
                printed.add(id(kernel))
                lines += _kernel(kernel, program, text_of)
            continue
        if node in names and node.op != "input":
            lines.append(f"    {names[node]} = {_expr(node, text_of, top=True)}")
            text_of[node] = names[node]
    # Outputs that are another output's value or an input need a statement of their own.
    for out_name, node in program.outputs:
        if text_of.get(node) != out_name:
            lines.append(f"    {out_name} = {text_of.get(node) or _expr(node, text_of, top=True)}")
    lines.append("    return " + ", ".join(n for n, _ in program.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _statement_names(program: Program, keep_names: bool) -> dict[Node, str]:
    uses = Counter(a for node in program.nodes() for a in set(node.args))
    taken = set(program.input_names()) | {n for n, _ in program.outputs}
    names: dict[Node, str] = {}
    for out_name, node in program.outputs:
        if node.op != "input":
            names.setdefault(node, out_name)
    depth: dict[Node, int] = {}  # how deep the node's text nests when written inline
    loaded = {a for n in program.nodes() if n.op == "kernel" for a in n.args}  # a kernel loads by name
    taken |= {s.name for n in program.nodes() if n.op == "kernel" for s in n.attr[0].stores}
    for node in program.nodes():
        depth[node] = 1 + max((1 if a in names else depth[a] for a in node.args), default=0)
        if node.op == "kernel":
            depth[node] = 1
            continue
        if node in names or node.op in ("input", "const") or (uses[node] < 2 and depth[node] < _INLINE_DEPTH
                                                              and node not in loaded
                                                              and not (keep_names and node in program.names)):
            continue
        names[node] = _fresh(program.names.get(node), taken)
    return names


def _fresh(wanted: str | None, taken: set[str]) -> str:
    """`wanted` if it is free and no operator's name, else the first free t0, t1, ...; marked taken."""
    name, counter = wanted, 0
    if name is None or name in taken or name in OPS:
        while f"t{counter}" in taken:
            counter += 1
        name = f"t{counter}"
    taken.add(name)
    return name


def _size(size) -> str:
    return str(int(size)) if size.is_Integer else str(size)


def _kernel(kernel, program: Program, text_of: dict) -> list[str]:
    """A custom kernel as a `kernel` block; its outputs get their store names in `text_of`."""
    grid = ", ".join(f"{a} = {_size(g)}" for a, g in kernel.grid)
    loop = f" loop({_size(kernel.loop)})" if kernel.loop is not None else ""
    lines = [f"    kernel {kernel.name} grid({grid}){loop} {{"]
    for load in kernel.loads:
        src = kernel.inputs[load.source]
        lines.append(f"        {load.tile} = load {text_of[src]}{load.map}")
    local: dict[Node, str] = {n: n.attr for n in kernel.body() if n.op == "tile"}
    taken = {l.tile for l in kernel.loads}
    uses = Counter([a for n in kernel.body() for a in set(n.args)] + [s.value for s in kernel.stores])
    for n in kernel.body():
        if n.op in ("tile", "const") or not (uses[n] > 1 or n in program.names):
            continue
        name = _fresh(program.names.get(n), taken)
        lines.append(f"        {name} = {_expr(n, local, top=True)}")
        local[n] = name
    for s in kernel.stores:
        lines.append(f"        store {s.name}{s.map} {'+=' if s.add else '='} {_expr(s.value, local)}")
    lines.append("    }")
    for n in program.nodes():
        if n.op == "kernel" and n.attr[0] is kernel:
            text_of[n] = kernel.stores[n.attr[1]].name
    return lines


def _expr(node: Node, text_of: dict, top: bool = False) -> str:
    if not top and node in text_of:
        return text_of[node]
    spec = OPS[node.op]
    if node.op == "const":
        return format_number(node.attr)
    if spec.infix:
        lhs, rhs = node.args
        prec = _PREC[node.op]
        # Left-associative: the right operand needs parentheses at equal precedence.
        return f"{_wrap(lhs, text_of, prec)} {spec.infix} {_wrap(rhs, text_of, prec + 1)}"
    if node.op == "neg":
        return f"-{_wrap(node.args[0], text_of, _PREC['neg'])}"
    args = [_expr(a, text_of) for a in node.args]
    if spec.kind is Kind.REDUCE:
        args.append(str(node.attr))
    elif spec.kind is Kind.TRANSPOSE:
        args += [str(d) for d in node.attr]
    return f"{written(node.op)}({', '.join(args)})"


def _wrap(node: Node, text_of: dict, min_prec: int) -> str:
    text = _expr(node, text_of)
    if node in text_of:
        return text
    prec = _PREC.get(node.op, _ATOM)
    if node.op == "const" and node.attr < 0:
        prec = _PREC["neg"]
    return f"({text})" if prec < min_prec else text
