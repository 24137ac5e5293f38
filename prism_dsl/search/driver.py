"""The superoptimizer's search: programs of fused custom kernels, each proved equal to the target.

Level 1, symbolic generation (`Generator`). Depth first over prefix programs, one kernel at a time,
fewer kernels first. A step is a custom kernel or a pre-defined kernel for one of the target's own ops; a
candidate is complete when every output of the target is computed and every step's result is read. A
custom kernel loads some of the tensors computed so far (tiles whose maps, grid sizes and loop range
stay symbols) and is one of:
- a loop kernel: a set of loop accumulators, each over loop values of its tiles. The loop values (at
  most MAX_LOOP_OPS ops) and the work after the loop are not enumerated op by op: they are extracted
  from the target's e-graph (`TargetGraph.extract`), the cheapest terms over the tiles and over the
  accumulators. What is enumerated is the accumulators (op and operand e-classes), in one canonical
  order (combinations, so no permutation is generated twice);
- a kernel without a loop: the missing outputs extracted over whole tiles (the last step only).
Pruning, with a counter per reason:
- expression: an accumulator's abstract expression (`abstract`) must be in the target's saturated
  e-graph (with the definitions, algebra and subexpression rulesets of rules/);
- shape: operands must agree on their whole, unsplit sizes (the maps are still symbols);
- phase: `acc_sum` folds partial sums only (a matmul or a sum), so its meaning survives the loop;
- unused accumulator / no post-loop form: the kernel's outputs cannot be built from its accumulators,
  or do not read them all; accumulators that no output can reach through element-wise ops are dropped
  before any combination is tried;
- unstable exp: a target written with softmax accepts only max-shifted exp;
- duplicate, unused output, limits: the frozen `SearchConfig` (kernels, accumulators, ops, outputs).

Level 2, map instantiation (`Level2`). The dims of a kernel's body are grouped into index
classes (dims that must be split alike: an element-wise op's operands, a matmul's contracted pair...).
A map is then a choice of classes for the grid axes (a set, assigned to x, y, z in one canonical order:
grid-axis symmetry broken, no dead axis) and one for the loop; each tile's map follows. A choice is
dropped when a bound no instantiation can meet is broken (shared memory at the smallest tiles), when the
kernel checker rejects it, or when the kernel disagrees numerically with its abstract expression on
small random inputs (a filter that saves proof time; it proves nothing). A valid choice for a loop kernel
whose accumulators all have a combining form is also offered split in two (`Split`, FlashDecoding): the
first kernel's loop dim is also split by one more grid axis and each block stores its piece's partial
state; a combining kernel loops over the pieces. Every kernel combination that
survives is then PROVED equal to the target by the e-graph with the layout axioms (`prove`), in parallel
egglog processes. Only proved programs are results; their sizes stay symbolic, so each holds for every
binding of the dims.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np
import sympy

from ..prove import egglog_runner
from .abstract import TargetGraph, meaning, saturate
from ..prove.egglog_runner import Limits
from ..prove.egraph import compile_library
from ..base.errors import PrismError
from ..ir.nodes import Node, Program, dim_symbol
from ..kernels.kernel import (AXES, DimMap, Kernel, Load, Store, Target, TileMap, output_shape, shared_memory, tile_shape,
                     value)
from ..prove.layout import to_terms
from ..ir.ops import OPS, Kind
from ..lang.printer import print_program
from ..prove.prover import _terms, pair_outputs, schedule
from ..semantics.reference import evaluate, evaluate_nodes, random_inputs
from ..prove.rules import Library
from ..ir.shapes import ShapeError, build, same_shape

PROOF_LIMITS = Limits(iterations=30, nodes=150_000, seconds=20.0)
NUMERIC_CAP = 16  # dims are capped at this size for the numeric filter
NUMERIC_RTOL = 1e-6  # float64 on both sides: anything above this is a real difference
MAX_COMBINATIONS = 64  # kernel-map combinations proved per level-1 candidate
ACCUMULATORS = ("acc_sum", "acc_sum_last", "acc_mean_last", "acc_rms_last", "acc_max_last",
                "acc_softmax_sum", "acc_softmax_out", "acc_rescaled_sum")
# Accumulators that combine per-block partial results: only the combining kernel of a split reduction
# (`Split`, built at level 2) uses them, so level 1 does not generate them.
COMBINING = ("acc_max_last", "acc_rescaled_sum")
MAX_LOOP_OPS = 3  # ops in the loop value an accumulator folds (extracted from the e-graph)


@dataclass(frozen=True)
class SearchConfig:
    """The search's limits. Frozen: it is part of the checkpoint's key."""

    max_kernels: int = 1  # custom kernels per program
    max_predefined: int = 1  # pre-defined kernels (one target op each) per program
    max_block_ops: int = 8  # body ops per custom kernel, accumulators included
    max_accumulators: int = 3
    max_inputs: int = 3  # tensors one custom kernel loads
    max_outputs: int = 3  # tensors one custom kernel stores
    max_grid_axes: int = 3
    expression_pruning: bool = True  # off: every op that passes the other checks (small limits only)
    split_reductions: bool = True  # loop kernels also split in two (`Split`); the second is not counted above
    ops: tuple[str, ...] | None = None  # the block ops to try; None: those in the target's e-graph

    def key(self) -> dict:
        return asdict(self)


# -- level 1 ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sketch:
    """A custom kernel at level 1: body ops over whole-size tiles of kernel-level values."""

    inputs: tuple[int, ...]  # indices of the kernel-level values it loads, in load order
    tiles: tuple[Node, ...]  # the tile nodes (whole sizes), one per input
    outputs: tuple[Node, ...]  # the block values it stores
    loop: bool  # it has accumulators, hence a loop


@dataclass(frozen=True)
class Predefined:
    """A pre-defined kernel computing one op of the target on kernel-level values."""

    op: Node  # the target's node (its op and attr are reused)
    args: tuple[int, ...]


@dataclass(frozen=True)
class Candidate:
    """A complete level-1 program: steps in order; each target output is some step's value."""

    steps: tuple[Sketch | Predefined, ...]
    outputs: tuple[int, ...]  # per target output, the kernel-level value that holds it
    abstracts: tuple[Node, ...]  # the abstract expression of every kernel-level value


