"""The compile pipeline's search and choice: the proved programs of the input, ranked, the fastest first.

    checkpoint   the proved programs of a complete search (`search.checkpoint`), reused for any binding
                 of the dims; trusted for nothing: each one that is chosen or timed is proved again
                 first, and one that fails discards the checkpoint (the search runs again and replaces it)
    search       kernel generation and program assembly (`search.driver`), when there is no usable checkpoint
    tune         per proved program, kernel parameters for the dims chosen by the cost model; on a GPU
                 (`--rank measure`) the best few by the model, and the best of each other shape, are then
                 built, checked against the float64 reference of the input program and timed, and the
                 fastest of those again with the model's next best kernel parameters (`measuring`). Both go
                 into the tuning database (user cache): the model's choice keyed by structure, dims, hardware
                 and the model's code; a measured time also by the GPU, its driver and the generated code's
                 sources. An entry is used only when it is valid here: parameters
                 that meet every kernel's constraints at these dims, a finite positive time
    choose       the fastest; the program as written (pre-defined kernels) competes too, so the answer is
                 never worse than it and is it when nothing better was found

The tuning database is the pipeline's (it holds what the cost model and the GPU said of built programs).
Every cache record is written atomically; a record that cannot be read, parsed or used is reported once
and ignored (`cache`), and what it held is computed again.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace

from ..backend import cost, tuning
from ..backend.codegen import CodegenConfig
from ..base import cache, forked
from ..base.errors import PrismError
from ..ir.nodes import Program
from ..kernels.hardware import Hardware
from ..kernels.kernel import free_symbols, kernels_of
from ..kernels.lower import lowered_forms
from ..lang.syntax import clip
from ..prove.rules import Library
from ..search.checkpoint import (SEARCH_VERSION, checkpoint_key, discard, has_checkpoint, is_count, is_time,
                                 load_checkpoint, save_checkpoint, structure)
from ..search.assembly import Prover, proof_error
from ..search.config import SearchConfig, Stats
from ..search.driver import search
from . import build
from .measuring import (MODEL_CODE, Measure, Ranked, Timing, dims_key, measure_best, time_parameters,
                        to_measure, usable)

TOP = 5  # alternatives listed in report.json
WIDER_GAIN = 0.98  # twice the threads are taken where the model's estimate is at most this share of it at --threads
FEW_WARPS = 8  # or no higher, where a memory-bound kernel has fewer warps than this on an SM (`rank`)


@dataclass
class Outcome:
    best: Ranked
    ranked: list[Ranked]
    search: dict  # what report.json says of the search
    from_checkpoint: bool


def tuning_key(program: Program, binding: dict, hardware: Hardware, codegen: CodegenConfig = CodegenConfig()) -> str:
    """The model's parameters and estimate for a program at some dims on a hardware, for the code `codegen`
    asks for (threads, tensor cores, wgmma, pipeline stages)."""
    return cache.digest("tuning", SEARCH_VERSION, cache.code_digest(*MODEL_CODE), structure(program, names=True),
                        dims_key(binding), hardware.name, json.dumps(sorted(vars(codegen).items())))


def rank(program: Program, binding: dict, hardware: Hardware, codegen: CodegenConfig,
         use_cache: bool = True) -> Ranked | None:
    """Parameters, threads per block and estimated time for one program at these dims, from the tuning database
    when it has a valid entry for them (`_tuning_problem`); an invalid one is reported once, and tuned again.
    `use_cache` False (`--no-cache`): the database is neither read nor written.

    The threads are `codegen.threads` (a least count), or twice that for the same parameters (only
    where a kernel is bound by memory with fewer warps on a busy SM than fill its intake, `tuning.INTAKE_WARPS`)
    where the model's estimate is then lower by a margin (WIDER_GAIN: not where the two differ in their last
    digits), or no higher where such a kernel has fewer than FEW_WARPS warps on an SM: where the bandwidth's ceiling
    binds the model sees no gain in more warps, but `benchmarks/gpu_probe.py` measured one block's intake grow 1.7x
    from 4 warps to 8 (7.3 bytes a clock to 12.4, H200) and 1.3x from 8 to 16. (The parameters are not tuned again
    at twice the threads: that would double the tuning of every program the search proves, for what `--rank
    measure` times anyway, `measuring.parameter_choices`.)"""
    forms = lowered_forms(program, binding)  # the usual form, and those for long rows where there are
    key = tuning_key(program, binding, hardware, codegen)
    hit = usable("tuning", key, lambda h: _tuning_problem(h, forms, binding, hardware, codegen), "tuning entry",
                 "tuning") if use_cache else None
    if hit is not None:
        return Ranked(program, dict(hit["params"]), float(hit["us"]), hit["busy"], hit["work"],
                      threads=hit.get("threads"))
    best, _ = build.fastest_form(forms, binding, hardware, codegen)  # each form that fits, the faster taken
    if best is None:
        return None  # no valid parameters at these dims (a tile that does not fit, say)
    threads = None
    # the warps on an SM of each kernel bound by memory in a launch of its own (a combining kernel runs on its first
    # kernel's threads): where they are fewer than fill its intake, the same form and parameters at twice the threads
    starved = [e.warps for e in best[3] if e.bound == "memory" and e.launched_by is None]
    if 2 * codegen.threads <= hardware.max_threads_per_block and any(w < tuning.INTAKE_WARPS for w in starved):
        wider = replace(codegen, threads=2 * codegen.threads)
        other, _ = build.fastest_form([best[0]], binding, hardware, wider, lambda form: best[1])
        mine, theirs = sum(e.time_us for e in best[3]), None if other is None else sum(e.time_us for e in other[3])
        few = any(w < FEW_WARPS for w in starved)
        if theirs is not None and (theirs < WIDER_GAIN * mine or few and round(theirs, 3) <= round(mine, 3)):
            best, threads = other, wider.threads
    _, params, _, estimates = best
    us = sum(e.time_us for e in estimates)
    busy = round(sum(e.time_us * min(e.blocks, hardware.sms) for e in estimates) / us)  # a kernel at a time
    work = sum(e.flops + e.tensor_core_flops for e in estimates)
    if use_cache:
        cache.write("tuning", key, {"params": params, "us": us, "busy": busy, "work": work, "threads": threads})
    return Ranked(program, params, us, busy, work, threads=threads)


def _tuning_problem(hit, forms: list[Program], binding: dict, hardware: Hardware, codegen: CodegenConfig) -> str | None:
    """What makes a tuning entry unusable for the program at these dims (lowered in one of its `forms`), or None:
    the first form's problem where every form has one."""
    problems = (_form_problem(hit, lowered, binding, hardware, codegen) for lowered in forms)
    first = next(problems)
    return None if first is None or None in problems else first


