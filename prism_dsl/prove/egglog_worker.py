"""The egglog child process: runs as a script (`python egglog_worker.py`), talks JSON lines on stdio.

It lives in a process of its own because an egglog run cannot be interrupted: the parent
(`egglog_runner`) enforces the wall-clock limit by killing this process. So that a kill loses as
little as possible, progress (goals proved so far, e-graph size) is reported after every round.

Saturation runs in rounds of a few iterations. Each round is one egglog `run-schedule` under a fresh
back-off scheduler (a rule whose matches exceed the scheduler's limit is banned for some iterations,
with limit and ban doubling each time), so associativity and commutativity cannot flood the e-graph
in one iteration. The match limit doubles from round to round, so a rule banned in one round gets its
chance in a later one: iterative deepening. Every ruleset step is followed by the prelude (shape
facts, constant folding, the goal check) to saturation, and every step is skipped once all goals hold.

Requests (one JSON object per line):
  {"op": "load", "program": TEXT}          -> {"ok": true} | {"error": MESSAGE}
  {"op": "query", "setup": TEXT, "goals": [[A, B], ...], "prelude": [RS, ...], "rulesets": [RS, ...],
   "limits": {...}}
      -> {"iteration": K, "proved": [...], "nodes": N, "matched": [RS, ...]}  after every round
      -> {"done": true, "reason": WHY, ...}                                 at the end
With no goals, the query saturates the setup's terms up to the limits; with "dump": true, the final
message also carries the e-graph's tensor e-nodes as [constructor, [child key, ...], e-class] rows
(a child key is an e-class, or "sort:literal" for a primitive), so the parent can look terms up
without asking again (`search.abstract` prunes the search that way).
Each query runs between `(push)` and `(pop)`, so one loaded program answers many queries.

This file imports nothing from the package: the parent starts it by path (with -P, so that its folder
stays off sys.path, where a module of the package could shadow a standard one).
"""

from __future__ import annotations

import json
import re
import sys
import time

ROUND = 8  # iterations per round; more than the ban length, so a banned rule can return in its round
GROWTH_GUESS = 3.0  # e-graph growth per iteration assumed before any is measured
RULESET = re.compile(r":ruleset (\S+)\s*\)$")  # the ruleset at the end of a rule's text in egglog's reports

# What the worker adds to every program: `Proved` holds once every goal does (a rule in the `goal`
# ruleset, written per query), and `ticks` counts iterations (egglog reports no such count itself).
SUPPORT = """
(relation Proved ())
(ruleset goal)
(function ticks () i64 :merge new)
(ruleset tick)
(rule ((= n (ticks))) ((set (ticks) (+ n 1))) :ruleset tick)
"""