@dataclass
class Stats:
    generated: int = 0  # block and kernel ops generated (each one checked)
    candidates: int = 0  # complete level-1 programs
    maps: int = 0  # level-2 map choices tried
    proofs: int = 0  # candidates sent to the prover
    verified: int = 0
    pruned: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"generated": self.generated, "candidates": self.candidates, "maps": self.maps,
                "proofs": self.proofs, "verified": self.verified, "pruned": dict(sorted(self.pruned.items()))}


class Stop(Exception):
    """The search was told to stop (time limit, interruption)."""


class Generator:
    """Level 1: enumerates complete candidates (see the module doc), counting what it prunes."""

    def __init__(self, program: Program, target: TargetGraph, config: SearchConfig, stats: Stats,
                 should_stop: Callable[[], bool] = lambda: False):
        self.program, self.target, self.config, self.stats = program, target, config, stats
        self.should_stop = should_stop
        self.atom_cache: dict = {}
        # A target written with softmax asks for the stable form: no exp of an unshifted value.
        self.stable = any(n.op == "softmax" for n in program.nodes())
        self.memo: dict[Node, str | None] = {}
        self.wanted = [target.outputs[name] for name, _ in program.outputs]
        self.seen: set = set()
        # the target's own ops, for pre-defined kernels: e-class of the node -> node
        self.target_ops = {}
        for n in program.nodes():
            if n.op not in ("input", "const"):
                self.target_ops.setdefault(target.lookup(n, self.memo), n)

    def eclass(self, abstract: Node) -> str | None:
        return self.target.lookup(abstract, self.memo)

    def prune(self, reason: str) -> None:
        self.stats.pruned[reason] += 1

    def candidates(self) -> Iterator[Candidate]:
        """Complete programs with fewer steps first (iterative deepening), each once."""
        inputs = list(self.program.inputs)
        classes = [self.eclass(n) for n in inputs]
        limit = self.config.max_kernels + self.config.max_predefined
        for depth in range(1, limit + 1):  # fewer kernels first
            yield from self._kernel_level([], inputs, classes, depth)

    # -- kernel level ----------------------------------------------------------------------------------

    def _complete(self, classes: list) -> tuple[int, ...] | None:
        out = []
        for want in self.wanted:
            if want not in classes:
                return None
            out.append(classes.index(want))
        return tuple(out)

    def _kernel_level(self, steps: list, values: list[Node], classes: list, depth: int) -> Iterator[Candidate]:
        if self.should_stop():
            raise Stop
        done = self._complete(classes)
        if done is not None:
            if len(steps) == depth:
                if not _all_used(steps, done, len(self.program.inputs)):
                    self.prune("unused output")
                    return
                key = (tuple(steps), done)
                if key in self.seen:
                    self.prune("duplicate")
                    return
                self.seen.add(key)
                self.stats.candidates += 1
                yield Candidate(tuple(steps), done, tuple(values))
            return
        if len(steps) >= depth:
            return
        customs = sum(isinstance(s, Sketch) for s in steps)
        predefs = len(steps) - customs
        if predefs < self.config.max_predefined:
            for n in self.target_ops.values():
                args = [classes.index(c) if (c := self.eclass(a)) in classes else None for a in n.args]
                if None in args or self.eclass(n) in classes or n.op == "const":
                    continue
                if any(a.op == "const" for a in n.args):
                    continue
                self.stats.generated += 1
                step = Predefined(n, tuple(args))
                yield from self._kernel_level(steps + [step], values + [n], classes + [self.eclass(n)], depth)
        if customs < self.config.max_kernels:
            last = steps[-1] if steps else None
            last_start = len(values) - (len(last.outputs) if isinstance(last, Sketch) else 1) if last else 0
            for k in range(1, self.config.max_inputs + 1):
                for chosen in itertools.combinations(range(len(values)), k):
                    # After the first step, a kernel reads something the step before it computed: any
                    # other order of independent steps is generated from another prefix.
                    if steps and max(chosen) < last_start:
                        continue
                    yield from self._block_level(steps, values, classes, depth, chosen)

    # -- block level -----------------------------------------------------------------------------------

    def _block_level(self, steps, values, classes, depth, chosen) -> Iterator[Candidate]:
        tiles = []
        taken: set[str] = set()
        for i in chosen:
            v = values[i]
            name = (v.attr if v.op == "input" else f"t{i}").lower() + "t"
            while name in taken:
                name += "_"
            taken.add(name)
            tiles.append(Node("tile", (), name, v.dtype, v.shape))
        leaves = {classes[i]: (t, values[i]) for i, t in zip(chosen, tiles)}
        if len(leaves) < len(tiles) or not all(isinstance(c, str) for c in leaves):
            return
        yield from self._no_loop(steps, values, classes, depth, chosen, tiles)
        atoms = self._atoms(leaves)
        if len(steps) + 1 == depth:
            # The last kernel's accumulators are leaves of its outputs' post-loop terms: only those
            # under the missing outputs through element-wise ops can be.
            under = self.target.below([w for w in self.wanted if w not in classes])
            useful = [a for a in atoms if a.eclass in under]
            self.stats.pruned["unused accumulator"] += len(atoms) - len(useful)
            atoms = useful
        for k in range(1, min(self.config.max_accumulators, self.config.max_block_ops) + 1):
            for combo in itertools.combinations(atoms, k):
                if self.should_stop():
                    raise Stop
                self.stats.generated += 1
                if len({a.eclass for a in combo}) < k:
                    self.prune("duplicate")
                    continue
                if sum(a.ops for a in combo) > self.config.max_block_ops:
                    self.prune("limits")
                    continue
                yield from self._close(steps, values, classes, depth, chosen, tiles, combo)

    def _atoms(self, leaves: dict) -> list["Atom"]:
        """The accumulators a loop kernel over these tiles may hold: each accumulator applied to loop
        values (small terms over the tiles, extracted from the e-graph), kept when its abstract
        expression is in the target's e-graph (expression-guided pruning)."""
        key = tuple(sorted((c, t) for c, (t, _) in leaves.items()))
        if key in self.atom_cache:
            return self.atom_cache[key]
        block_terms = self.target.terms_from({c: t for c, (t, _) in leaves.items()}, MAX_LOOP_OPS)
        abstract_terms = self.target.terms_from({c: v for c, (_, v) in leaves.items()}, MAX_LOOP_OPS)
        operands = [(c, t, abstract_terms[c]) for c, t in block_terms.items() if c in abstract_terms]
        atoms = []
        for op in ACCUMULATORS:
            if self.config.ops is not None and op not in self.config.ops or op in COMBINING:
                continue
            for args in self._operand_tuples(op, operands):
                self.stats.generated += 1
                try:
                    node = build(op, [t for _, t, _ in args])
                    abstract = meaning(op, [a for _, _, a in args])
                except (ShapeError, PrismError):
                    self.prune("shape")
                    continue
                eclass = self.eclass(abstract)
                if eclass is None:
                    if self.config.expression_pruning:
                        self.prune("expression")
                        continue
                    eclass = abstract
                if self.stable and _unstable(node):
                    self.prune("unstable exp")
                    continue
                ops = len({m for m in node.walk() if m.op not in ("tile", "const")})
                atoms.append(Atom(op, tuple(c for c, _, _ in args), node, eclass, ops))
        self.atom_cache[key] = atoms
        return atoms

    def _operand_tuples(self, op: str, operands: list) -> Iterator[tuple]:
        """Operand tuples whose whole sizes fit the accumulator (pairs matched through an index)."""
        if op == "acc_sum":
            # A running sum keeps its operand's meaning only when each iteration's value is a partial
            # sum (the loop splits a contracted or summed dim).
            yield from ((o,) for o in operands if o[1].op in ("matmul", "sum"))
            return
        if OPS[op].operands == 1:
            yield from ((o,) for o in operands if o[1].rank >= 1 and not _one(o[1].shape[-1]))
            return
        by_rows: dict = {}
        for o in operands:
            if o[1].rank >= 2:
                by_rows.setdefault(o[1].shape[-2], []).append(o)
        for s in operands:
            if s[1].rank >= 2:
                for v in by_rows.get(s[1].shape[-1], ()):
                    if _fits(op, [s[1], v[1]]):
                        yield (s, v)

    def _close(self, steps, values, classes, depth, chosen, tiles, combo):
        """A loop kernel with these accumulators. Its post-loop work is extracted: the missing target
        outputs built from the accumulators alone (when this is the last step); otherwise it stores the
        accumulators themselves."""
        accumulated = [(a.node, a.eclass) for a in combo]
        used_tiles = {m for a in combo for m in a.node.walk() if m.op == "tile"}
        if len(used_tiles) < len(tiles):
            return  # a tile nothing reads: the same kernel with fewer inputs covers it
        if len(steps) + 1 == depth:
            goals = [w for w in dict.fromkeys(self.wanted) if w not in classes]
            if not goals or not all(isinstance(k, str) for _, k in accumulated):
                self.prune("no post-loop form")
                return
            outs = self.target.extract(goals, {k: n for n, k in accumulated})
            if outs is None:
                self.prune("no post-loop form")
                return
            if self.stable and any(_unstable(o) for o in outs):
                self.prune("unstable exp")
                return
            reached = {m for o in outs for m in o.walk()}
            if any(n not in reached for n, _ in accumulated):
                self.prune("unused accumulator")
                return
            if len(outs) > self.config.max_outputs:
                self.prune("limits")
                return
            new_classes = goals
        else:
            outs = [n for n, _ in accumulated]
            new_classes = [k for _, k in accumulated]
            if len(outs) > self.config.max_outputs or any(c in classes for c in new_classes) \
                    or not all(isinstance(c, str) for c in new_classes):
                self.prune("duplicate")
                return
        sketch = Sketch(tuple(chosen), tuple(tiles), tuple(outs), True)
        new_values = values + [meaning_of(sketch, o, values) for o in outs]
        yield from self._kernel_level(steps + [sketch], new_values, classes + new_classes, depth)

    def _no_loop(self, steps, values, classes, depth, chosen, tiles):
        """A kernel without a loop (the last step only): the missing outputs built from whole tiles."""
        if len(steps) + 1 != depth:
            return
        goals = [w for w in dict.fromkeys(self.wanted) if w not in classes]
        leaves = {classes[i]: t for i, t in zip(chosen, tiles)}
        self.stats.generated += 1
        outs = self.target.extract(goals, leaves)
        if outs is None:
            self.prune("no post-loop form")
            return
        if self.stable and any(_unstable(o) for o in outs):
            self.prune("unstable exp")
            return
        reached = {m for o in outs for m in o.walk()}
        if any(t not in reached for t in tiles):
            return  # the kernel with fewer inputs covers it
        sketch = Sketch(tuple(chosen), tuple(tiles), tuple(outs), False)
        new_values = values + [meaning_of(sketch, o, values) for o in outs]
        yield from self._kernel_level(steps + [sketch], new_values, classes + goals, depth)


