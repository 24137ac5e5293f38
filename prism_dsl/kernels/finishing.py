"""A sum across blocks and the element-wise work after it in one launch: the work done as the sum is stored.

Where it sits: the first step of lowering (`lower` runs it). A custom kernel's `+=` store (its blocks' tiles
added: split-K over the grid, an MLP whose up-projection's columns the grid spreads) is often followed by
element-wise work on the whole sum, which no block can do before the sum is complete: a residual added after an
MLP (`X + t`), a bias, an activation. As a pre-defined kernel it costs a launch and a pass over the tensor. Here the
chain goes into the store instead (`Store.then`, with the sum as the input node named `SUM`): the block that
stores the finished sum (the tile's last, `backend.sums`; every block, where the grid sums nothing at the
parameters chosen) applies it, reading the chain's other tensors at the element it stores.

What qualifies: the kernel's output is read by one element-wise op of the output's shape and nothing else, and so
on along the chain, whose end is what the store then writes; every other operand of the chain is a constant or a
program input whose shape broadcasts to the output's. f64 sums, added in the output itself, are left as they are.

The language has no `then`: a lowered program is printed with each chain written out again after its kernel
(`unfinished`, which `lang.printer` applies), which lowering takes back to the same kernels.
"""

from __future__ import annotations

from dataclasses import replace

from ..ir.nodes import DType, Node, Program
from ..ir.ops import OPS, Kind
from ..ir.shapes import rebuild, same
from .kernel import SUM, fresh_name, kernels_of, stored_dtype


def finish_sums(program: Program) -> Program:
    """The program with each qualifying chain after a `+=` store done by that store (see the module doc)."""
    nodes, users = program.nodes(), program.users()
    outputs = {id(node) for _, node in program.outputs}
    chains: dict[Node, list[Node]] = {}  # a kernel's output node -> the chain its store takes
    for n in nodes:
        if n.op == "kernel" and _summed(n) and id(n) not in outputs:
            chain, at = [], n
            while id(at) not in outputs and len(set(users[at])) == 1 and _follows(users[at][0], at):
                at = users[at][0]
                chain.append(at)
            if chain:
                chains[n] = chain
    if not chains:
        return program
    new: dict[Node, Node] = {}  # program node -> what stands for it now
    gone = {m for chain in chains.values() for m in chain[:-1]}  # done by the stores, read by their chains alone
    kernels: dict[int, object] = {}  # id of a kernel -> the kernel with its chains (and operands) in place
    names = dict(program.names)
    for n in nodes:
        if n.op == "kernel":
            kernel, index = n.attr
            if id(kernel) not in kernels:
                kernels[id(kernel)] = _with_chains(kernel, {k.attr[1]: c for k, c in chains.items()
                                                            if k.attr[0] is kernel}, program, new)
            k = kernels[id(kernel)]
            end = chains[n][-1] if n in chains else n
            node = Node("kernel", k.inputs, (k, index), k.stores[index].result.dtype, end.shape)
            new[end] = node
            names[node] = k.stores[index].name
            if n is not end:
                new[n] = node  # (read by the chain alone, which no longer runs)
        elif n not in new and n not in gone and any(a in new for a in n.args):
            new[n] = rebuild(n, [new.get(a, a) for a in n.args])
    outs = tuple((name, new.get(node, node)) for name, node in program.outputs)
    return Program(program.name, program.dims, program.inputs, outs, {}, names, program.loc)


def _summed(n: Node) -> bool:
    kernel, index = n.attr
    store = kernel.stores[index]
    return store.add and store.then is None and stored_dtype(kernel, index) is not DType.F64


def _follows(user: Node, at: Node) -> bool:
    """Whether `user` is an element-wise op of `at`'s shape, not of f64, whose other operands are constants or program
    inputs that broadcast to it."""
    if OPS[user.op].kind not in (Kind.UNARY, Kind.BINARY) or user.rank != at.rank or user.dtype is DType.F64:
        return False  # (an f64 result is added in the output itself, where no block sees the whole sum)
    if not all(same(a, b) for a, b in zip(user.shape, at.shape)):
        return False
    return all(a is at or a.op == "const" or a.op == "input" and _broadcasts(a, at) for a in user.args)


def _broadcasts(a: Node, to: Node) -> bool:
    return a.rank <= to.rank and all(same(x, 1) or same(x, y) for x, y in zip(reversed(a.shape), reversed(to.shape)))


def _with_chains(kernel, chains: dict[int, list[Node]], program: Program, new: dict[Node, Node]):
    """The kernel reading what stands for its operands now, each store in `chains` (by index) taking its chain:
    the chain rebuilt over the sum (an input named SUM) and the program inputs it reads, which the kernel takes as
    operands after its own."""
    inputs = [new.get(a, a) for a in kernel.inputs]
    stores = list(kernel.stores)
    for index, chain in chains.items():
        store = stores[index]
        start = next(a for a in chain[0].args if a.op == "kernel")
        here = {start: Node("input", (), SUM, start.dtype, start.shape)}
        for n in chain:
            for a in n.args:
                if a.op == "input" and a not in inputs:
                    inputs.append(a)
            here[n] = rebuild(n, [here.get(a, a) for a in n.args])
        name = next((nm for nm, o in program.outputs if o is chain[-1]), None) or program.names.get(chain[-1], store.name)
        stores[index] = replace(store, name=name, then=here[chain[-1]])
    return replace(kernel, inputs=tuple(inputs), stores=tuple(stores))


def unfinished(program: Program) -> Program:
    """The program with each store's `then` written out again as the ops after its kernel, over the sum stored under a
    name of its own (`{name}_sum`), the kernel taking only the tensors it loads: what `finish_sums` takes back to the
    same kernels, and the language can write."""
    if not any(s.then is not None for k in kernels_of(program) for s in k.stores):
        return program
    taken = {n.attr for n in program.inputs} | {name for name, _ in program.outputs} | set(program.names.values())
    taken |= {s.name for k in kernels_of(program) for s in k.stores}
    new: dict[Node, Node] = {}
    kernels: dict[int, object] = {}
    names = dict(program.names)
    for n in program.nodes():
        if n.op != "kernel":
            if any(a in new for a in n.args):
                new[n] = rebuild(n, [new.get(a, a) for a in n.args])
            continue
        kernel, index = n.attr
        if id(kernel) not in kernels:
            loaded = 1 + max((load.source for load in kernel.loads), default=-1)
            stores = tuple(replace(s, name=fresh_name(f"{s.name}_sum", taken), then=None) if s.then is not None else s
                           for s in kernel.stores)
            taken |= {s.name for s in stores}
            kernels[id(kernel)] = replace(kernel, inputs=tuple(new.get(a, a) for a in kernel.inputs[:loaded]),
                                          stores=stores)
        k, store = kernels[id(kernel)], kernel.stores[index]
        node = Node("kernel", k.inputs, (k, index), store.value.dtype, n.shape)
        names[node] = k.stores[index].name
        if store.then is None:
            new[n] = node
            continue
        here: dict[Node, Node] = {}

        def written(m: Node) -> Node:
            if m not in here:
                here[m] = node if m.op == "input" and m.attr == SUM else m if not m.args else \
                    rebuild(m, [written(a) for a in m.args])
            return here[m]
        new[n] = written(store.then)
        names[new[n]] = store.name
    outs = tuple((name, new.get(node, node)) for name, node in program.outputs)
    return Program(program.name, program.dims, program.inputs, outs, {}, names, program.loc)
