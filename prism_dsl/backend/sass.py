"""What a compiled kernel runs: its SASS, and the instruction mix of its hot loop.

Where it sits: beside the compile check (`nvcc`); the static performance report (benchmarks/static_report.py)
reads it, and a reader can check by it that a kernel does what its source says (tensor cores where products
are, async copies in flight, no spills). `cuobjdump` is found on the PATH or inside the pip package
`nvidia-cuda-cuobjdump` (the extra `sass`); without it `available()` is False and callers say so.

The hot loop is found from the branches: every backward branch closes a loop (its target address to the
branch); the hot loop is the loop holding the most tensor-core, async-copy and FMA instructions, the
kernel's main loop in generated code (inner loops are unrolled by nvcc).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# instruction classes counted in a loop: the opcode's first dotted part
CLASSES = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "FFMA", "LDS", "STS", "BAR", "LDG", "SHFL")

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P\w+)\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
NEVER = "NEVER"  # the opcode recorded for an instruction predicated on !PT (alignment filler: never runs)
EXIT_SOME = "EXIT.IF"  # the opcode recorded for a predicated EXIT (`loops` looks for the unconditional one)
_TARGET = re.compile(r"^\s*(0x[0-9a-f]+)")


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
    done = subprocess.run([tool() or "cuobjdump", "-sass", str(cubin)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {done.stderr.strip()[-500:]}")
    return done.stdout


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
                branches.append((len(ops), int(t.group(1), 16)))
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


def hot_loop(sass: str) -> Loop | None:
    """The main loop: the one with the most HMMA or HGMMA (wgmma), then the most LDGSTS, then FFMA (ties: the longest); None
    without loops. (An epilogue's FFMA loop must not outrank the tensor-core loop, nor a branch back into
    the middle of the loop body from the code after it, which ptxas may lay out beside the pipelined loop
    and which holds its HMMA but not its copies.)"""
    found = loops(sass)
    key = lambda l: (l.counts["HMMA"] + l.counts["HGMMA"], l.counts["LDGSTS"], l.counts["FFMA"], l.instructions)  # noqa: E731
    return max(found, key=key, default=None)