def _unstable(node: Node) -> bool:
    """An exp of something not shifted by a max: it overflows where the max-shifted form does not."""
    for m in node.walk():
        if m.op == "exp":
            arg = m.args[0]
            if not (arg.op == "sub" and arg.args[1].op == "max"):
                return True
    return False


@dataclass(frozen=True)
class Atom:
    """One accumulator of a loop kernel: its op, operand e-classes, block node and abstract e-class."""

    op: str
    operands: tuple[str, ...]
    node: Node
    eclass: object
    ops: int  # block ops it takes (the accumulator and its loop values)


def _fits(op: str, operands: list[Node]) -> bool:
    """Whether the operands' whole sizes agree for the accumulator (numpy broadcasting): the cheap test
    that spares most shape errors (building the node checks again)."""
    if op == "acc_softmax_out":
        a, b = operands
        return a.rank >= 2 and b.rank >= 2 and a.shape[-1] == b.shape[-2] and _broadcasts(a.shape[:-2], b.shape[:-2])
    if op == "acc_rescaled_sum":
        return _broadcasts(operands[0].shape, operands[1].shape)
    return operands[0].rank >= 1 and (op == "acc_sum" or not _one(operands[0].shape[-1]))


def _broadcasts(a, b) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def _all_used(steps, outputs: tuple[int, ...], n_inputs: int) -> bool:
    """Every value a step computes is read by a later step or is an output."""
    used = set(outputs)
    for s in steps:
        used |= set(s.inputs if isinstance(s, Sketch) else s.args)
    produced = n_inputs
    for s in steps:
        count = len(s.outputs) if isinstance(s, Sketch) else 1
        if any(produced + i not in used for i in range(count)):
            return False
        produced += count
    return True


