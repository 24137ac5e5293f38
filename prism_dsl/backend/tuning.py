"""Parameter choice by the cost model: for a lowered program at given dims, the free kernel parameters (tile
sizes, loop steps, pieces) that minimise `cost.estimate` for the code the generator will write.

Where it sits: the pipeline's tune pass (`pipeline.build.tune`) and the search's tuning of each proved program
(`pipeline.optimize`), and `prismc show`.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import sympy

from ..ir.nodes import Program
from ..kernels.constraints import Concrete, instantiate, instantiate_program, valid
from ..kernels.hardware import Hardware
from ..kernels.kernel import Kernel, free_symbols, kernels_of
from ..kernels.params import candidates, choose
from ..kernels.fusion import least_smem
from .cost import Estimate, estimate, for_hardware
from .intake import SM_FILL_BYTES_PER_CLOCK, WARP_FILL_BYTES_PER_CLOCK
from .launch import CodegenConfig, layout
from .tails import joins, pairs, tail_config

MAX_CANDIDATES = 4096  # per group of kernels that share parameters
INTAKE_WARPS = SM_FILL_BYTES_PER_CLOCK / WARP_FILL_BYTES_PER_CLOCK  # the warps whose copies fill an SM's intake


def parameters(program: Program, dims: Mapping[sympy.Symbol, int], given: Mapping[str, int], hardware: Hardware,
               codegen: CodegenConfig | None = None) -> tuple[dict[str, int], dict[str, Concrete], list[Estimate]]:
    """A lowered program at these dims: its kernel parameters by name (`given` kept, the rest chosen by
    the model for the code `codegen` asks for), every kernel concrete, and their estimates. Raises
    PrismError listing the violated constraints when no choice is valid."""
    config = for_hardware(codegen, hardware)
    symbols = {s.name: s for s in free_symbols(program)}
    fixed = {symbols[n]: v for n, v in given.items()}
    try:
        chosen = tune(program, dims, fixed, hardware, config)
    except ValueError:  # `choose` searches further, and reports every violated constraint in words
        chosen = choose(program, dims, fixed, hardware)
    params = {**given, **{s.name: v for s, v in chosen.items()}}
    concrete = instantiate_program(program, {**dims, **{symbols[n]: v for n, v in params.items()}}, hardware,
                                   generated(config))
    return params, concrete, estimates(program, concrete, hardware, config)


def estimates(program: Program, concrete: Mapping[str, Concrete], hardware: Hardware, config: CodegenConfig,
              compiled: Mapping[str, Mapping] | None = None) -> list[Estimate]:
    """Each kernel's estimate (`priced`; `compiled`: per launch, the compile check's figures for the hardware's
    arch, which for a launch that also combines are the first kernel's)."""
    firsts = pairs(program) if config.one_launch else {}
    return [priced(c, concrete.get(firsts.get(name)), hardware, config, (compiled or {}).get(name))
            for name, c in concrete.items()]


def priced(c: Concrete, first: Concrete | None, hardware: Hardware, config: CodegenConfig,
           compiled: Mapping | None = None) -> Estimate:
    """`c`'s estimate; where it is a combining kernel that runs in the launch of `first` (the kernel whose pieces
    it combines, `tails.joins`), on that kernel's threads, with no launch of its own, from its structure."""
    if first is not None and joins(first, c, config):
        e = estimate(c, hardware, config=tail_config(first, config), launched=False)
        return replace(e, launched_by=first.kernel.name)
    return estimate(c, hardware, config=config, compiled=compiled)


def generated(config: CodegenConfig):
    """The bytes of shared memory the code `config` asks for takes, per concrete kernel (`launch.layout`): what
    decides whether a kernel fits where the kernel's own bound, which holds for every config, does not."""
    return lambda c: layout(c, config).smem


