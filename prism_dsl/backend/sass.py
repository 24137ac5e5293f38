"""What a compiled kernel runs: its SASS, and the instruction mix of its hot loop.

Where it sits: beside the compile check (`nvcc`); the static performance report (benchmarks/static_report.py)
reads it, and a reader can check by it that a kernel does what its source says (tensor cores where products
are, async copies in flight, no spills). `cuobjdump` is found on the PATH or inside the pip package
`nvidia-cuda-cuobjdump` (the extra `sass`); without it `available()` is False and callers say so.

The hot loop is found from the branches: every backward branch closes a loop (its target address to the
branch); the hot loop is the loop holding the most tensor-core, async-copy and FMA instructions, the
kernel's main loop in generated code (the threads' passes over a tile are unrolled by nvcc: their trip count
is in sight, templates/steps.j2). Its counts are of the code it holds; some of that code runs only on some
iterations (the copies of the iterations ahead).

`issued` is what the cost model takes from it (`cost.estimate`'s issue time): the fewest instructions one warp
issues per iteration of the main loop and once besides, along the shortest of the paths through the code that
issue the most tensor-core instructions (HMMA, HGMMA: a warp that runs a loop's products runs them on every
iteration, behind `if (warp < N)` and, for online softmax's `p @ v`, `if (it > 0)`, which no path may skip),
forward branches taken wherever that is shorter, nested loops once, so a floor; per iteration along the
shortest of those paths that also issue the most async copies (LDGSTS; TMA's UTMALDG, which thread 0 issues),
which the iterations that copy tiles ahead take (all but a pipelined loop's last few: the copies sit behind
`if (ahead < N)`); and how much less a warp that runs no product issues per iteration (where a small product's
layout leaves some warps out). The SASS loop is taken for the source's main loop (`for (int it = 0; ...)`) only
where its barriers say so: BAR per pass, against the source's barriers per iteration, gives how many iterations
nvcc unrolled into one pass (a loop with no barrier, a copy warp's computing threads', by its mbarrier waits);
where they disagree, nothing is taken.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# instruction classes counted in a loop: the opcode's first dotted part
CLASSES = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "FFMA", "LDS", "STS", "BAR", "LDG", "SHFL")

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P\w+)\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
NEVER = "NEVER"  # the opcode recorded for an instruction predicated on !PT (alignment filler: never runs)
EXIT_SOME = "EXIT.IF"  # the opcode recorded for a predicated EXIT (`loops` looks for the unconditional one)
IF = ".IF"  # appended to the opcode of a predicated branch: it may fall through
# a branch's target, after the predicate it may also test (`@!P0 BRA P1, 0x4280`: taken where P0 is false and P1 true)
_TARGET = re.compile(r"^\s*(!?U?P\w+\s*,\s*)?(0x[0-9a-f]+)")
_PRODUCTS = ("HMMA", "HGMMA")  # the tensor-core instructions a loop's every iteration issues
COPIES = ("LDGSTS", "UTMALDG")  # async copies into shared memory: cp.async, and TMA's (cp.async.bulk.tensor)


def tool(name: str = "cuobjdump") -> str | None:
    """The tool on the PATH, else inside the NVIDIA pip packages of this Python."""
    if found := shutil.which(name):
        return found
    for root in map(Path, sys.path):
        for candidate in root.glob(f"nvidia/*/bin/{name}"):
            if candidate.is_file():
                return str(candidate)
    return None


def available() -> bool:
    return tool() is not None


def disassemble(cubin: Path) -> str:
    done = subprocess.run([tool() or "cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {done.stderr.strip()[-500:]}")
    return done.stdout


_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.M)


def functions(listing: str) -> dict[str, str]:
    """The SASS of each function in a listing of several (`cuobjdump -sass` of one cubin), by name."""
    heads = list(_FUNCTION.finditer(listing))
    return {m.group(1): listing[m.end():end] for m, end in zip(heads, [h.start() for h in heads[1:]] + [len(listing)])}


@dataclass(frozen=True)
class Loop:
    start: int  # instruction index of its first instruction
    end: int  # of its backward branch
    counts: dict[str, int]

    @property
    def instructions(self) -> int:
        return self.end - self.start + 1


def instructions(sass: str) -> tuple[list[str], list[int], list[tuple[int, int]]]:
    """(opcodes in order, their addresses, (index, target address) per branch) of every kernel in `sass`."""
    ops, where, branches = [], [], []
    for line in sass.splitlines():
        if m := _LINE.search(line):
            op = m.group(3) if m.group(2) != "@!PT" else NEVER
            if op == "EXIT" and m.group(2):  # some threads leave here: not the kernel's end
                op = EXIT_SOME
            if op.startswith("BRA") and (t := _TARGET.match(m.group(4))):
                branches.append((len(ops), int(t.group(2), 16)))
                op += IF if m.group(2) not in (None, "@PT") or t.group(1) and not t.group(1).startswith("PT") else ""
            ops.append(op)
            where.append(int(m.group(1), 16))
    return ops, where, branches


def count(ops: list[str]) -> dict[str, int]:
    out = dict.fromkeys(CLASSES, 0)
    for op in ops:
        head = op.split(".")[0]
        if head in out:
            out[head] += 1
    out["total"] = sum(op != NEVER for op in ops)
    return out


def loops(sass: str) -> list[Loop]:
    """Every loop: a branch back to an earlier address (within the same kernel: the addresses run up), not
    over the kernel's unconditional EXIT: such a branch comes from code ptxas lays out after the kernel's end (the retry
    of an mbarrier's try-wait, which then goes back to the middle of the loop)."""
    ops, where, branches = instructions(sass)
    out = []
    for i, target in branches:
        start = i
        while start > 0 and where[start - 1] >= target and where[start - 1] < where[start]:
            start -= 1
        if where[start] == target and target < where[i] and "EXIT" not in ops[start: i + 1]:
            out.append(Loop(start, i, count(ops[start: i + 1])))
    return out


@dataclass(frozen=True)
class Issued:
    """The instructions one warp of a kernel that runs its products issues: `loop` per iteration of its main loop
    (0 where it has none in the SASS: one iteration, or unrolled whole), `once` besides (an inner loop outside it
    counts once), and `copying` per iteration of the loop that issues its async copies (`loop` where every path
    does); `spare`, per iteration, what a warp that runs no product leaves out (the block's warps past those
    a small product's layout takes)."""
    loop: float
    once: int
    copying: float = 0.0
    spare: float = 0.0

    def as_dict(self) -> dict:
        return {"loop": self.loop, "once": self.once, "copying": max(self.copying, self.loop), "spare": self.spare}


_MAIN_LOOP = re.compile(r"for \(int it = 0; it < (\w+); \+\+it\) \{")
_SOURCE_BARRIERS = re.compile(r"__syncthreads\(\)|prism::named_(?:sync|arrive)\(")
_SOURCE_WAITS = re.compile(r"prism::mbarrier_wait\(")
WAIT = "SYNCS.PHASECHK"  # an mbarrier's try-wait in the SASS (its retry may follow the kernel's end)


def main_loop_body(source: str) -> str | None:
    """The code of a generated kernel's main loop, as its CUDA source has it; None without a loop of more than one
    iteration."""
    m = _MAIN_LOOP.search(source)
    if m is None or m.group(1) == "1":
        return None
    depth = 0
    for i in range(m.end() - 1, len(source)):
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            break
    return source[m.end(): i]


def main_loop_barriers(source: str) -> int | None:
    """The barriers one iteration of a generated kernel's main loop passes (`__syncthreads`, named barriers),
    as its CUDA source has them; None without a loop of more than one iteration."""
    body = main_loop_body(source)
    return None if body is None else len(_SOURCE_BARRIERS.findall(body))


def fewest(sass: str, start: int = 0, end: int | None = None, copying: bool = False, products: bool = True) -> int:
    """The fewest instructions a warp issues from instruction `start` to `end` (both counted; by default the
    kernel's unconditional EXIT) along the paths that issue the most HMMA and HGMMA (any path, without
    `products`): fall-throughs, and branches forward to an instruction in between, whichever is shorter; a
    back branch is not taken (a loop nested inside counts once); instructions predicated never to run count
    0. With `copying`, of those paths the ones that issue the most async copies (LDGSTS, UTMALDG). One kernel
    per listing (`where`'s addresses run up)."""
    return _fewest(instructions(sass), start, end, copying, products)


def _fewest(parsed, start: int = 0, end: int | None = None, copying: bool = False, products: bool = True) -> int:
    """`fewest` over a listing already parsed by `instructions`. A path's cost is (async copies left out, with
    `copying`; tensor-core instructions left out, with `products`; instructions), the least taken at each
    instruction: the code runs forward, so the least to an instruction extends from the least to those before it."""
    ops, where, branches = parsed
    if end is None:
        end = next((i for i, op in enumerate(ops) if op == "EXIT"), len(ops) - 1)
    at = {a: i for i, a in enumerate(where[start: end + 1], start)}
    ahead: dict[int, list[int]] = {}
    for i, target in branches:
        if start <= i < end and at.get(target, -1) > i:
            ahead.setdefault(i, []).append(at[target])
    cost = [(-int(copying and op.startswith(COPIES)), -int(products and op.startswith(_PRODUCTS)), int(op != NEVER))
            for op in ops]
    never = (math.inf, math.inf, math.inf)
    best = [never] * (end + 1)
    best[start] = cost[start]
    for i in range(start, end):
        if best[i] == never:
            continue
        goes_on = not ((ops[i].startswith("BRA") and not ops[i].endswith(IF)) or ops[i] == "EXIT")
        for j in ahead.get(i, []) + ([i + 1] if goes_on else []):
            best[j] = min(best[j], tuple(a + b for a, b in zip(best[i], cost[j])))
    return int(best[end][-1]) if best[end] != never else 0


def issued(sass: str, source: str) -> Issued | None:
    """What one warp of the kernel in `sass` (compiled from `source`) issues at least; None where the SASS's
    loops cannot be matched to the source's main loop: the hot loop's BAR must be a whole multiple of the
    source's per iteration (where the source's loop has no barrier, its mbarrier waits: SYNCS.PHASECHK). Where the source's loop has barriers and no SASS loop passes one, nvcc unrolled
    the main loop whole (a loop left, such as the copies of the iterations ahead, counts once)."""
    parsed = instructions(sass)
    whole = _fewest(parsed)
    barriers, hot = main_loop_barriers(source), hot_loop(sass)
    if barriers is None or hot is None or barriers and not hot.counts["BAR"]:
        return Issued(0, whole)
    if barriers:
        unrolled, rest = divmod(hot.counts["BAR"], barriers)
    else:  # a loop paced by mbarriers alone (a copy warp's computing threads): their waits per pass, as the BAR above
        waits = len(_SOURCE_WAITS.findall(main_loop_body(source) or ""))
        unrolled, rest = divmod(sum(op.startswith(WAIT) for op in parsed[0][hot.start: hot.end + 1]), waits or 1)
    if rest or not unrolled:
        return None
    per_pass = _fewest(parsed, hot.start, hot.end)
    spare = per_pass - _fewest(parsed, hot.start, hot.end, products=False)
    return Issued(per_pass / unrolled, max(0, whole - per_pass), _fewest(parsed, hot.start, hot.end, True) / unrolled,
                  spare / unrolled)


def hot_loop(sass: str) -> Loop | None:
    """The main loop: of the loops that pass a barrier (every generated main loop does; a loop of the copies
    of the iterations ahead, before it, does not), or of all where none does, the one with the most HMMA or
    HGMMA (wgmma), then the most async copies (LDGSTS, UTMALDG), then FFMA (ties: the longest); None without
    loops. (An epilogue's FFMA loop must not outrank the tensor-core loop, nor a branch back into the middle
    of the loop body from the code after it, which ptxas may lay out beside the pipelined loop and which holds
    its HMMA but not its copies.)"""
    found = loops(sass)
    return max([l for l in found if l.counts["BAR"]] or found, key=_hotness, default=None)


def _hotness(l: Loop) -> tuple:  # `hot_loop`'s order
    return (l.counts["HMMA"] + l.counts["HGMMA"], sum(l.counts[c] for c in COPIES), l.counts["FFMA"], l.instructions)
