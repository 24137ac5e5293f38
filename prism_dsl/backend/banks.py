"""Shared-memory wavefronts of generated kernels, counted in the thread-faithful emulation: what their shared
memory accesses cost, bank conflicts included, read from the addresses the code computes rather than from a model.

Where it sits: beside `emulate`, which builds and runs it (the "banks" build: templates/prism_banks.cc has the
counting and its rules). The kernels are compiled with every load and store an outlined call, and the emulation
keeps those that fall in a block's shared buffers, at the address the GPU would use. A warp's instruction is what
its lanes do at one place in the code between two synchronisations; a thread's adjacent accesses within an aligned
16 bytes count as one (nvcc's vector loads and stores); ldmatrix and cp.async's writes are counted as the GPU
serves them, wgmma's operands and TMA's copies not at all. A phase of lanes (128 bytes) takes one wavefront
conflict-free, and as many as the most distinct words one bank holds otherwise.

The build takes g++'s kernel-address instrumentation (clang's flags are given too, but have not been run here).
The counts are of the accesses the host compiler leaves: where nvcc keeps a value in a register that g++ reads
again (a row's scale read once per element), they are over; they are exact for the explicit primitives (ldmatrix,
load8, store16, cp.async). `static_report.py` prints them per kernel; the tests hold the generated kernels to them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..base import files
from ..base.errors import PrismError
from ..ir.nodes import DType
from . import emulate as emulator
from .codegen import HEADER, RenderedKernel

EXECUTABLE = "emulate-banks"
_LAUNCH = re.compile(r"^prism-banks: kernel (\S+) blocks (\d+) wavefronts (\d+) ideal (\d+) accesses (\d+)$", re.M)
_SITE = re.compile(r"^prism-banks-site: (\S+) (\S+) wavefronts (\d+) ideal (\d+) accesses (\d+)$", re.M)


@dataclass(frozen=True)
class Place:
    """One place in a kernel's code: its warp instructions' wavefronts against conflict-free."""
    where: str  # "FILE.cu:LINE" (prism.cuh's primitives named by their line there), or an offset addr2line could not
    wavefronts: int
    ideal: int
    accesses: int  # warp instructions

    @property
    def excess(self) -> int:
        return self.wavefronts - self.ideal


@dataclass(frozen=True)
class Wavefronts:
    """A kernel's shared-memory wavefronts over the blocks emulated, and the places that take more than
    conflict-free, the worst first."""
    kernel: str
    blocks: int
    wavefronts: int
    ideal: int
    accesses: int
    conflicted: tuple[Place, ...]

    @property
    def per_block(self) -> float:
        return self.wavefronts / max(1, self.blocks)

    @property
    def over_ideal(self) -> float:
        """Wavefronts over those of the same accesses without a conflict (1.0: none)."""
        return self.wavefronts / self.ideal if self.ideal else 1.0

    def as_dict(self) -> dict:
        return {"blocks": self.blocks, "wavefronts": self.wavefronts, "conflict_free": self.ideal,
                "warp_accesses": self.accesses, "over_conflict_free": round(self.over_ideal, 3),
                "conflicted": [{"at": p.where, "wavefronts": p.wavefronts, "conflict_free": p.ideal}
                               for p in self.conflicted]}


def count(kernels: Sequence[RenderedKernel], dtypes: Mapping[str, DType], shapes: Mapping[str, tuple[int, ...]],
          inputs: Mapping[str, np.ndarray], *, blocks: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
          feed: Mapping[str, np.ndarray] | None = None, header: str | None = None,
          timeout: float = emulator.TIMEOUT) -> dict[str, Wavefronts]:
    """Per kernel (by name), the wavefronts of the blocks emulated (`emulate.run`'s `blocks`, `feed` and `header`).
    A finding of the emulation is an error here: the kernels are checked before they are counted."""
    with files.temp_scratch("banks") as workdir:
        result = emulator.run(kernels, dtypes, shapes, inputs, workdir, sanitizer="banks", blocks=blocks, feed=feed,
                              header=header, timeout=timeout)
        if result.finding:
            raise PrismError("the emulation that counts shared-memory wavefronts found: " + result.finding.text())
        return parse(result.log, workdir / EXECUTABLE)


def parse(log: str, executable: Path | None = None) -> dict[str, Wavefronts]:
    """The counts the "banks" build printed; places given as offsets are named by addr2line from `executable`."""
    offsets = sorted({m.group(2) for m in _SITE.finditer(log) if m.group(2).startswith("0x")})
    names = _lines(executable, offsets) if executable is not None else {}
    places: dict[str, list[Place]] = {}
    for m in _SITE.finditer(log):
        kernel, where, w, i, a = m.group(1), m.group(2), *map(int, m.groups()[2:])
        places.setdefault(kernel, []).append(Place(names.get(where, where), w, i, a))
    found = {}
    for m in _LAUNCH.finditer(log):
        kernel, b, w, i, a = m.group(1), *map(int, m.groups()[1:])
        merged: dict[str, list[int]] = {}
        for p in places.get(kernel, []):
            sums = merged.setdefault(p.where, [0, 0, 0])
            sums[0], sums[1], sums[2] = sums[0] + p.wavefronts, sums[1] + p.ideal, sums[2] + p.accesses
        worst = sorted((Place(where, *s) for where, s in merged.items() if s[0] > s[1]), key=lambda p: -p.excess)
        found[kernel] = Wavefronts(kernel, b, w, i, a, tuple(worst))
    return found


def _lines(executable: Path, offsets: Sequence[str]) -> dict[str, str]:
    """Each offset (a return address in `executable`) as the "FILE:LINE" of its call, where addr2line says: the
    kernel's line where the access is in one of the header's primitives inlined there (load8, store16)."""
    tool = shutil.which("addr2line")
    if not offsets or tool is None or not executable.is_file():
        return {}
    calls = [hex(int(o, 16) - 1) for o in offsets]  # the call is the instruction before its return address
    done = subprocess.run([tool, "-a", "-i", "-e", str(executable), *calls], capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        return {}
    frames: dict[str, list[str]] = {}
    by_call = dict(zip(calls, offsets))
    current = None
    for line in done.stdout.splitlines():
        if line.startswith("0x"):
            current = by_call.get(hex(int(line, 16)))
            frames[current] = []
        elif current is not None and (m := re.match(r"(.*?):(\d+)", line)) and m.group(1) != "??":
            frames[current].append(f"{Path(m.group(1)).name}:{m.group(2)}")
    return {offset: next((f for f in chain if not f.startswith(_HEADERS)), chain[0])
            for offset, chain in frames.items() if offset is not None and chain}


_HEADERS = (HEADER + ":", emulator.RUNTIME + ":")  # prism.cuh's and the runtime's lines: their callers named instead
