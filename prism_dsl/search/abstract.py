"""Abstract expressions and the input program's saturated e-graph: the search's expression-guided pruning.

The *abstract expression* of a value in a candidate kernel is what the value would be if the kernel ran
as one block with one loop iteration: a tile is the whole tensor it is loaded from, a body op is the same
op on whole tensors, and an accumulator is what it computes over a whole dim (`acc_sum(a)` is `a`,
`acc_rms_last(a)` is `sqrt(mean(square(a), -1))`, `acc_softmax_out(s, v)` is `exp(s - max(s, -1)) @ v`).
The layout is forgotten; the algebra is kept.

`InputGraph` saturates the input program's outputs once with the library's non-layout rulesets
(definitions, algebra, subexpression: all in rules/) under limits, and keeps the e-graph's tensor e-nodes
as a table. A candidate op survives only when its abstract expression is already in that e-graph (a hash
lookup per op, e-class by e-class, bottom up: what egg's `lookup_expr` does). Every value of a program
equal to the input program under the axioms is, by construction, a sub-term of a term in that e-class,
so the pruning loses only what the axioms (or the limits) cannot reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..prove import egglog_runner
from ..prove.egglog_runner import Limits
from ..prove.egraph import TermWriter, compile_library, constructor, ruleset_name, string
from ..base.errors import PrismError
from ..ir.nodes import Node, Program, const
from ..ir.ops import OPS, Kind
from ..prove.rules import Library
from ..ir.shapes import ShapeError, build, dim_params

# The rulesets the input program is saturated with: everything but the layout axioms (no tiles here).
RULESETS = ("definitions", "algebra", "subexpression")
# Enough for the sub-terms fused kernels compute (a few rewrites deep) without the associativity and
# commutativity closure of a large program growing for long.
SATURATION_LIMITS = Limits(iterations=12, nodes=60_000, seconds=20.0)


@dataclass
class InputGraph:
    """The input program's saturated e-graph as a lookup table: e-node key -> e-class."""

    classes: dict[tuple, str]
    outputs: dict[str, str]  # output name -> its e-class
    reason: str  # why saturation stopped
    nodes: int
    seconds: float
    _parents: dict[str, list[tuple]] | None = field(default=None, repr=False)
    _numbers: list[tuple] = field(default_factory=list, repr=False)  # the literals' rows
    _children: dict[str, list[str]] | None = field(default=None, repr=False)
    _products: dict[str, list[tuple[str, ...]]] = field(default_factory=dict, repr=False)
    _extracted: dict = field(default_factory=dict, repr=False)
    _below: dict = field(default_factory=dict, repr=False)  # `below`'s answers, by its arguments
    _built: dict = field(default_factory=dict, repr=False)  # terms made, by extraction key and leaf terms
    _ops: dict = field(default_factory=dict, repr=False)  # per term, the ops in it (`_ops_in`)

    def lookup(self, node: Node, memo: dict[Node, str | None] | None = None) -> str | None:
        """The e-class of `node`'s term, or None when the e-graph does not hold it."""
        memo = {} if memo is None else memo
        if node not in memo:
            memo[node] = self.classes.get(self._key(node, memo))  # a None key (an operand not held) is no row
        return memo[node]

    def _key(self, node: Node, memo) -> tuple | None:
        if node.op == "input":
            return ("Input", (f"String:{string(node.attr)}",))
        if node.op == "const":
            return ("Num", (f"f64:{float(node.attr)!r}",))
        kids = []
        for a in node.args:
            c = self.lookup(a, memo)
            if c is None:
                return None
            kids.append(c)
        kids += [f"i64:{d}" for d in dim_params(node)]
        return (constructor(node.op), tuple(kids))


    # -- extraction ------------------------------------------------------------------------------------

    def extract(self, goals: list[str], leaves: dict[str, Node]) -> list[Node] | None:
        """Terms for the goal e-classes built from the leaf e-classes (and literals) only, each the
        cheapest the e-graph holds (EXTRACT_COST per op; ties broken by e-node order, so it is
        deterministic); None when some goal cannot be built from the leaves. A kernel's work after
        its loop is found this way rather than searched: it is a few cheap ops on accumulated tiles."""
        cost, make = self._builder(leaves)
        if any(g not in cost for g in goals):
            return None
        try:
            return [make(g) for g in goals]
        except (PrismError, ShapeError):
            return None

    def extract_elementwise(self, goal: str, leaves: dict[str, Node]) -> Node | None:
        """The cheapest term for the goal e-class built from the leaf e-classes (and literals) by
        element-wise ops alone, or None: an epilogue that needs no whole rows. Only the e-classes below
        the goal through element-wise e-nodes are searched, so a call is cheap."""
        within = self.below([goal])
        if not within.issuperset(leaves):
            return None
        key = (tuple(sorted(leaves)), goal)
        if key not in self._extracted:
            self._extracted[key] = self._costs(leaves, frozenset(within))
        cost, make = self._builder(leaves, key)
        if goal not in cost:
            return None
        try:
            return make(goal)
        except (PrismError, ShapeError):
            return None

    def terms_from(self, leaves: dict[str, Node], max_ops: int) -> dict[str, Node]:
        """Every e-class buildable from the leaves whose cheapest term reads a leaf and has at most
        `max_ops` ops: the loop values a kernel over these tiles can compute."""
        cost, make = self._builder(leaves)
        out = {}
        reads: dict[Node, bool] = {t: True for t in leaves.values()}

        def reads_leaf(n: Node) -> bool:
            if n not in reads:
                reads[n] = any(reads_leaf(a) for a in n.args)
            return reads[n]

        for c in sorted(cost, key=lambda c: (cost[c], c)):
            if cost[c] > max_ops * max(EXTRACT_COST.values()):
                continue
            try:
                term = make(c)
            except (PrismError, ShapeError):
                continue
            # A computed leaf's own ops count too (inputs and tiles do not): a loop value over a pre-defined
            # kernel's result is no longer than the input program's own values (`reach.loop_ops`).
            if reads_leaf(term) and len(self._ops_in(term)) <= max_ops:
                out[c] = term
        return out

    def _ops_in(self, term: Node) -> frozenset[Node]:
        """The distinct ops of `term` (literals, inputs and tiles are not ops), remembered per sub-term: the
        search asks for the same sub-terms' ops many times."""
        ops = self._ops.get(term)
        if ops is None:
            own = frozenset() if term.op in ("const", "input", "tile") else frozenset((term,))
            ops = self._ops[term] = own.union(*(self._ops_in(a) for a in term.args))
        return ops

    def below(self, goals: list[str], partners: frozenset = frozenset()) -> frozenset[str]:
        """The e-classes reachable from the goals through element-wise e-nodes (and the goals), and the left
        operands of products in them whose right operand is one of `partners` (e-classes of tiles a
        kernel may load for a product after its loop: LoRA's (X @ A) @ B). Remembered: the search asks for
        the same goals many times."""
        key = (tuple(goals), partners)
        if key in self._below:
            return self._below[key]
        if self._children is None:
            self._children, self._products = {}, {}
            for (ctor, kids), c in self.classes.items():
                op = OP_OF_CONSTRUCTOR.get(ctor)
                if op is not None and OPS[op].kind in (Kind.UNARY, Kind.BINARY):
                    self._children.setdefault(c, []).extend(k for k in kids if k.startswith("T-"))
                elif op is not None and OPS[op].kind is Kind.MATMUL:
                    self._products.setdefault(c, []).append(tuple(kids))
        seen, todo = set(goals), list(goals)
        while todo:
            for k in self._children.get(todo.pop(), ()):
                if k not in seen:
                    seen.add(k)
                    todo.append(k)
        found = self._below[key] = frozenset(seen | {a for c in seen for a, b in self._products.get(c, ())
                                                     if b in partners})
        return found

    def _builder(self, leaves: dict[str, Node], key=None):
        key = key or tuple(sorted(leaves))  # the costs depend on the leaf classes only, not on their terms
        if key not in self._extracted:
            self._extracted[key] = self._costs(leaves)
        cost, choice = self._extracted[key]
        # the terms depend on the leaves' terms as well as their e-classes; nodes are interned, so equal
        # leaves are the same objects
        built: dict[str, Node] = self._built.setdefault((key, tuple(leaves[c] for c in sorted(leaves))), {})

        def make(c: str) -> Node:
            if c in leaves:
                return leaves[c]
            if c not in built:
                ctor, kids = choice[c]
                if ctor == "Num":
                    built[c] = const(float(kids[0].split(":", 1)[1]))
                else:
                    args = [make(k) for k in kids if not k.startswith("i64:")]
                    params = [int(k.split(":")[1]) for k in kids if k.startswith("i64:")]
                    built[c] = build(OP_OF_CONSTRUCTOR[ctor], args, params)
            return built[c]

        return cost, make

    def _costs(self, leaves, within: frozenset | None = None) -> tuple[dict, dict]:
        """The cheapest term of each e-class buildable from the leaves: its cost and its e-node. With
        `within`, only those e-classes, through element-wise e-nodes."""
        if self._parents is None:  # per e-class, the e-nodes that may use it: (e-class, e-node, its cost
            self._parents, self._numbers = {}, []  # of its own, its operand e-classes, whether element-wise)
            for (ctor, kids), c in self.classes.items():
                op = OP_OF_CONSTRUCTOR.get(ctor)
                if op is not None and OPS[op].kind not in (Kind.ACCUMULATE, Kind.SPLIT, Kind.CONCAT, Kind.INPUT):
                    row = (c, (ctor, kids), EXTRACT_COST.get(OPS[op].kind, 1.0),
                           [k for k in kids if k.startswith("T-")], OPS[op].kind in (Kind.UNARY, Kind.BINARY))
                    for k in kids:
                        self._parents.setdefault(k, []).append(row)
                if ctor == "Num":
                    self._numbers.append((kids, c))
        cost: dict[str, float] = {c: 0.0 for c in leaves}
        choice: dict[str, tuple] = {}
        numbers = [(kids, c) for kids, c in self._numbers if within is None or c in within]
        todo = list(leaves) + [c for _, c in numbers]
        for kids, c in numbers:
            if c not in cost:
                cost[c], choice[c] = 1.0, ("Num", kids)
        inf, parents, get = math.inf, self._parents, cost.get
        while todo:  # relax upward from what is buildable until nothing gets cheaper
            nxt = []
            for k in todo:
                for c, node, own, operands, elementwise in parents.get(k, ()):
                    if within is not None and (c not in within or not elementwise):
                        continue
                    total = own
                    for kid in operands:  # the hottest loop of the search: no generator
                        total += get(kid, inf)
                    if total < get(c, inf) - 1e-9:
                        cost[c], choice[c] = total, node
                        nxt.append(c)
            todo = nxt
        return cost, choice


