"""Kernel generation, the search's first phase: candidate programs of custom kernels whose maps, grid
sizes and loop ranges are still symbols.

`Generator` goes depth first over prefix programs, one kernel at a time, fewer kernels first. A step
is a custom kernel or a pre-defined kernel for one of the input program's own ops; a candidate is
complete when every output of the input program is computed and every step's result is read. A custom
kernel loads some of the tensors computed so far (tiles at their whole sizes) and is one of:
- a loop kernel: a set of loop accumulators, each over loop values of its tiles. The loop values (at
  most `loop_ops` ops) and the work after the loop are not enumerated op by op: they are extracted
  from the input program's saturated e-graph (`InputGraph.extract`), the cheapest terms over the tiles
  and over the accumulators. What is enumerated is the accumulators (op and operand e-classes), in one
  canonical order (combinations, so no permutation is generated twice);
- a kernel without a loop: the missing outputs extracted over whole tiles (the last step only).
What is dropped is counted by its `Rejection`. The main prune is expression-guided: an accumulator's
abstract expression (`abstract`) must be in the saturated e-graph. `acc_sum` folds partial sums only (a
matmul or a sum), so its meaning survives the loop; accumulators that no output can reach through
element-wise ops are dropped before any combination is tried.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import sympy

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import Node, Program
from ..ir.ops import OPS, Kind
from ..ir.shapes import ShapeError, build, rebuild
from ..semantics.reference import evaluate_nodes, random_inputs
from .abstract import InputGraph
from .config import Rejection, SearchConfig, Stats, Stop
from .reach import chain, loop_ops

ELEMENTWISE = (Kind.UNARY, Kind.BINARY, Kind.CONST, Kind.INPUT, Kind.TILE)  # what reads a tile loaded again (`_read_again`)
NUMERIC_CAP = 16  # dims are capped at this size for the numeric checks of the search


@dataclass(frozen=True)
class Sketch:
    """A generated custom kernel: body ops over whole-size tiles of kernel-level values."""

    inputs: tuple[int, ...]  # indices of the kernel-level values it loads, in load order
    tiles: tuple[Node, ...]  # the tile nodes (whole sizes), one per input
    outputs: tuple[Node, ...]  # the block values it stores
    loop: bool  # it has accumulators, hence a loop


@dataclass(frozen=True)
class Predefined:
    """A pre-defined kernel computing one op of the input program on kernel-level values."""

    op: Node  # the input program's node (its op and attr are reused)
    args: tuple[int, ...]


@dataclass(frozen=True)
class Candidate:
    """A complete generated program: steps in order; each output of the input program is some step's value."""

    steps: tuple[Sketch | Predefined, ...]
    outputs: tuple[int, ...]  # per output of the input program, the kernel-level value that holds it
    abstracts: tuple[Node, ...]  # the abstract expression of every kernel-level value


@dataclass(frozen=True)
class Atom:
    """One accumulator of a loop kernel: its op, operand e-classes, block node and abstract e-class."""

    op: str
    operands: tuple[str, ...]
    node: Node
    eclass: object
    nodes: frozenset  # the block ops it takes (the accumulator and its loop values, which others may share)