# -- level 2: maps ------------------------------------------------------------------------------------


class _Classes:
    """Union-find over (node, dim from the end): the dims of a kernel body that must be split alike."""

    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b) -> None:
        self.parent[self.find(a)] = self.find(b)


def index_classes(sketch: Sketch) -> tuple[_Classes, list]:
    """Group the body's splittable dims (size above 1) into classes; the classes in canonical order
    (first seen scanning the outputs' dims from the last, then the tiles')."""
    uf = _Classes()
    body = _body(sketch)

    def dim(n: Node, i: int):
        return (n, i) if -n.rank <= i and not _one(n.shape[i]) else None

    def tie(a, b) -> None:
        if a is not None and b is not None:
            uf.union(a, b)

    for n in body:
        kind = OPS[n.op].kind
        for i in range(-1, -n.rank - 1, -1):
            uf.find((n, i)) if dim(n, i) else None
        if kind in (Kind.UNARY, Kind.ROWWISE) or n.op == "acc_sum":
            for i in range(-1, -n.rank - 1, -1):
                tie(dim(n, i), dim(n.args[0], i))
        elif kind is Kind.BINARY or n.op == "acc_rescaled_sum":
            for a in n.args:
                for i in range(-1, -n.rank - 1, -1):
                    tie(dim(n, i), dim(a, i))
        elif kind is Kind.MATMUL or n.op == "acc_softmax_out":
            a, b = n.args
            tie(dim(n, -1), dim(b, -1))
            tie(dim(n, -2), dim(a, -2))
            tie(dim(a, -1), dim(b, -2))
            for i in range(-3, -n.rank - 1, -1):
                tie(dim(n, i), dim(a, i))
                tie(dim(n, i), dim(b, i))
        elif kind is Kind.REDUCE:
            reduced = n.attr - n.rank
            for i in range(-1, -n.rank - 1, -1):
                if i != reduced:
                    tie(dim(n, i), dim(n.args[0], i))
        elif kind is Kind.ACCUMULATE:  # the *_last accumulators keep every dim but the last
            for a in n.args:
                for i in range(-2, -n.rank - 1, -1):
                    tie(dim(n, i), dim(a, i))
    order: list = []
    for n in list(sketch.outputs) + list(sketch.tiles):
        for i in range(-1, -n.rank - 1, -1):
            if dim(n, i) is not None:
                root = uf.find((n, i))
                if root not in order:
                    order.append(root)
    return uf, order


def _one(size) -> bool:
    return sympy.sympify(size) == 1


def _body(sketch: Sketch) -> list[Node]:
    order: list[Node] = []
    seen: set[Node] = set()
    for s in sketch.outputs:
        for n in s.walk():
            if n not in seen:
                seen.add(n)
                order.append(n)
    return order


@dataclass(frozen=True)
class MapChoice:
    grid: tuple[int, ...]  # class index per grid axis x, y, z
    loop: int | None  # class index the loop walks


def map_choices(sketch: Sketch, config: SearchConfig) -> tuple[list[MapChoice], _Classes, list]:
    """Every canonical map choice: grid classes as a set in class order (no two orders of the same axes,
    no axis without a class), and a loop class when the kernel accumulates. A loop over a dim the kernel
    stores would fold different output elements together, so it is not offered."""
    uf, order = index_classes(sketch)
    stored = {uf.find((o, i)) for o in sketch.outputs for i in range(-1, -o.rank - 1, -1)
              if not _one(o.shape[i])}
    loops = [c for c, root in enumerate(order) if root not in stored] if sketch.loop else [None]
    out = []
    for k in range(0, min(config.max_grid_axes, len(order)) + 1):
        for grid in itertools.combinations(range(len(order)), k):
            for loop in loops:
                out.append(MapChoice(grid, loop))
    return out, uf, order


def build_kernel(sketch: Sketch, choice: MapChoice, uf: _Classes, order: list, name: str, suffix: str,
                 sources: list[Node], store_names: list[str]) -> tuple[Kernel, list[Node]] | str:
    """The concrete-map kernel for a choice, over `sources` (kernel-level nodes, one per tile); its output
    nodes. A string says why the choice is not a kernel."""
    by_class = {order[c]: a for c, a in zip(choice.grid, AXES)}
    loop_root = order[choice.loop] if choice.loop is not None else None
    return _build_kernel(sketch, uf, by_class, loop_root, name, suffix, sources, store_names)


