"""A split's combining kernel run in the launch of the kernel whose pieces it combines: one launch, not two.

Where it sits: between parameter instantiation and code generation. The search offers a loop kernel split
in two (`search.split`): the first kernel's blocks each fold one piece of the loop and store their partial
states; a combining kernel, one block per tile, folds the pieces. Run as two kernels, the second waits for
the whole first launch and pays a launch of its own. Here the pair becomes one launch: each block of the
first kernel stores its piece as before, then takes a ticket for its tile (one counter per tile in device
memory); the block that takes the last ticket, which sees every other piece's states, runs the combining
kernel's code for that tile, and puts the counter back to zero for the next launch (`prism::last_of`).

The pair must be such that the combining block of a tile reads only what the pieces of that tile wrote, and
what `pairs` checks is exactly that, on the kernels themselves (so a program written by hand qualifies as
the search's own splits do):
    - the second kernel runs right after the first, and no other kernel, nor the program's outputs, reads
      what the first stores;
    - the first kernel's last grid axis is the split: every one of its stores has that axis on its leading
      dim and no other; the second kernel's grid is the first's without that axis, and its loop walks the
      pieces (a loop range equal to that axis's size);
    - the second kernel loads each of those stores whole along the leading dim, by its loop, and along the
      others as the first kernel stored them.
At concrete parameters (`in_launch`), the combining code runs on the first kernel's threads (rendered for
that many: `tail_config`), and neither kernel takes its blocks in an order of its own (a causal grid's
longest first), which would break the tile's numbering. `render_launch` writes the launch: the first
kernel's code, the ticket, then the combining kernel's code with its shared buffers in phases 3-5 and its
block indices those of the tile (the split axis's left at 0).

Ordering: every thread of the block has stored its part of the piece before the block's barrier; one thread
then makes the block's stores visible at the GPU's scope (a fence), takes the ticket (an atomic add), and,
if it is the last, fences again before the block's second barrier, after which every thread of that block
reads the other pieces' states: the pattern of a grid-wide barrier in one direction, which the PTX memory
model makes the pieces' stores visible to (a release and an acquire at gpu scope; the L1 of the combining
block's SM cannot answer with older data). The emulation takes the ticket as an acquire-release atomic,
which ThreadSanitizer checks the combining block's reads against.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

from ..ir.nodes import Program
from ..kernels.constraints import Concrete
from ..kernels.kernel import DimMap, Kernel, kernels_of
from ..kernels.position import longest_first
from . import sums
from .codegen import Emitter, RenderedKernel, template_env
from .launch import CodegenConfig, layout


def pairs(program: Program) -> dict[str, str]:
    """The combining kernels that can run in the launch of the kernel before them: combining kernel's name ->
    the first kernel's name (the module doc's conditions)."""
    kernels = kernels_of(program)
    readers: dict[int, set[str]] = {}  # id of a kernel -> the kernels that read its outputs
    for k in kernels:
        for n in k.inputs:
            if n.op == "kernel":
                readers.setdefault(id(n.attr[0]), set()).add(k.name)
    outputs = {id(n.attr[0]) for _, n in program.outputs if n.op == "kernel"}
    found = {}
    for first, second in zip(kernels, kernels[1:]):
        if readers.get(id(first)) == {second.name} and id(first) not in outputs and _combines(first, second):
            found[second.name] = first.name
    return found


def _combines(first: Kernel, second: Kernel) -> bool:
    """Whether `second`'s block of each tile reads only what `first`'s blocks of that tile store."""
    if not first.grid or second.loop is None or not first.stores:
        return False
    split, pieces = first.grid[-1]
    rest = first.grid[:-1]
    if (second.grid != rest and not (not rest and second.grid == (("x", 1),))) or second.loop != pieces:
        return False
    for store in first.stores:
        dims = store.map.dims
        if store.add or not dims or dims[0].axis != split or dims[0].loop or any(d.axis == split for d in dims[1:]):
            return False
    loaded = set()
    for load in second.loads:
        tensor = second.inputs[load.source]
        if tensor.op != "kernel" or tensor.attr[0] is not first:
            continue
        stored = first.stores[tensor.attr[1]].map.dims
        if load.map.dims[0] != DimMap(None, True) or load.map.dims[1:] != stored[1:]:
            return False
        loaded.add(tensor.attr[1])
    return loaded == set(range(len(first.stores)))


def tail_config(first: Concrete, config: CodegenConfig) -> CodegenConfig:
    """The config the combining code is rendered and priced with: the first kernel's threads."""
    return replace(config, threads=layout(first, config).threads)