def _form_problem(hit, lowered: Program, binding: dict, hardware: Hardware, codegen: CodegenConfig) -> str | None:
    """What makes a tuning entry unusable for this (lowered) program at these dims, or None: its
    parameters must be exactly the program's kernel parameters, whole numbers from 1, under which every
    kernel meets its constraints for the code `codegen` asks for (`tuning.fits`); its time a finite positive number;
    its busy SMs a whole number from 1 to the hardware's SMs; its work a whole number."""
    if not isinstance(hit, dict) or not isinstance(hit.get("params"), dict):
        return "no parameters"
    params, us = hit["params"], hit.get("us")
    if not is_time(us):
        return f"the time {clip(repr(us))} is not a finite positive number"
    if not is_count(hit.get("busy")) or not 1 <= hit["busy"] <= hardware.sms:
        return f"the busy SMs {clip(repr(hit.get('busy')))} are not a whole number from 1 to {hardware.sms}"
    if not is_count(hit.get("work")):
        return f"the work {clip(repr(hit.get('work')))} is not a whole number"
    if (threads := hit.get("threads")) is not None and not (is_count(threads) and threads == 2 * codegen.threads):
        return f"the threads {clip(repr(threads))} are neither null nor {2 * codegen.threads}"
    if threads is not None:
        codegen = replace(codegen, threads=threads)
    symbols = {s.name: s for s in free_symbols(lowered)}
    if set(params) != set(symbols):
        return f"parameters {clip(repr(sorted(params)))} are not the program's ({', '.join(symbols) or 'none'})"
    bad = [n for n, v in params.items() if not is_count(v) or v < 1]
    if bad:
        return f"{', '.join(bad)} not a whole number from 1"
    full = {**binding, **{symbols[n]: v for n, v in params.items()}}
    config = cost.for_hardware(codegen, hardware)
    broken = [k.name for k in kernels_of(lowered) if tuning.fits(k, full, hardware, config) is None]
    if broken:
        return f"the parameters break the constraints of kernel {', '.join(broken)} at these dims"
    return None