def _build_kernel(sketch: Sketch, uf: _Classes, by_class: dict, loop_root, name: str, suffix: str,
                  sources: list[Node], store_names: list[str], split: bool = False) -> tuple[Kernel, list[Node]] | str:
    """`build_kernel` with the grid axis of each index class given (`by_class`: root -> axis). With
    `split`, one more grid axis splits the loop's class too (each block walks its piece with the loop)
    and every store gains a leading dim along that axis: the partial results of a split reduction."""
    axes = AXES[: len(by_class)]
    split_axis = AXES[len(axes)] if split else None
    all_axes = axes + ((split_axis,) if split else ())
    grid = tuple((a, dim_symbol(f"g{a}{suffix}")) for a in all_axes)
    if not grid:
        grid = (("x", sympy.Integer(1)),)
    loop = dim_symbol(f"F{suffix}") if sketch.loop else None
    shell = Kernel(name, grid, loop, (), (), ())

    def dims_of(n: Node, loop_ok: bool) -> tuple[DimMap, ...] | None:
        out, seen = [], set()
        for i in range(-n.rank, 0):
            if _one(n.shape[i]):
                out.append(DimMap())
                continue
            root = uf.find((n, i))
            if root in seen:
                return None  # two dims of one tensor in one class: no map splits them alike
            seen.add(root)
            looped = loop_ok and root == loop_root
            out.append(DimMap(by_class.get(root) or (split_axis if looped else None), looped))
        return tuple(out)

    loads, new = [], {}
    for j, (tile, src) in enumerate(zip(sketch.tiles, sources)):
        dims = dims_of(tile, True)
        if dims is None:
            return "a tensor with two dims that must be split alike"
        tmap = TileMap(dims)
        loads.append(Load(tile.attr, j, tmap))
        new[tile] = Node("tile", (), tile.attr, src.dtype, tile_shape(src.shape, tmap, shell))
    for n in _body(sketch):
        if n in new:
            continue
        if n.op == "const":
            new[n] = n
            continue
        params = [n.attr] if OPS[n.op].kind is Kind.REDUCE else []
        try:
            new[n] = build(n.op, [new[a] for a in n.args], params)
        except ShapeError as e:
            return f"shapes: {e}"
    stores = []
    for out, sname in zip(sketch.outputs, store_names):
        dims = dims_of(out, False)
        if dims is None:
            return "an output with two dims that must be split alike"
        if split:
            dims = (DimMap(split_axis),) + dims
        written = {d.axis for d in dims if d.axis}
        add = any(a not in written for a in all_axes)
        if split and add:
            return "a partial result summed across blocks"  # only plain stores are combined
        stores.append(Store(sname, new[out], TileMap(dims), add))
    kernel = Kernel(name, grid, loop, tuple(loads), tuple(stores), tuple(sources))
    return kernel, _outputs(kernel)


def _outputs(kernel: Kernel) -> list[Node]:
    return [Node("kernel", kernel.inputs, (kernel, i), s.value.dtype, output_shape(s.value.shape, s.map, kernel))
            for i, s in enumerate(kernel.stores)]


# -- level 2: split reductions --------------------------------------------------------------------------

# Per loop accumulator of a split reduction: the accumulator that combines its per-piece results in
# the second kernel, and the name its partial tensor gets. A kernel with any other accumulator (a mean
# or rms, whose pieces need their counts) is not split.
COMBINE = {"acc_softmax_out": ("acc_rescaled_sum", "out"), "acc_softmax_sum": ("acc_rescaled_sum", "sum"),
           "acc_max_last": ("acc_max_last", "max"), "acc_sum": ("acc_sum", "part")}


@dataclass(frozen=True)
class Split:
    """A loop kernel's map choice, split in two as FlashDecoding does: the first kernel gets one more grid
    axis, which also splits the loop's dim into pieces, and stores each accumulator's per-piece state (and
    the scores' running max, for the online-softmax ones) along a new leading dim; a combining kernel
    loops over the pieces (`acc_rescaled_sum` rescales each by exp(its max - the running max)) and does
    the post-loop work. It pays when the first kernel alone has too few blocks to fill the GPU."""

    choice: MapChoice


def split_states(sketch: Sketch) -> list[Node] | None:
    """What the first kernel of a split stores: the scores' running max first (online softmax), then each
    accumulator; None when the kernel cannot be split (an accumulator with no combining form, online
    softmax over different scores, or post-loop work that reads more than the accumulators)."""
    body = _body(sketch)
    accs = [n for n in body if OPS[n.op].kind is Kind.ACCUMULATE]
    if not sketch.loop or not accs or any(a.op not in COMBINE for a in accs):
        return None

    def only_accumulators(n: Node) -> bool:
        if n in accs or n.op == "const":
            return True
        if n.op == "tile" or OPS[n.op].kind is Kind.REDUCE:
            return False  # a reduce's dim index would move with the new leading dim
        return all(only_accumulators(a) for a in n.args)

    if not all(only_accumulators(o) for o in sketch.outputs):
        return None
    scores = list(dict.fromkeys(a.args[0] for a in accs if a.op in ("acc_softmax_out", "acc_softmax_sum")))
    if len(scores) > 1:
        return None
    states = list(accs)
    if scores:
        m = next((a for a in accs if a.op == "acc_max_last" and a.args[0] is scores[0]), None)
        if m is None:
            m = build("acc_max_last", [scores[0]])
        states = [m] + [a for a in accs if a is not m]
    return states