def fits(kernel: Kernel, binding: Mapping[sympy.Symbol, int], hardware: Hardware,
         config: CodegenConfig) -> Concrete | None:
    """The kernel instantiated for the code `config` asks for, or None where a constraint fails (`generated`)."""
    if not valid(kernel, binding, hardware, smem=False):
        return None
    if (least := least_smem(kernel, binding)) is not None and least > hardware.smem_per_block:
        return None  # over the limit however it is laid out: `instantiate` would lay it out to find that
    c = instantiate(kernel, binding, hardware, generated(config))
    return None if isinstance(c, list) else c


def tune(program: Program, dims: Mapping[sympy.Symbol, int], fixed: Mapping[sympy.Symbol, int], hardware: Hardware,
         codegen: CodegenConfig | None = None) -> dict[sympy.Symbol, int]:
    """Values for the free kernel parameters that minimise the estimated time; between equal estimates,
    the one that keeps more SMs busy (the model's bandwidth is a ceiling it reaches with few SMs as with
    many, which the hardware does not promise), then the one that reads fewer bytes through L2 (larger
    tiles: each operand fragment feeds more products, which a model bound by the tensor-core rate alone
    does not see), then the one that keeps more warps resident on each busy SM (smaller blocks, more of
    them at once: a kernel that loads its tiles, computes, then stores overlaps those phases only across
    the blocks an SM holds, and an SM took in data at a rate that grew with its warps, as measured with
    `benchmarks/gpu_probe.py`; where the bandwidth's ceiling binds, the model sees neither). Kernels that share a parameter are tuned together; the rest one at a time. Every
    combination of candidate values is tried when there are at most MAX_CANDIDATES of them; beyond that, a
    descent from the best of a few starts (every parameter at its smallest, middle or largest candidate)
    that changes one or two parameters at a time while the estimate improves. Raises ValueError when a
    kernel has no valid choice (the caller reports the violations through `kernels.params.choose`)."""
    chosen: dict[sympy.Symbol, int] = {}
    for group in _priced_groups(program, dims, fixed, hardware, for_hardware(codegen, hardware)):
        chosen.update(zip(group.syms, group.best()))
    return chosen


def choices(program: Program, dims: Mapping[sympy.Symbol, int], fixed: Mapping[sympy.Symbol, int], hardware: Hardware,
            codegen: CodegenConfig | None = None, count: int = 4) -> list[dict[sympy.Symbol, int]]:
    """Up to `count` choices of the free kernel parameters to time on a GPU: `tune`'s first, then the model's next
    best with other grid sizes, then the next best by the model however they launch. Other grid sizes first, since
    how many blocks stream a tensor, and how wide a slice each reads, is where the GPU runs found the model wrong
    by the most (up to 4x at decode, `benchmarks/RESULTS.md`). Groups of kernels that share no parameter are
    varied one at a time from their best. Raises ValueError as `tune` does."""
    groups = list(_priced_groups(program, dims, fixed, hardware, for_hardware(codegen, hardware)))
    ranked = [g.ranked(count) for g in groups]
    best = [r[0] for r in ranked]
    combos = [best] + [best[:i] + [v] + best[i + 1:] for i, r in enumerate(ranked) for v in r[1:]]
    combos.sort(key=lambda combo: sum(g.time_of(v)[0] for g, v in zip(groups, combo)))  # stable: the best first
    return [{s: x for g, v in zip(groups, combo) for s, x in zip(g.syms, v)} for combo in combos[:count]]