# What an op costs when extracting post-loop work: element-wise ops are cheap; reductions and matrix
# products after the loop are avoided where the e-graph offers another form.
EXTRACT_COST = {Kind.MATMUL: 20.0, Kind.REDUCE: 5.0, Kind.ROWWISE: 5.0}
OP_OF_CONSTRUCTOR = {constructor(name): name for name in OPS}  # the e-graph's constructor names back to ops


class SaturationFailed(PrismError):
    """The input program's e-graph could not be built: there is nothing to search from (the caller
    compiles the program as written and says why)."""


def saturate(program: Program, library: Library, limits: Limits = SATURATION_LIMITS) -> InputGraph:
    """Saturate the input program's outputs with the library's abstract rulesets; raise if none is there."""
    rulesets = [r for r in RULESETS if r in library.rulesets]
    if "algebra" not in rulesets or "definitions" not in rulesets:
        raise PrismError("the search needs the 'definitions' and 'algebra' rulesets (rules/); "
                         f"the library has {', '.join(library.rulesets) or 'none'}")
    text, _ = compile_library(library)
    writer = TermWriter()
    for _, node in program.outputs:
        writer.term(node)
    setup = "\n".join(writer.lines + writer.shape_facts())
    outcome = _run(text, setup, rulesets, limits)
    classes = {(op, _number(kids) if op == "Num" else tuple(kids)): eclass for op, kids, eclass in outcome.table}
    graph = InputGraph(classes, {}, outcome.reason, outcome.nodes, outcome.seconds)
    for name, node in program.outputs:
        c = graph.lookup(node)
        if c is None:
            raise SaturationFailed(f"the saturated e-graph lost output '{name}' (egglog: {outcome.reason})")
        graph.outputs[name] = c
    return graph


def _number(kids) -> tuple[str]:
    """A number's row key as `InputGraph.lookup` writes it: egglog prints 1e-05 as 1e-5."""
    return (f"f64:{float(kids[0].split(':', 1)[1])!r}",)


def _run(text: str, setup: str, rulesets, limits: Limits):
    names = [ruleset_name(r) for r in rulesets]
    for _ in range(2):
        with egglog_runner.Session(text) as session:
            out = session.run(setup, [], names, limits, dump=True)
        if out.table is not None:
            return out
        # Killed mid-round at the time limit: run again with fewer iterations.
        limits = Limits(iterations=max(1, out.iterations), nodes=limits.nodes, seconds=limits.seconds * 2)
    raise SaturationFailed(f"could not saturate the input program's e-graph: {out.reason}")