def build_split(sketch: Sketch, split: Split, uf: _Classes, order: list, names: tuple[str, str], suffix: str,
                sources: list[Node], store_names: list[str], part_names: list[str]) -> tuple[Kernel, Kernel, list[Node]] | str:
    """The two kernels of a split (see `Split`) and the combining kernel's output nodes, or why not."""
    choice = split.choice
    states = split_states(sketch)
    if states is None:
        return "no combining form"
    if choice.loop is None or choice.loop in choice.grid or len(choice.grid) >= len(AXES):
        return "no grid axis left to split the loop's dim"
    by_class = {order[c]: a for c, a in zip(choice.grid, AXES)}
    loop_root = order[choice.loop]
    # Classes over the original body and the states together (a new running max ties to its scores).
    whole = Sketch(sketch.inputs, sketch.tiles, tuple(sketch.outputs) + tuple(states), True)
    uf_all, _ = index_classes(whole)
    by_class_all = {uf_all.find(r): a for r, a in by_class.items()}
    partial = Sketch(sketch.inputs, sketch.tiles, tuple(states), True)
    built = _build_kernel(partial, uf_all, by_class_all, uf_all.find(loop_root), names[0], suffix, sources,
                          part_names, split=True)
    if isinstance(built, str):
        return built
    first, parts = built
    pieces = first.grid[-1][1]  # the split axis's size: the combining loop walks that many pieces
    axes = AXES[: len(by_class)]
    # The same grid as the first kernel's (less the split axis): each block combines the pieces of the
    # tile it would have computed unsplit, which is what the layout proof relates.
    grid = first.grid[: len(axes)] or (("x", sympy.Integer(1)),)
    shell = Kernel(names[1], grid, pieces, (), (), ())
    loads, tiles = [], {}
    for j, (state, part, store) in enumerate(zip(states, parts, first.stores)):
        tmap = TileMap((DimMap(None, True),) + store.map.dims[1:])
        name = f"{part_names[j].lower()}t"
        loads.append(Load(name, j, tmap))
        tiles[state] = Node("tile", (), name, part.dtype, tile_shape(part.shape, tmap, shell))
    m = tiles[states[0]] if states[0].op == "acc_max_last" and any(
        a.op in ("acc_softmax_out", "acc_softmax_sum") for a in states) else None
    new: dict[Node, Node] = {}
    try:
        for a in states:
            op = COMBINE[a.op][0]
            new[a] = build(op, [m, tiles[a]] if op == "acc_rescaled_sum" else [tiles[a]])
        for n in _body(sketch):
            if n not in new and OPS[n.op].kind is not Kind.ACCUMULATE and n.op != "tile" and any(
                    below in new for below in n.walk()):
                new[n] = build(n.op, [new.get(a, a) for a in n.args])
    except ShapeError as e:
        return f"shapes: {e}"
    stores = []
    for out, sname in zip(sketch.outputs, store_names):
        dims = []
        for i in range(-out.rank, 0):
            dims.append(DimMap() if _one(out.shape[i]) else DimMap(by_class.get(uf.find((out, i)))))
        written = {d.axis for d in dims if d.axis}
        if any(a not in written for a in axes):
            return "an output summed across blocks"
        stores.append(Store(sname, new[out], TileMap(tuple(dims)), False))
    second = Kernel(names[1], grid, pieces, tuple(loads), tuple(stores), tuple(parts))
    return first, second, _outputs(second)


# -- level 2: checks ----------------------------------------------------------------------------------


def small_binding(program: Program) -> dict[sympy.Symbol, int]:
    """Dims for the numeric filter: the defaults, capped (even sizes keep splits possible)."""
    out = {}
    for d in program.dims:
        v = min(d.default, NUMERIC_CAP)
        out[d.symbol] = v if v < 4 or d.default <= NUMERIC_CAP else v - v % 4
    return out


def smallest_tiles_fit(kernel: Kernel, dims: dict, target: Target) -> bool:
    """Shared memory with every split as fine as it can be (grid sizes and F at the sizes they split):
    if even that does not fit, no instantiation does."""
    biggest: dict[sympy.Symbol, int] = {}
    for load in kernel.loads:
        src = kernel.inputs[load.source]
        for size, dm in zip(src.shape, load.map.dims):
            full = value(size, dims)
            if full is None:
                continue  # a size set by another kernel's parameter (a split's number of pieces)
            for sym in ([kernel.size(dm.axis)] if dm.axis else []) + ([kernel.loop_range] if dm.loop else []):
                if isinstance(sym, sympy.Symbol) and sym not in dims:
                    biggest[sym] = min(biggest.get(sym, full), full)
    binding = {**dims, **biggest}
    for _, g in kernel.grid:
        for s in g.free_symbols:
            binding.setdefault(s, 1)
    for s in kernel.loop_range.free_symbols:
        binding.setdefault(s, 1)
    smem = value(shared_memory(kernel), binding)
    return smem is None or smem <= target.smem_per_block