def _die_with_parent() -> None:
    """On Linux the kernel kills this worker when the process that started it dies, however it dies
    (a SIGKILL from a CI runner included), so no orphan goes on growing an e-graph."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    # the parent (PRISM_PARENT, its pid) died before the request took effect: this one has another now
    if os.environ.get("PRISM_PARENT", str(os.getppid())) != str(os.getppid()):
        sys.exit(1)


def main() -> None:
    _die_with_parent()
    from egglog.bindings import EGraph, EggSmolError

    egraph = EGraph()

    def run(text: str) -> list:
        return egraph.run_program(*egraph.parse_program(text))

    def send(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "load":
                run(request["program"] + SUPPORT)
                send({"ok": True})
            else:
                run("(push)")
                try:
                    dump = (lambda: tensor_nodes(egraph)) if request.get("dump") else None
                    Query(run, request, EggSmolError).solve(send, dump)
                finally:
                    run("(pop)")
        except EggSmolError as err:
            send({"error": str(err)})


class Query:
    def __init__(self, run, request: dict, error: type) -> None:
        self.run, self.error = run, error
        self.limits = request["limits"]
        self.goals = [tuple(g) for g in request["goals"]]
        self.rulesets = request["rulesets"]
        self.prelude = "(saturate {})".format(" ".join(f"(run {rs})" for rs in [*request["prelude"], "goal"]))
        self.proved = [False] * len(self.goals)
        self.matched: set[str] = set()  # the rulesets whose rules matched something
        self.iterations = 0
        run(request["setup"])
        run("(set (ticks) 0)")
        if self.goals:  # with none, nothing is to be proved: saturate up to the limits
            run("(rule ({}) ((Proved)) :ruleset goal)".format(" ".join(f"(= {a} {b})" for a, b in self.goals)))

    def solve(self, send, dump=None) -> None:
        start = time.perf_counter()
        limits = self.limits
        self.run(f"(run-schedule {self.prelude})")
        self.check()
        size, round_ = self.nodes(), 0
        growth = GROWTH_GUESS  # e-graph growth per iteration, measured after every round
        while True:
            if self.goals and all(self.proved):
                reason = "proved"
            elif self.iterations >= limits["iterations"]:
                reason = f"iteration limit ({limits['iterations']}) reached"
            elif size > limits["nodes"]:
                reason = f"e-graph size limit ({limits['nodes']:,} rows) reached"
            elif time.perf_counter() - start > limits["seconds"]:
                reason = f"time limit ({limits['seconds']:g} s) reached"
            else:
                match_limit = limits["match_limit"] << round_
                # Short rounds near the size limit: it is checked between rounds, so a round must not
                # be long enough to blow far past it at the growth rate seen so far.
                length = min(ROUND, limits["iterations"] - self.iterations)
                while length > 1 and size * growth**length > limits["nodes"]:
                    length -= 1
                before, done = size, self.iterations
                changed, banned = self.round(length, match_limit)
                round_ += 1
                self.check()
                size = self.nodes()
                if self.iterations > done:
                    growth = max(1.0, size / max(before, 1)) ** (1 / (self.iterations - done))
                send({"iteration": self.iterations, "proved": self.proved, "nodes": size,
                      "matched": sorted(self.matched)})
                if (self.goals and all(self.proved)) or changed or banned:
                    continue
                reason = "saturated: the rules cannot rewrite either side any further"
            break
        done = {"done": True, "reason": reason, "proved": self.proved, "iterations": self.iterations,
                "nodes": size, "matched": sorted(self.matched), "seconds": time.perf_counter() - start}
        if dump is not None:
            done["table"] = dump()
        send(done)

    def round(self, iterations: int, match_limit: int) -> tuple[bool, bool]:
        """Run `iterations` iterations; say whether any rule changed the e-graph, and whether any was
        banned (had more matches than the limit, so the e-graph may not be saturated yet)."""
        steps = " ".join(f"(run-with bo {rs} :until (Proved)) {self.prelude}" for rs in self.rulesets)
        (out,) = self.run(
            f"(run-schedule (let-scheduler bo (back-off :match-limit {match_limit} :ban-length {self.limits['ban_length']}))"
            f" (repeat {iterations} (seq (run tick :until (Proved)) {steps})))"
        )
        changed = banned = False
        wanted = set(self.rulesets)
        for it in out.report.iterations:
            for rule, reports in it.rule_set_report.rule_reports.items():
                found = RULESET.search(rule)
                ruleset = found.group(1) if found else None
                if ruleset == "tick":
                    self.iterations += any(r.num_matches for r in reports)
                elif ruleset in wanted:
                    most = max((r.num_matches for r in reports), default=0)
                    if most:
                        self.matched.add(ruleset)
                    banned |= most > match_limit
                    changed |= it.rule_set_report.changed
        return changed, banned

    def check(self) -> None:
        for k, (a, b) in enumerate(self.goals):
            if not self.proved[k]:
                try:
                    self.run(f"(check (= {a} {b}))")
                    self.proved[k] = True
                except self.error:
                    pass

    def nodes(self) -> int:
        (sizes,) = self.run("(print-size)")
        return sum(count for name, count in sizes.sizes if name != "ticks")


def tensor_nodes(egraph) -> list:
    """The e-nodes of sort T: [constructor, child keys, e-class] (see the module doc)."""
    data = json.loads(egraph.serialize([]).to_json())
    nodes, types = data["nodes"], data["class_data"]

    def key(node_id: str) -> str:
        child = nodes[node_id]
        sort = types[child["eclass"]]["type"]
        return f"{sort}:{child['op']}" if node_id.startswith("primitive-") else child["eclass"]

    return [[n["op"], [key(c) for c in n["children"]], n["eclass"]]
            for n in nodes.values() if types[n["eclass"]]["type"] == "T"]


if __name__ == "__main__":
    main()