class Progress:
    """One status line on stderr, rewritten in place; silent when stderr is not a terminal."""

    def __init__(self, enabled: bool, started: float) -> None:
        self.enabled = enabled and sys.stderr is not None and sys.stderr.isatty()  # (None: closed)
        self.started = started
        self.last = 0.0

    def __call__(self, phase: str, stats: Stats) -> None:
        self._line(f"search: {phase}; {stats.candidates} candidates, {stats.proofs} proofs, {stats.proved} proved")

    def tuning(self, done: int, total: int) -> None:
        """While the proved programs are tuned (seconds each where the model tries thousands of parameter
        choices, and the line would otherwise be still)."""
        self._line(f"tuning: {done} of {total} programs")

    def _line(self, text: str) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.2:
            return
        self.last = now
        print(f"\r\x1b[2K{text}; {now - self.started:.1f} s", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled:
            print("\r\x1b[2K", end="", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Choosing:
    """How the proved programs are ranked and timed: the dims, the hardware, the GPU's timer (if any)."""

    binding: dict
    hardware: Hardware
    codegen: CodegenConfig = CodegenConfig()  # the code the programs are ranked as (threads, paths, stages)
    measure: Measure | None = None
    device: str = ""
    use_cache: bool = True
    show: Progress | None = None  # the status line, told how far the tuning is


def optimize(program: Program, library: Library, hardware: Hardware, binding: dict, *, config: SearchConfig = SearchConfig(),
             time_limit: float | None = None, jobs: int | None = None, codegen: CodegenConfig = CodegenConfig(),
             use_cache: bool = True,
             progress: bool = False, stop_event: threading.Event | None = None,
             measure: Measure | None = None, device: str = "") -> Outcome:
    """Search (or reuse the checkpoint), tune every proved program by the model, and choose the fastest;
    with `measure` (on a GPU named by `device`), the programs `measuring.to_measure` picks are timed and the fastest
    of those that agreed with the reference is chosen.

    A checkpoint is trusted for nothing: the program chosen from it, and every one timed, is proved equal
    to `program` again first (`_from_checkpoint`). One that fails its proof discards the checkpoint: it
    is reported once, the search runs and its result replaces the entry."""
    started = time.perf_counter()
    key = checkpoint_key(program, library, config, hardware)
    jobs = jobs or forked.cores()
    show = Progress(progress, started)
    how = Choosing(binding, hardware, codegen, measure, device, use_cache, show)
    try:
        chosen = _from_checkpoint(program, library, key, how, jobs) if use_cache else None
    finally:
        show.done()
    if chosen is None:
        deadline = started + time_limit if time_limit else None
        try:
            result = search(program, library, hardware, config, jobs=jobs, deadline=deadline, progress=show,
                            stop_event=stop_event)
            if result.complete and not result.stats.errors and use_cache:  # a crashed proof would lose a program
                save_checkpoint(key, result)
            with rankers([*result.proved, program], how, jobs) as futures:
                ranked, info = choose_ranked(program, result.proved, how, None, futures)
        finally:
            show.done()
        chosen = ranked, {"from_checkpoint": False, "complete": result.complete, "stopped": result.stopped,
                          "jobs": jobs, **result.stats.as_dict(), "seconds": round(result.seconds, 3),
                          "input_egraph": result.input_egraph, "reproved": 0, **info}
    ranked, info = chosen
    info["search_seconds"] = round(time.perf_counter() - started, 3)
    return Outcome(ranked[0], ranked, info, info["from_checkpoint"])


def _from_checkpoint(program: Program, library: Library, key: str, how: Choosing,
                     jobs: int) -> tuple[list[Ranked], dict] | None:
    """`choose_ranked` over the checkpoint's programs, proving in this run each one that is timed or chosen;
    None when there is no usable checkpoint, or when one of them is not proved (reported once: the
    caller searches again and replaces the entry).

    Proving every saved program would cost more than the rest of a recompile (25 proofs of up to 1.4 s
    each for attention): only what can reach the user or the GPU is proved, without a GPU one proof in
    one egglog process. That process starts (most of a second) while the checkpoint is read and its
    programs are ranked, so that the proof waits for little (after the rankers are forked: `rankers`)."""
    if not has_checkpoint(key):
        return None
    prover = Prover(program, library, 1 if how.measure is None else jobs)
    try:
        saved = load_checkpoint(program, key)
        chosen = None
        if saved is not None:
            with rankers([*saved[0], program], how, jobs) as futures:
                prover.warm(1 if how.measure is None else jobs)
                chosen = choose_ranked(program, saved[0], how, prover, futures)
    finally:
        prover.close()
    if saved is None:
        return None
    if isinstance(chosen, str):
        discard(key, f"checkpoint entry for '{program.name}' {chosen}; searching again")
        return None
    ranked, info = chosen
    # the keys a search gives, as it was saved: a search with errors is never saved, and its e-graph is not kept
    return ranked, {"from_checkpoint": True, "complete": True, "stopped": None, "jobs": jobs, "errors": [],
                    "input_egraph": {}, **saved[1], **info,
                    "reproved": sum(r.proved and not r.as_written for r in ranked)}


def choose_ranked(program: Program, proved: list[Program], how: Choosing, prover: Prover | None,
                  futures: list[Future] | None = None, as_written: bool = True) -> tuple[list[Ranked], dict] | str:
    """Every program that fits these dims ranked, the chosen one first, with what report.json says of it.
    `proved` are proved already when `prover` is None; else `prover` proves those to be timed and the
    chosen one, and the answer is why not when one of them is not proved. `futures`: `rankers` of `proved`
    and then `program` (not `as_written`: `program` is not ranked), which rank them in forked processes."""
    ranks: list[Ranked | None] = []
    if how.show is not None:
        how.show.tuning(0, len(proved))
    for i, r in enumerate(_ranked(futures, [*proved, program][:len(proved) + as_written], how)):  # in order
        if how.show is not None and i < len(proved):
            how.show.tuning(i + 1, len(proved))
        ranks.append(r)
    ranked = [r for r in ranks[:len(proved)] if r is not None]
    unfit = len(proved) - len(ranked)
    for r in ranked:
        r.proved = prover is None
    written = ranks[-1] if as_written else None
    if written is not None:
        written.as_written = written.proved = True  # the input itself
        ranked.append(written)
    elif not ranked:
        raise PrismError(f"'{program.name}' has no valid kernel parameters at these dims, neither as written nor in "
                         f"any of the {len(proved)} proved programs (--search none says why as written)")
    info: dict = {"as_written_fits": written is not None}  # False: its pre-defined kernels cannot run here
    # Between equal estimates, the one that keeps more SMs busy (as `tuning.tune` does: the model's bandwidth
    # is a ceiling it reaches with few SMs as with many, which the hardware does not promise), then the one
    # that does less work (where memory or a pipeline's latency binds, the flops beside it are not free on a
    # GPU that runs other work, and they are what the model knows least), then the program as written;
    # stable: search order breaks the remaining ties.
    ranked.sort(key=lambda r: (round(r.estimated_us, 3), -r.busy, r.work, not r.as_written))
    if how.measure is not None:
        if problem := confirm(to_measure(ranked), prover):
            return problem
        timing = Timing(how.binding, how.hardware, how.codegen, how.measure, how.device, how.use_cache)
        info["measured"] = measure_best(ranked, timing)
        # The fastest that agreed with the reference; then the rest, by the model.
        ranked.sort(key=lambda r: (r.measured_us is None, r.measured_us or 0.0, r.measured is not None,
                                   r.estimated_us))
        if ranked[0].measured_us is not None:  # and it again with other kernel parameters, the fastest kept
            ranked[0], counts = time_parameters(ranked[0], timing)
            info["measured"]["timed"] += counts["timed"]
            info["measured"]["from_database"] += counts["from_database"]
            info["measured"]["parameters"] = ranked[0].timed
    if problem := confirm(ranked[:1], prover):
        return problem
    info["proved_programs"] = len(proved)
    info["no_parameters_at_these_dims"] = unfit
    return ranked, info


_FORKED: tuple | None = None  # (programs, how) for the forked rankers, set before they are forked
_AGAIN = "again"  # a forked ranker's answer when `rank` raised there: ranked again in the parent


@contextlib.contextmanager
def rankers(programs: list[Program], how: Choosing, jobs: int):
    """Futures of `rank` of each of `programs` (as `_rank_forked` gives it), in up to `jobs` processes forked
    here (`base.forked`), or None where one process ranks them: fewer than two programs or jobs, or where forking
    is not safe (the checkpoint's prover starts its egglog session only after this). Each program's tuning is
    independent and seconds long where the model tries thousands of parameter choices; the processes share
    the tuning database as separate runs do (every write atomic)."""
    global _FORKED
    if not forked.usable(jobs, len(programs)):
        yield None
        return
    _FORKED = (programs, how)
    try:
        with forked.pool(min(jobs, len(programs))) as pool:
            yield [pool.submit(_rank_forked, i) for i in range(len(programs))]
    finally:
        _FORKED = None


def _ranked(futures, programs: list[Program], how: Choosing):
    """Each program's `rank`, in order: from its future, with the warnings its process gave (`cache.relay`), or
    here where there is none, where the forked process died (the pool is then broken: what it had not given
    back is ranked here), or where `rank` raised there (here it raises, or not, as one process would)."""
    for i, p in enumerate(programs):
        got: object = _AGAIN
        if futures is not None:
            with contextlib.suppress(BrokenProcessPool):
                got, reports = futures[i].result()
                cache.relay(reports)
        if got == _AGAIN:
            got = rank(p, how.binding, how.hardware, how.codegen, how.use_cache)
        yield Ranked(p, *got[:4], threads=got[4]) if isinstance(got, tuple) else got


def _rank_forked(i: int) -> tuple[tuple | str | None, dict[str, str]]:
    """In a forked ranker: `rank` of the i-th program `rankers` was given, as (params, estimate, busy, work,
    threads), or
    `_AGAIN`; and the warnings it gave (`cache.said`), which the parent prints, its stderr not being the
    parent's `sys.stderr` (a test's captured one, say)."""
    programs, how = _FORKED
    before = cache.said()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            r = rank(programs[i], how.binding, how.hardware, how.codegen, how.use_cache)
    except Exception:  # raised again, or not, where the parent ranks it
        return _AGAIN, {}
    reports = {about: message for about, message in cache.said().items() if about not in before}
    return (None if r is None else (r.params, r.estimated_us, r.busy, r.work, r.threads)), reports


def confirm(ranked: list[Ranked], prover: Prover | None) -> str | None:
    """Prove (in parallel) those of `ranked` not proved in this run; None when every one is proved now,
    else why not. A proof that could not run (a killed or failed egglog process) proves nothing, and is
    told apart from a proof that ran and failed."""
    todo = [(r, prover.submit(r.program)) for r in ranked if not r.proved] if prover is not None else []
    errors = []
    for r, future in todo:
        errors.append(proof_error(future))
        r.proved = errors[-1] is None and future.result() is True
    if all(r.proved for r in ranked):
        return None
    crashed = [e for e in errors if e]
    return f"could not be proved again ({crashed[0]})" if crashed else "failed its proof"