class Generator:
    """Kernel generation: enumerates complete candidates (see the module doc), counting what it prunes."""

    def __init__(self, program: Program, graph: InputGraph, config: SearchConfig, stats: Stats,
                 should_stop: Callable[[], bool] = lambda: False):
        self.program, self.graph, self.config, self.stats = program, graph, config, stats
        self.should_stop = should_stop
        self.atom_cache: dict = {}
        self.stable = asks_stable(program)
        self.memo: dict[Node, str | None] = {}
        self.wanted = [graph.outputs[name] for name, _ in program.outputs]
        self.seen: set = set()
        # the input program's own ops, for pre-defined kernels: e-class of the node -> node
        self.input_ops = {}
        for n in program.nodes():
            if n.op not in ("input", "const"):
                self.input_ops.setdefault(graph.lookup(n, self.memo), n)
        # the e-classes of the input program's values that another of its ops reads (not its inputs)
        read = {graph.lookup(a, self.memo) for n in self.input_ops.values() for a in n.args}
        self.intermediate = [c for c in self.input_ops if c in read and c is not None]
        # The values of linear accumulators on small random inputs, to drop pairs that are one scaled
        inputs = random_inputs(program, small_binding(program), seed=1)
        self.env = {n: inputs[n.attr] for n in program.inputs}
        self.samples: dict = {}
        self.dependent: dict = {}
        self.stored: dict = {}  # (prefix, tiles, intermediate, depth: each extends them anew) -> accumulator sets
        self.loop_ops = loop_ops(program)

    def eclass(self, abstract: Node) -> str | None:
        return self.graph.lookup(abstract, self.memo)

    def candidates(self) -> Iterator[Candidate]:
        """Complete programs with fewer steps first (iterative deepening), each once; a pre-defined kernel may
        take an element-wise step of its own (`_epilogue`)."""
        inputs = list(self.program.inputs)
        classes = [self.eclass(n) for n in inputs]
        deepest = self.config.max_kernels + 2 * self.config.max_predefined + max(0, chain(self.program) - 2)
        for depth in range(1, deepest + 1):
            yield from self._kernel_level([], inputs, classes, depth)

    # -- kernel level ----------------------------------------------------------------------------------

    def _missing(self, classes: list) -> list:
        """The e-classes of the input program's outputs that no value computes yet, each once."""
        return [w for w in dict.fromkeys(self.wanted) if w not in classes]

    def _kernel_level(self, steps: list, values: list[Node], classes: list, depth: int) -> Iterator[Candidate]:
        if self.should_stop():
            raise Stop
        if all(w in classes for w in self.wanted):
            done = tuple(classes.index(w) for w in self.wanted)
            if len(steps) == depth:
                key = (tuple(steps), done)
                if not _all_used(steps, done, len(self.program.inputs)):
                    self.stats.prune(Rejection.UNUSED_OUTPUT)
                elif key in self.seen:
                    self.stats.prune(Rejection.DUPLICATE)
                else:
                    self.seen.add(key)
                    self.stats.candidates += 1
                    yield Candidate(tuple(steps), done, tuple(values))
            return
        if len(steps) >= depth:
            return
        customs = sum(isinstance(s, Sketch) for s in steps)
        full = _predefined_kernels(steps, len(self.program.inputs)) >= self.config.max_predefined
        for n in self.input_ops.values():
            args = [classes.index(c) if (c := self.eclass(a)) in classes else None for a in n.args]
            if None in args or self.eclass(n) in classes or any(a.op == "const" for a in n.args):
                continue
            if full and not _epilogue(steps[-1] if steps else None, n, args, len(values) - 1):
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

    def _step(self, steps, values, classes, depth, sketch: Sketch, new_classes: list) -> Iterator[Candidate]:
        """Go on from the prefix with one more custom kernel."""
        new_values = values + [meaning_of(sketch, o, values) for o in sketch.outputs]
        yield from self._kernel_level(steps + [sketch], new_values, classes + new_classes, depth)

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
            # under the missing outputs through element-wise ops (or a product by one of its tiles) can be.
            under = self.graph.below(self._missing(classes), frozenset(leaves))
            useful = [a for a in atoms if a.eclass in under]
            self.stats.prune(Rejection.UNUSED_ACCUMULATOR, len(atoms) - len(useful))
            atoms = wide = useful
        else:
            # More accumulators than a kernel stores: only an intermediate value built from them all can
            # be stored, so each must be under one through element-wise ops.
            under = self.graph.below([c for c in self.intermediate if c not in classes], frozenset(leaves))
            wide = [a for a in atoms if a.eclass in under]
        for k in range(1, min(self.config.max_accumulators, self.config.max_block_ops) + 1):
            for combo in self._combinations(atoms if k <= self.config.max_outputs else wide, k, (), 0):
                yield from self._close(steps, values, classes, depth, chosen, tiles, combo)

    def _combinations(self, pool: list[Atom], k: int, chosen: tuple, start: int) -> Iterator[tuple]:
        """The k-combinations of `pool` in the order of `itertools.combinations`, less those with two
        accumulators of one e-class or one linear kind over proportional values, or over the block op
        limit: each is cut where its first such pair (or the op that breaks the limit) is added, so the
        combinations that contain it are never built."""
        if len(chosen) == k:
            yield chosen
            return
        taken = frozenset().union(*(a.nodes for a in chosen))
        for i in range(start, len(pool) - (k - len(chosen)) + 1):
            if self.should_stop():
                raise Stop
            self.stats.generated += 1
            atom = pool[i]
            if any(a.eclass == atom.eclass or self._dependent(a, atom) for a in chosen):
                self.stats.prune(Rejection.DUPLICATE)
            elif len(taken | atom.nodes) > self.config.max_block_ops:
                self.stats.prune(Rejection.LIMITS)
            else:
                yield from self._combinations(pool, k, chosen + (atom,), i + 1)

    def _covered(self, done: tuple[Atom, ...], combo: tuple[Atom, ...]) -> bool:
        """Whether each accumulator of `done` is in `combo`, or one there is a scaled form of it."""
        return all(any(a.eclass == b.eclass or self._dependent(a, b) for b in combo) for a in done)

    def _dependent(self, a: Atom, b: Atom) -> bool:
        """Two accumulators of one linear kind whose values are proportional (a product and its
        negation, or twice it): one of them, scaled after the loop, is the other, so the pair only
        makes another proof of a kernel found with fewer accumulators."""
        if a.op != b.op or not ACCUMULATORS[a.op].linear:
            return False
        key = (a.eclass, b.eclass)
        if key not in self.dependent:
            self.dependent[key] = _redundant(self.samples[a.eclass], self.samples[b.eclass]) \
                or _redundant(self.samples[b.eclass], self.samples[a.eclass])
        return self.dependent[key]

    def _atoms(self, leaves: dict) -> list[Atom]:
        """The accumulators a loop kernel over these tiles may hold: each accumulator applied to loop
        values (small terms over the tiles, extracted from the e-graph), kept when its abstract
        expression is in the input's saturated e-graph (expression-guided pruning)."""
        key = tuple(sorted((c, t) for c, (t, _) in leaves.items()))
        if key in self.atom_cache:
            return self.atom_cache[key]
        block_terms = self.graph.terms_from({c: t for c, (t, _) in leaves.items()}, self.loop_ops)
        abstract_terms = self.graph.terms_from({c: v for c, (_, v) in leaves.items()}, self.loop_ops)
        operands = [(c, t, abstract_terms[c]) for c, t in block_terms.items() if c in abstract_terms]
        atoms = []
        for op, acc in ACCUMULATORS.items():  # those only a split's combining kernel uses are not generated
            if self.config.ops is not None and op not in self.config.ops or acc.combining_only:
                continue
            for args in self._operand_tuples(op, operands):
                self.stats.generated += 1
                try:
                    node = build(op, [t for _, t, _ in args])
                    abstract = acc.closed(build, *[a for _, _, a in args])
                except ShapeError:
                    self.stats.prune(Rejection.SHAPE)
                    continue
                eclass = self.eclass(abstract)
                if eclass is None:
                    if self.config.expression_pruning:
                        self.stats.prune(Rejection.EXPRESSION)
                        continue
                    eclass = abstract
                if self.stable and _unstable(node):
                    self.stats.prune(Rejection.UNSTABLE_EXP)
                    continue
                nodes = frozenset(m for m in node.walk() if m.op not in ("tile", "const"))
                if acc.linear and eclass not in self.samples:
                    self.samples[eclass] = evaluate_nodes([abstract], self.env)[abstract]
                atoms.append(Atom(op, tuple(c for c, _, _ in args), node, eclass, nodes))
        self.atom_cache[key] = atoms
        return atoms

    def _operand_tuples(self, op: str, operands: list) -> Iterator[tuple]:
        """Operand tuples whose whole sizes fit the accumulator (pairs matched through an index)."""
        if ACCUMULATORS[op].operand_ops:  # e.g. a running sum of partial sums only (see the table)
            yield from ((o,) for o in operands if o[1].op in ACCUMULATORS[op].operand_ops)
            return
        if OPS[op].operands == 1:
            yield from ((o,) for o in operands if o[1].rank >= 1 and o[1].shape[-1] != 1)
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

    def _post_loop(self, goals: list, leaves: dict[str, Node]) -> list[Node] | Rejection:
        """The goals' terms over `leaves` (e-class -> block node), the cheapest the e-graph holds; or why there are
        none."""
        outs = self.graph.extract(goals, leaves)
        if outs is None:
            return Rejection.NO_POST_LOOP_FORM
        return Rejection.UNSTABLE_EXP if self.stable and any(_unstable(o) for o in outs) else outs

    def _close(self, steps, values, classes, depth, chosen, tiles, combo):
        """A loop kernel with these accumulators. Its post-loop work is extracted: the missing outputs
        built from the accumulators alone (when this is the last step); otherwise it stores the
        accumulators themselves."""
        accumulated = [(a.node, a.eclass) for a in combo]
        used_tiles = {m for a in combo for m in a.node.walk() if m.op == "tile"}
        after = [(t, classes[i]) for i, t in zip(chosen, tiles) if t not in used_tiles]  # read after the loop
        if len(steps) + 1 == depth:
            if not all(isinstance(k, str) for _, k in accumulated):
                self.stats.prune(Rejection.NO_POST_LOOP_FORM)
                return
            new_classes = self._missing(classes)
            outs = self._post_loop(new_classes, {k: n for n, k in after + accumulated})
            if outs is Rejection.NO_POST_LOOP_FORM:
                outs, chosen, tiles = self._read_again(new_classes, classes, chosen, tiles, used_tiles, after + accumulated)
            if isinstance(outs, Rejection):
                self.stats.prune(outs)
                return
            reached = {m for o in outs for m in o.walk()}
            if any(n not in reached for n, _ in after + accumulated):
                self.stats.prune(Rejection.UNUSED_ACCUMULATOR)
                return
            if len(outs) > self.config.max_outputs:
                self.stats.prune(Rejection.LIMITS)
                return
        else:
            yield from self._intermediates(steps, values, classes, depth, chosen, tiles, after, combo)
            if after:
                return  # a tile nothing reads: the same kernel with fewer inputs covers it
            outs = [n for n, _ in accumulated]
            new_classes = [k for _, k in accumulated]
            if len(outs) > self.config.max_outputs or any(c in classes for c in new_classes) \
                    or not all(isinstance(c, str) for c in new_classes):
                self.stats.prune(Rejection.DUPLICATE)
                return
        sketch = Sketch(tuple(chosen), tuple(tiles), tuple(outs), True)
        yield from self._step(steps, values, classes, depth, sketch, new_classes)

    def _read_again(self, goals, classes, chosen, tiles, used_tiles, known):
        """The last kernel's outputs (or why none) where they need a tensor its loop walks after it too, loaded again
        as the block's own tile, read by element-wise work only (a product would have each block redo the loop's):
        `rms_norm(X) @ W + rms_norm(X)` reads the block's columns of X after the loop over the accumulated norm.
        With the kernel's inputs and tiles, those loaded again added."""
        taken, again = {t.attr for t in tiles}, []
        for i, t in ((i, t) for i, t in zip(chosen, tiles) if t in used_tiles):
            name = t.attr + "_"
            while name in taken:
                name += "_"
            taken.add(name)
            again.append((i, Node("tile", (), name, t.dtype, t.shape)))
        outs = self._post_loop(goals, {**{classes[i]: t for i, t in again}, **{k: n for n, k in known}}) if again \
            else Rejection.NO_POST_LOOP_FORM
        if isinstance(outs, Rejection):
            return outs, chosen, tiles
        reached = {m for o in outs for m in o.walk()}
        if any(t in m.walk() for m in reached if OPS[m.op].kind not in ELEMENTWISE for _, t in again):
            return Rejection.NO_POST_LOOP_FORM, chosen, tiles
        return outs, (*chosen, *(i for i, t in again if t in reached)), (*tiles, *(t for _, t in again if t in reached))

    def _intermediates(self, steps, values, classes, depth, chosen, tiles, after, combo):
        """A loop kernel before the last step that stores one of the input program's intermediate values
        (what another of its ops reads), built after the loop from every accumulator by element-wise
        ops: LayerNorm's normalisation and GELU applied to the projection's block before the next
        projection reads it. (Row-wise work after the loop, a softmax, is left to the kernel that
        reads the value: as an intermediate it needs whole rows in a block, and a pre-defined kernel
        does the same.)"""
        accumulated = [(a.node, a.eclass) for a in combo]
        if not all(isinstance(k, str) for _, k in accumulated):
            return
        leaves = {k: n for n, k in after + accumulated}
        for goal in self.intermediate:
            if goal in classes or goal in leaves:
                continue
            # Not when accumulators that these hold, or scaled forms of them, store it already (a
            # product and its negation added up, or a product of the negated tiles): the same value, a
            # new proof each for nothing.
            key = (tuple(steps), chosen, goal, depth)
            if any(self._covered(done, combo) for done in self.stored.get(key, ())):
                continue
            out = self.graph.extract_elementwise(goal, leaves)
            if out is None:
                continue
            reached = set(out.walk())
            if any(n not in reached for n in leaves.values()):
                self.stats.prune(Rejection.UNUSED_ACCUMULATOR)
                continue
            self.stored.setdefault(key, []).append(combo)
            sketch = Sketch(tuple(chosen), tuple(tiles), (out,), True)
            yield from self._step(steps, values, classes, depth, sketch, [goal])

    def _no_loop(self, steps, values, classes, depth, chosen, tiles):
        """A kernel without a loop: at the last step the missing outputs built from whole tiles; before it, each
        intermediate value of the input program so built from every tile, which a step after it reads (an MLP whose
        down-projection's contraction the grid splits, summed across blocks, then its residual added)."""
        leaves, last = {classes[i]: t for i, t in zip(chosen, tiles)}, len(steps) + 1 == depth
        for goals in [self._missing(classes)] if last else [[g] for g in self.intermediate if g not in classes]:
            self.stats.generated += 1
            found = self._post_loop(goals, leaves)
            if isinstance(found, Rejection):
                if last:  # (an intermediate is one of many tried)
                    self.stats.prune(found)
            elif not set(tiles) - {m for o in found for m in o.walk()}:  # (else: the kernel with fewer inputs)
                yield from self._step(steps, values, classes, depth, Sketch(tuple(chosen), tuple(tiles), tuple(found),
                                                                            False), goals)