@dataclass(frozen=True)
class _Group:
    """Kernels tuned together (`_groups`), their free parameters `syms` with the candidate values of each, and
    `time_of`: a choice of values ranked as `tune` ranks them."""

    kernels: list[str]
    syms: list[sympy.Symbol]
    cands: list[list[int]]
    time_of: Callable[[tuple[int, ...]], tuple]
    blocks: Callable[[tuple[int, ...]], tuple]  # each kernel's blocks at a choice of values

    def exhaustive(self) -> bool:
        return math.prod(len(c) for c in self.cands) <= MAX_CANDIDATES

    def best(self) -> tuple[int, ...]:
        if self.exhaustive():
            best = min(itertools.product(*self.cands), key=self.time_of)  # the first of equal ranks: deterministic
        else:
            cands, time_of = self.cands, self.time_of
            starts = [tuple(c[0] for c in cands), tuple(c[len(c) // 2] for c in cands), tuple(c[-1] for c in cands)]
            start = min(starts, key=time_of)
            if time_of(start)[0] == math.inf:  # none valid: the first valid combination, if any
                start = next((v for v in itertools.islice(itertools.product(*cands), 20 * MAX_CANDIDATES)
                              if time_of(v)[0] < math.inf), start)
            best = _descend(start, cands, time_of)
        if self.time_of(best)[0] == math.inf:
            raise ValueError("no valid parameters for kernel " + ", ".join(self.kernels))
        return best

    def ranked(self, count: int) -> list[tuple[int, ...]]:
        """`best` first, then up to `count` - 1 valid others: those that launch other numbers of blocks than every
        one taken before, the best by the model first, then the best of the rest. Where there are too many
        combinations to try every one, the others are drawn from the changes of one or two values to `best`."""
        best = self.best()
        pool = (itertools.product(*self.cands) if self.exhaustive() else
                _moves(best, self.cands))
        ordered = sorted((v for v in dict.fromkeys(pool) if v != best and self.time_of(v)[0] < math.inf),
                         key=self.time_of)
        launched = {self.blocks(best)}
        taken = [best]
        for v in ordered:
            if len(taken) < count and self.blocks(v) not in launched:
                launched.add(self.blocks(v))
                taken.append(v)
        return taken + [v for v in ordered if v not in taken][:count - len(taken)]


def _priced_groups(program: Program, dims: Mapping[sympy.Symbol, int], fixed: Mapping[sympy.Symbol, int],
                   hardware: Hardware, config: CodegenConfig) -> list[_Group]:
    """The `_Group` of each set of kernels tuned together (`_groups`)."""
    free = set(free_symbols(program)) - set(fixed)
    firsts = pairs(program) if config.one_launch else {}  # combining kernel -> the kernel whose launch it may run in
    return [_priced(program, group, {**dims, **fixed}, free, firsts, hardware, config)
            for group in _groups(program, free, firsts)]


def _priced(program: Program, group: list[Kernel], binding: Mapping[sympy.Symbol, int], free: set,
            firsts: Mapping[str, str], hardware: Hardware, config: CodegenConfig) -> _Group:
    """One group of kernels with its candidates and its ranking, each estimate worked out once."""
    by_name = {k.name: k for k in kernels_of(program)}
    syms = sorted({s for k in group for s in _reads(k) if s in free}, key=str)
    cands = [candidates(program, s, binding) for s in syms]
    # a kernel's estimate depends on its own parameters, and a combining kernel's on its first kernel's too
    own = [(k, [i for i, s in enumerate(syms) if s in _reads(k)
                or k.name in firsts and s in _reads(by_name[firsts[k.name]])]) for k in group]
    # (a first kernel whose parameters are all given is in no group: it takes none of `syms`)
    mine_only = {k.name: [i for i, s in enumerate(syms) if s in _reads(k)] for k in by_name.values()}
    memo: dict = {}
    concretes: dict = {}
    prices: dict = {}

    def concrete(k: Kernel, values: tuple[int, ...]) -> Concrete | None:
        """`k` instantiated at `values` of its own parameters (the rest as bound), once: a combining kernel
        is asked for again at every value of its first kernel's parameters, and the first at every value of
        the combining kernel's, and the layout is kept with the concrete kernel (`launch.layout`)."""
        mine = mine_only[k.name]
        key = (k.name, tuple(values[i] for i in mine))
        if key not in concretes:
            concretes[key] = fits(k, {**binding, **{syms[i]: values[i] for i in mine}}, hardware, config)
        return concretes[key]

    def price(k: Kernel, values: tuple[int, ...]) -> tuple:
        """(time, SMs kept busy, L2 bytes, warps up to INTAKE_WARPS, loop iterations) of `k` at `values`. A
        combining kernel's estimate depends on its first kernel only through whether it runs in that kernel's
        launch and on how many threads (`priced`), so it is worked out once per value of those and of its own
        parameters, not once per value of every parameter of the first kernel."""
        if (c := concrete(k, values)) is None:
            return math.inf, 0, 0, 0, 0
        first = concrete(by_name[firsts[k.name]], values) if k.name in firsts else None
        tail = layout(first, config).threads if first is not None and joins(first, c, config) else None
        key = (k.name, tuple(values[i] for i in mine_only[k.name]), tail)
        if key not in prices:
            e = priced(c, first if tail else None, hardware, config)
            prices[key] = (e.time_us, min(e.blocks, hardware.sms), e.l2_bytes, min(e.warps, INTAKE_WARPS),
                           e.blocks * c.loop)
        return prices[key]

    def time_of(values: tuple[int, ...]) -> tuple[float, int, int, float, int]:
        """(estimated time, minus the SMs its kernels keep busy, the bytes they read through L2, minus the
        warps they keep resident on a busy SM up to those whose intake fills it, the loop iterations of all
        their blocks): the order parameters are ranked by. Past that many warps, smaller tiles only add
        iterations, each with its barriers and bookkeeping, which a model priced from the code's structure
        does not see."""
        total, busy, l2, warps, steps = 0.0, 0, 0, 0.0, 0
        for k, mine in own:
            key = (k.name, tuple(values[i] for i in mine))
            if key not in memo:
                memo[key] = price(k, values)
            total, busy, l2 = total + memo[key][0], busy + memo[key][1], l2 + memo[key][2]
            warps, steps = warps + memo[key][3], steps + memo[key][4]
        return round(total, 3), -busy, l2, -warps, steps

    def blocks(values: tuple[int, ...]) -> tuple:
        return tuple(c.blocks() if (c := concrete(k, values)) is not None else 0 for k in group)

    return _Group([k.name for k in group], syms, cands, time_of, blocks)


def _descend(start: tuple[int, ...], cands: list[list[int]], time_of) -> tuple[int, ...]:
    """Local search: the best change of one or two values at a time, until none improves."""
    current, now = start, time_of(start)
    for _ in range(16):
        best = min(_moves(current, cands), key=time_of)
        if time_of(best) >= now:
            break
        current, now = best, time_of(best)
    return current


def _moves(current: tuple[int, ...], cands: list[list[int]]) -> list[tuple[int, ...]]:
    """Every change of one value of `current`, or of two, to other candidates."""
    moves = [current[:i] + (v,) + current[i + 1:] for i, c in enumerate(cands) for v in c]
    return moves + [tuple(v if n == i else w if n == j else x for n, x in enumerate(current))
                    for i, j in itertools.combinations(range(len(cands)), 2) for v in cands[i] for w in cands[j]]


@functools.cache
def _reads(k: Kernel) -> frozenset[sympy.Symbol]:
    """The parameters a kernel's estimate depends on: its own, and those in its inputs' shapes (the pieces of a
    split another kernel stored, which a plain reduction over them walks)."""
    return frozenset(k.symbols().union(*(sympy.sympify(s).free_symbols for n in k.inputs for s in n.shape)))


def _groups(program: Program, free: set, firsts: Mapping[str, str]) -> list[list]:
    """Kernels joined when they share a free parameter (FlashDecoding's split count, say), and a combining
    kernel with the kernel whose launch it may run in (`firsts`: its estimate depends on that one's parameters)."""
    groups: list[list] = []
    by_name = {k.name: k for k in kernels_of(program)}
    for k in kernels_of(program):
        mine = (_reads(k) | (_reads(by_name[firsts[k.name]]) if k.name in firsts else set())) & free
        joined = [g for g in groups if any(mine & (_reads(kk) & free) for kk in g)]
        merged = [k] + [kk for g in joined for kk in g]
        groups = [g for g in groups if g not in joined] + [merged]
    return groups