class Level2:
    """Map instantiation and checks for level-1 candidates; proofs run in parallel egglog processes."""

    def __init__(self, program: Program, library: Library, target: Target, config: SearchConfig, stats: Stats,
                 jobs: int, limits: Limits = PROOF_LIMITS):
        self.program, self.library, self.target, self.config, self.stats = program, library, target, config, stats
        self.jobs = jobs
        self.small = small_binding(program)
        self.dims = program.default_binding()
        self.inputs = random_inputs(program, self.small, seed=1)
        self.seen_texts: set[str] = set()
        self.prover = Prover(program, library, jobs, limits)
        self.kernel_cache: dict = {}

    def close(self) -> None:
        self.prover.close()

    # -- per kernel ------------------------------------------------------------------------------------

    def kernel_options(self, cand: Candidate, sketch: Sketch) -> list[MapChoice]:
        """The map choices of one kernel that pass the static and numeric checks, in canonical order."""
        cache_key = (sketch, tuple(cand.abstracts[i] for i in sketch.inputs))
        if cache_key in self.kernel_cache:
            return self.kernel_cache[cache_key]
        choices, uf, order = map_choices(sketch, self.config)
        placeholders = [Node("input", (), f"in{j}", cand.abstracts[i].dtype, cand.abstracts[i].shape)
                        for j, i in enumerate(sketch.inputs)]
        env = self._values(cand)
        operands = {placeholders[j]: env[cand.abstracts[i]] for j, i in enumerate(sketch.inputs)}
        want = [env_of(meaning_of(sketch, s, cand.abstracts), env) for s in sketch.outputs]
        good = []
        for choice in choices:
            self.stats.maps += 1
            built = build_kernel(sketch, choice, uf, order, "k", "", placeholders,
                                 [f"o{i}" for i in range(len(sketch.outputs))])
            if isinstance(built, str):
                self.stats.pruned["maps"] += 1
                continue
            kernel, nodes = built
            if self._agrees([kernel], nodes, placeholders, operands, want):
                good.append(choice)
        # A grid whose axes are a subset of another valid grid's (same loop) is that grid with the
        # extra axes of size 1, which tuning may choose: only the maximal grids go on.
        maximal = [c for c in good if not any(o.loop == c.loop and set(c.grid) < set(o.grid) for o in good)]
        self.stats.pruned["subsumed grid"] += len(good) - len(maximal)
        states = split_states(sketch) if self.config.split_reductions else None
        if states is not None:
            # Every valid choice may be split (the split axis takes the place a subsuming grid's would).
            for choice in good:
                self.stats.maps += 1
                built = build_split(sketch, Split(choice), uf, order, ("p", "c"), "", placeholders,
                                    [f"o{i}" for i in range(len(sketch.outputs))],
                                    [f"s{j}" for j in range(len(states))])
                if isinstance(built, str):
                    self.stats.pruned["maps"] += 1
                elif self._agrees(list(built[:2]), built[2], placeholders, operands, want):
                    maximal.append(Split(choice))
        self.kernel_cache[cache_key] = maximal
        return maximal

    def _agrees(self, kernels: list[Kernel], nodes: list[Node], placeholders, operands, want) -> bool:
        """Whether kernels (the last computing `nodes`) fit shared memory at the smallest tiles and agree
        numerically with the abstract expression on small inputs, every split exercised."""
        if not all(smallest_tiles_fit(k, self.dims, self.target) for k in kernels):
            self.stats.pruned["shared memory"] += 1
            return False
        mini = Program("k", self.program.dims, tuple(placeholders), tuple((f"o{i}", n) for i, n in enumerate(nodes)))
        params: dict[str, int] = {}
        for k in kernels:
            bound = {**self.small, **{dim_symbol(n): v for n, v in params.items()}}
            params.update({n: v for n, v in _split_params(k, bound).items() if n not in params})
        try:
            got = evaluate(mini, {p.attr: operands[p] for p in placeholders}, params=params)
        except (PrismError, ShapeError, ValueError, IndexError):
            self.stats.pruned["maps"] += 1
            return False
        if all(_close(got[f"o{i}"], w) for i, w in enumerate(want)):
            return True
        self.stats.pruned["numeric"] += 1
        return False

    def _values(self, cand: Candidate) -> dict[Node, np.ndarray]:
        env = {n: np.asarray(self.inputs[n.attr], dtype=np.float64) for n in self.program.inputs}
        return evaluate_nodes(list(cand.abstracts), env)

    # -- whole programs --------------------------------------------------------------------------------

    def programs(self, cand: Candidate) -> Iterator[Program]:
        """Each combination of surviving kernel maps as a checked program (printed and parsed back)."""
        options = []
        for step in cand.steps:
            if isinstance(step, Sketch):
                opts = self.kernel_options(cand, step)
                if not opts:
                    return
                options.append(opts)
            else:
                options.append([None])
        for combo in itertools.islice(itertools.product(*options), MAX_COMBINATIONS):
            prog = self.assemble(cand, combo)
            if prog is not None:
                yield prog

    def assemble(self, cand: Candidate, combo) -> Program | None:
        from ..lang.check import load

        names = {cand.outputs[i]: name for i, (name, _) in enumerate(self.program.outputs)}
        nodes: list[Node] = list(self.program.inputs)
        customs = 0
        for step, choice in zip(cand.steps, combo):
            base = len(nodes)
            if isinstance(step, Predefined):
                n = step.op
                params = [n.attr] if OPS[n.op].kind is Kind.REDUCE else []
                nodes.append(build(n.op, [nodes[a] for a in step.args], params))
                continue
            customs += 1
            uf, order = index_classes(step)
            store_names = [names.get(base + i, f"t{base + i}") for i in range(len(step.outputs))]
            name = f"fused{customs}" if len(cand.steps) > 1 else "fused"
            suffix = "" if customs == 1 else str(customs)
            sources = [nodes[i] for i in step.inputs]
            if isinstance(choice, Split):
                kinds = [COMBINE[a.op][1] for a in split_states(step)]
                parts = [f"t{base}_{k}" + (str(kinds[:j].count(k)) if kinds.count(k) > 1 else "")
                         for j, k in enumerate(kinds)]
                built = build_split(step, choice, uf, order, (f"{name}_partial", f"{name}_combine"), suffix,
                                    sources, store_names, parts)
            else:
                built = build_kernel(step, choice, uf, order, name, suffix, sources, store_names)
            if isinstance(built, str):
                return None
            nodes += built[-1]
        outs = tuple((name, nodes[cand.outputs[i]]) for i, (name, _) in enumerate(self.program.outputs))
        for (name, node), (_, want) in zip(outs, self.program.outputs):
            if not same_shape(node.shape, want.shape):
                self.stats.pruned["shape"] += 1
                return None
        names_map = {nodes[i]: f"t{i}" for i in range(len(self.program.inputs), len(nodes)) if i not in names}
        prog = Program(self.program.name, self.program.dims, self.program.inputs, outs, {}, names_map, self.program.loc)
        text = print_program(prog)
        if text in self.seen_texts:
            self.stats.pruned["duplicate"] += 1
            return None
        self.seen_texts.add(text)
        try:
            return load("<candidate>", text).program()
        except PrismError:
            self.stats.pruned["checker"] += 1
            return None

    def prove(self, candidate: Program) -> Future:
        self.stats.proofs += 1
        return self.prover.submit(candidate)