def in_launch(program: Program, concrete: Mapping[str, Concrete], config: CodegenConfig) -> dict[str, str]:
    """Of `pairs`, those that run in one launch at these parameters (combining kernel -> first kernel); none
    where the config asks for a launch per kernel."""
    return {second: first for second, first in pairs(program).items()
            if first in concrete and second in concrete and joins(concrete[first], concrete[second], config)}


def joins(first: Concrete, second: Concrete, config: CodegenConfig) -> bool:
    """Whether the combining kernel `second` of a pair (`pairs`) runs in `first`'s launch at these parameters."""
    if not config.one_launch or sums.groups(first) or sums.groups(second):  # a sum's tickets are the kernel's own
        return False
    if longest_first(first.kernel, dict(first.grid), config.sms) or longest_first(second.kernel, dict(second.grid),
                                                                                    config.sms):
        return False
    mine, theirs = layout(first, config), layout(second, tail_config(first, config))
    if mine.copy_warp or theirs.copy_warp:  # a copy warp leaves before the ticket's block-wide barriers; the
        return False                         # combining code runs on the first kernel's threads, none of them one
    return theirs.threads == mine.threads


def render_launch(first: Concrete, second: Concrete, program: Program,
                  config: CodegenConfig = CodegenConfig()) -> RenderedKernel:
    """One launch of `first` that also runs `second`, a combining kernel of its pieces (`tails.pairs`): each
    tile's last block to finish its piece runs `second`'s code for that tile (see `tails`)."""
    a = Emitter(first, program, config)
    b = Emitter(second, program, tail_config(first, config), blk="tile_")  # the tile's place, the split axis left out
    ka, kb = a.context(), b.context(phase=3)
    split, pieces = first.grid[-1]
    # what `second` reads that `first` does not write or read, then the outputs of both
    taken = {p.rsplit(" ", 1)[1] for p in ka["params"]}
    extra = [p for p in kb["inputs"] if p.rsplit(" ", 1)[1] not in taken]
    # the tile's ticket: its place in the combining kernel's grid (never the split axis)
    kb |= {"pieces": pieces, "ticket": sums.place_index(second.grid, "blockIdx."),
           "tiles": [f"[[maybe_unused]] const int tile_{axis} = {'0' if axis == split else f'blockIdx.{axis}'};"
                     for axis, _ in second.grid]}
    ka |= {"params": ka["inputs"] + extra + ka["outputs"] + kb["outputs"] + ["unsigned* __restrict__ prism_tickets"],
           "smem": max(ka["smem"], kb["smem"]), "wgmma": ka["wgmma"] or kb["wgmma"]}
    source = template_env().get_template("kernel.cu.j2").render(k=ka, t=kb)
    one, two = a.rendered(ka, source), b.rendered(kb, "")
    inputs = one.args[: len(one.args) - one.stores]
    inputs += tuple(n for n in two.args[: len(two.args) - two.stores] if n not in one.args)
    args = inputs + one.args[len(one.args) - one.stores:] + two.args[len(two.args) - two.stores:]
    return replace(one, args=args, stores=one.stores + two.stores, zero=one.zero + two.zero,
                   tensor_cores=one.tensor_cores or two.tensor_cores, combines=second.kernel.name,
                   tickets=math.prod(size for _, size in second.grid))