def small_binding(program: Program) -> dict[sympy.Symbol, int]:
    """Dims for the search's numeric checks: the defaults, capped (even sizes keep splits possible)."""
    out = {}
    for d in program.dims:
        v = min(d.default, NUMERIC_CAP)
        out[d.symbol] = v if v < 4 or d.default <= NUMERIC_CAP else v - v % 4
    return out


def _redundant(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether b is a constant times a (or a is zero): one accumulator of the pair gives the other. Values
    of one element are always proportional, so they never count (a single row's mean and mean square)."""
    if a.shape != b.shape or a.size < 2 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return False
    a, b = a.ravel(), b.ravel()
    norm = float(a @ a)
    if norm == 0.0:
        return True
    rest = b - (float(a @ b) / norm) * a
    return float(np.abs(rest).max()) <= 1e-9 * max(float(np.abs(b).max()), 1e-30)


def asks_stable(program: Program) -> bool:
    """Whether the search may offer only the stable form (no exp of an unshifted value, which overflows where the
    input did not): for a program written with softmax, or whose every exp is of a max-shifted value (a softmax
    written out, which `exp_sub` would otherwise turn back into a bare exp and a quotient)."""
    exps = [n for n in program.nodes() if n.op == "exp"]
    return any(n.op == "softmax" for n in program.nodes()) or bool(exps) and not any(map(_unstable, exps))


def _unstable(node: Node) -> bool:
    """An exp of something not shifted by a max: it overflows where the max-shifted form does not."""
    return any(m.op == "exp" and not (m.args[0].op == "sub" and m.args[0].args[1].op == "max") for m in node.walk())


def _fits(op: str, operands: list[Node]) -> bool:
    """Whether the operands' whole sizes agree for the accumulator (numpy broadcasting): the cheap test
    that spares most shape errors (building the node checks again)."""
    acc = ACCUMULATORS[op]
    if acc.like == "matmul":
        a, b = operands
        return a.rank >= 2 and b.rank >= 2 and a.shape[-1] == b.shape[-2] and _broadcasts(a.shape[:-2], b.shape[:-2])
    if acc.like == "binary":
        return _broadcasts(operands[0].shape, operands[1].shape)
    return operands[0].rank >= 1 and (not acc.row or operands[0].shape[-1] != 1)


def _epilogue(before, op: Node, args, last: int) -> bool:
    """Whether a pre-defined step for `op` on the values `args` runs in the kernel of the pre-defined step `before`
    it (a residual added as a projection stores): an element-wise op reading that step's value (`last`)."""
    return isinstance(before, Predefined) and OPS[op.op].kind in (Kind.UNARY, Kind.BINARY) and last in args


def _predefined_kernels(steps: list, made: int) -> int:
    """The pre-defined kernels `steps` launch (after `made` input values): not counting epilogues (`_epilogue`)."""
    count = 0
    for i, s in enumerate(steps):
        count += isinstance(s, Predefined) and not _epilogue(steps[i - 1] if i else None, s.op, s.args, made - 1)
        made += len(s.outputs) if isinstance(s, Sketch) else 1
    return count


def _broadcasts(a, b) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def _all_used(steps, outputs: tuple[int, ...], n_inputs: int) -> bool:
    """Every value a step computes is read by a later step or is an output."""
    used = set(outputs).union(*(s.inputs if isinstance(s, Sketch) else s.args for s in steps))
    made = n_inputs + sum(len(s.outputs) if isinstance(s, Sketch) else 1 for s in steps)
    return all(i in used for i in range(n_inputs, made))


def body_nodes(sketch: Sketch) -> list[Node]:
    """Every node under the kernel's outputs, operands first, each once."""
    return list(dict.fromkeys(n for s in sketch.outputs for n in s.walk()))


def meaning_of(sketch: Sketch, out: Node, abstracts) -> Node:
    """The abstract expression of a kernel output, over the kernel-level values' abstract expressions."""
    memo: dict[Node, Node] = {tile: abstracts[i] for tile, i in zip(sketch.tiles, sketch.inputs)}
    for n in out.walk():
        if n in memo:
            continue
        args = [memo[a] for a in n.args]
        if OPS[n.op].kind is Kind.ACCUMULATE:
            memo[n] = ACCUMULATORS[n.op].closed(build, *args)
        else:
            memo[n] = n if n.op == "const" else rebuild(n, args)
    return memo[out]