class Prover:
    """Proofs that candidates equal one program, in a pool of egglog sessions (one per thread, each
    loaded with the library once). A future's result is True only for a proof of every output; a
    candidate that cannot even be written as terms next to the program (other outputs) is not proved.
    Used by the search, and by `superopt` to prove again what it takes from the checkpoint."""

    def __init__(self, program: Program, library: Library, jobs: int, limits: Limits = PROOF_LIMITS):
        self.program, self.library, self.limits = program, library, limits
        self.pool = ThreadPoolExecutor(max_workers=jobs)
        self.local = threading.local()
        self.sessions: list[egglog_runner.Session] = []
        self.lock = threading.Lock()
        self.closed = False
        self.egglog_program, _ = compile_library(library)
        self.pairs = pair_outputs(program, program)

    def submit(self, candidate: Program) -> Future:
        return self.pool.submit(self._prove, candidate)

    def warm(self, sessions: int = 1) -> None:
        """Start sessions now (starting one takes most of a second), so that they load while the caller
        works: each proves the program equal to itself."""
        for _ in range(sessions):
            self.submit(self.program)

    def close(self) -> None:
        """Stop: queued proofs are dropped, and every session's process is ended (one still starting
        or proving ends when its proof returns), without waiting for proofs in flight."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            self.closed = True
            for s in self.sessions:
                s.close()

    def _prove(self, candidate: Program) -> bool:
        if sorted(n for n, _ in candidate.outputs) != sorted(n for n, _ in self.program.outputs):
            return False
        session = getattr(self.local, "session", None)
        if session is None:
            session = egglog_runner.Session(self.egglog_program)
            with self.lock:
                if self.closed:
                    return False
                self.sessions.append(session)
            self.local.session = session
        setup, goals = _terms(to_terms(candidate), to_terms(self.program), self.pairs)
        try:
            outcome = session.run(setup, goals, schedule(list(self.library.rulesets)), self.limits)
        finally:
            with self.lock:
                if self.closed:
                    session.close()
        return all(outcome.proved)


def _split_params(kernel: Kernel, dims: dict) -> dict[str, int]:
    """Grid sizes and loop range for the numeric filter: 2 wherever that divides what they split (so
    every split and the loop are exercised), else 1."""
    out = {}
    syms = [g for _, g in kernel.grid if isinstance(g, sympy.Symbol)]
    if isinstance(kernel.loop, sympy.Symbol):
        syms.append(kernel.loop)
    for sym in syms:
        chosen = 2
        for load in kernel.loads:
            src = kernel.inputs[load.source]
            for size, dm in zip(src.shape, load.map.dims):
                splitters = ([kernel.size(dm.axis)] if dm.axis else []) + ([kernel.loop_range] if dm.loop else [])
                if sym in splitters:
                    full = value(size, dims)
                    if full is None or full % (2 ** len(splitters)):
                        chosen = 1
        out[sym.name] = chosen
    return out


def meaning_of(sketch: Sketch, out: Node, abstracts) -> Node:
    """The abstract expression of a kernel output, over the kernel-level values' abstract expressions."""
    memo: dict[Node, Node] = {}
    for tile, i in zip(sketch.tiles, sketch.inputs):
        memo[tile] = abstracts[i]
    for n in out.walk():
        if n in memo:
            continue
        args = [memo[a] for a in n.args]
        if OPS[n.op].kind is Kind.ACCUMULATE:
            memo[n] = meaning(n.op, args)
        else:
            memo[n] = n if n.op == "const" else build(n.op, args, [n.attr] if OPS[n.op].kind is Kind.REDUCE else [])
    return memo[out]


def env_of(node: Node, env: dict[Node, np.ndarray]) -> np.ndarray:
    return evaluate_nodes([node], env)[node]


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape:
        return False
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        return False
    scale = max(float(np.abs(want).max()), 1e-30)
    return float(np.abs(got - want).max()) / scale <= NUMERIC_RTOL


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


# -- the driver ---------------------------------------------------------------------------------------


@dataclass
class Result:
    verified: list[Program]  # in the order found (deterministic for the same inputs when not cut short)
    stats: Stats
    seconds: float
    complete: bool  # False: stopped by the time limit or an interruption
    stopped: str | None = None  # why it stopped early
    target_egraph: dict = field(default_factory=dict)
    jobs: int = 1


def search(program: Program, library: Library, target: Target, config: SearchConfig = SearchConfig(), *,
           jobs: int | None = None, deadline: float | None = None, progress: Callable[[str, Stats], None] | None = None,
           stop_event: threading.Event | None = None) -> Result:
    """Levels 1 and 2 for `program`: every verified program found within the limits (see the module doc)."""
    started = time.perf_counter()
    jobs = jobs or default_jobs()
    stats = Stats()
    stop_event = stop_event or threading.Event()
    reason: list[str] = []

    def should_stop() -> bool:
        if stop_event.is_set():
            reason[:] = reason or ["interrupted"]
            return True
        if deadline is not None and time.perf_counter() > deadline:
            reason[:] = reason or ["time limit"]
            return True
        return False

    graph = saturate(program, library)
    gen = Generator(program, graph, config, stats, should_stop)
    level2 = Level2(program, library, target, config, stats, jobs)
    pending: list[tuple[Program, Future]] = []
    verified: list[Program] = []
    complete = True

    def collect(block: bool) -> None:
        while pending and (block or pending[0][1].done()):
            prog, fut = pending.pop(0)
            try:
                ok = fut.result(timeout=None if block else 0)
            except Exception:  # a killed or failed proof is not a proof
                ok = False
            if ok:
                stats.verified += 1
                verified.append(prog)
            else:
                stats.pruned["unproved"] += 1

    try:
        if progress:
            progress("level 1", stats)
        for cand in gen.candidates():
            for prog in level2.programs(cand):
                pending.append((prog, level2.prove(prog)))
                if should_stop():
                    raise Stop
            collect(block=False)
            if progress:
                progress("search", stats)
        if progress:
            progress("proving", stats)
        while pending:
            if should_stop():
                raise Stop
            try:
                pending[0][1].result(timeout=0.2)
            except Exception:
                pass
            collect(block=False)
            if progress:
                progress("proving", stats)
    except (Stop, KeyboardInterrupt) as e:
        complete = False
        if isinstance(e, KeyboardInterrupt):
            reason[:] = reason or ["interrupted"]
        # Keep what is already proved; what is still in flight is dropped.
        for prog, fut in pending:
            if fut.done():
                try:
                    if fut.result():
                        stats.verified += 1
                        verified.append(prog)
                except Exception:
                    pass
        pending.clear()
    finally:
        level2.close()
    return Result(verified, stats, time.perf_counter() - started, complete, reason[0] if reason else None,
                  {"rows": graph.nodes, "stopped": graph.reason, "seconds": round(graph.seconds, 3)}, jobs)
