"""Program assembly, the search's second phase: generated candidates made concrete, checked and proved.

Each custom kernel of a candidate gets its map choices (`maps`, and the `split` of each valid loop
choice). A choice is dropped when a bound no instantiation can meet is broken (shared memory at the
smallest tiles), or when the kernel disagrees numerically with its abstract expression on small random
inputs (a filter that saves proof time; it proves nothing). Every combination of kernel choices that
survives is printed, checked, and PROVED equal to the input program by the e-graph with the layout
axioms, in a pool of egglog processes (`Prover`). Only proved programs are results; their sizes stay
symbolic, so each holds for every binding of the dims.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import numpy as np
import sympy

from ..base.errors import PrismError
from ..ir.nodes import DType, Node, Program, dim_symbol
from ..ir.shapes import ShapeError, rebuild, same_shape
from ..kernels.constraints import shared_memory_at
from ..kernels.hardware import Hardware
from ..kernels.kernel import Kernel, splits
from ..kernels.sizes import value
from ..lang import check
from ..lang.printer import print_program
from ..prove import egglog_runner
from ..prove.egglog_runner import Limits
from ..prove.egraph import compile_library
from ..prove.layout import to_terms
from ..prove.prover import pair_outputs, proof_terms, schedule
from ..prove.rules import Library
from ..semantics.blocks import evaluate
from ..semantics.precision import FLOOR, UNIT
from ..semantics.reference import evaluate_nodes, random_inputs
from .config import Rejection, SearchConfig, Stats
from .generate import Candidate, Predefined, Sketch, meaning_of, small_binding
from .maps import MapChoice, NoKernel, index_classes, map_choices, param_suffix
from .split import Split, build_choice, split_states

PROOF_LIMITS = Limits(iterations=30, nodes=150_000, seconds=20.0)
NUMERIC_RTOL = 1e-6  # float64 on both sides: anything above this is a real difference
FAR = 1e6  # how far from zero `far_inputs` puts each row
STEADY_RTOL = 1e-8  # `steady`: what a candidate may lose on them (the steady lost <= 6e-14, the others >= 3.8e-5)
# ... where an input is f32 or f64, which can sit that far from zero (f16 and bf16 cannot): the check's floor of the
# program's narrowest type short of f64 (`semantics.precision.FLOOR`: 2e-4 where every tensor is f32 or f64, else
# 1e-2), scaled from f32's unit to f64's (2^-29), so that what a candidate loses in float64 there, at the f32
# precision its kernels compute in, stays within what the check allows (`_steady_limit`).
MAX_COMBINATIONS = 64  # kernel-map combinations proved per generated candidate


class Assembly:
    """Program assembly for generated candidates; proofs run in parallel egglog processes."""

    def __init__(self, program: Program, library: Library, hardware: Hardware, config: SearchConfig, stats: Stats,
                 jobs: int, limits: Limits = PROOF_LIMITS):
        self.program, self.library, self.hardware, self.config, self.stats = program, library, hardware, config, stats
        self.small = small_binding(program)
        self.dims = program.default_binding()
        self.dim_names = {d.name for d in program.dims}  # kernel parameters are named apart from them
        self.inputs = random_inputs(program, self.small, seed=1)
        self.seen_texts: set[str] = set()
        self.prover = Prover(program, library, jobs, limits)
        self.kernel_cache: dict = {}
        self.far: list[dict] | None = None  # `steady`'s input sets, and the input program's values on each
        self.far_values: list[dict[str, np.ndarray]] = []

    def close(self) -> None:
        self.prover.close()

    # -- per kernel ------------------------------------------------------------------------------------

    def kernel_options(self, cand: Candidate, sketch: Sketch) -> list[MapChoice | Split]:
        """The map choices of one kernel that pass the static and numeric checks, in canonical order."""
        cache_key = (sketch, tuple(cand.abstracts[i] for i in sketch.inputs))
        if cache_key in self.kernel_cache:
            return self.kernel_cache[cache_key]
        choices, uf, order = map_choices(sketch, self.config)
        placeholders = [Node("input", (), f"in{j}", cand.abstracts[i].dtype, cand.abstracts[i].shape)
                        for j, i in enumerate(sketch.inputs)]
        env = self._values(cand)
        operands = {placeholders[j]: env[cand.abstracts[i]] for j, i in enumerate(sketch.inputs)}
        meanings = [meaning_of(sketch, s, cand.abstracts) for s in sketch.outputs]
        values = evaluate_nodes(meanings, env)
        want = [values[m] for m in meanings]

        def valid(choice: MapChoice | Split) -> bool:
            self.stats.maps += 1
            built = build_choice(sketch, choice, uf, order, "k", param_suffix("", self.dim_names), placeholders,
                                 [f"o{i}" for i in range(len(sketch.outputs))])
            if isinstance(built, NoKernel):
                self.stats.prune(Rejection.MAPS)
                return False
            return self._agrees(*built, placeholders, operands, want)

        good = [choice for choice in choices if valid(choice)]
        # A grid whose axes are a subset of another valid grid's (same loop) is that grid with the
        # extra axes of size 1, which tuning may choose: only the maximal grids go on.
        maximal = [c for c in good if not any(o.loop == c.loop and set(c.grid) < set(o.grid) for o in good)]
        self.stats.prune(Rejection.SUBSUMED_GRID, len(good) - len(maximal))
        if self.config.split_reductions and split_states(sketch) is not None:
            # Every valid choice may be split (the split axis takes the place a subsuming grid's would).
            maximal += [Split(choice) for choice in good if valid(Split(choice))]
        self.kernel_cache[cache_key] = maximal
        return maximal

    def _agrees(self, kernels: list[Kernel], nodes: list[Node], placeholders, operands, want) -> bool:
        """Whether kernels (the last computing `nodes`) fit shared memory at the smallest tiles and agree
        numerically with the abstract expression on small inputs, every split exercised."""
        if not all(smallest_tiles_fit(k, self.dims, self.hardware) for k in kernels):
            self.stats.prune(Rejection.SHARED_MEMORY)
            return False
        mini = Program("k", self.program.dims, tuple(placeholders), tuple((f"o{i}", n) for i, n in enumerate(nodes)))
        params: dict[str, int] = {}
        for k in kernels:
            bound = {**self.small, **{dim_symbol(n): v for n, v in params.items()}}
            params.update({n: v for n, v in _split_params(k, bound).items() if n not in params})
        try:
            got = evaluate(mini, {p.attr: operands[p] for p in placeholders}, params=params)
        except (PrismError, ShapeError, ValueError, IndexError):
            self.stats.prune(Rejection.MAPS)
            return False
        if all(_near(got[f"o{i}"], w) for i, w in enumerate(want)):
            return True
        self.stats.prune(Rejection.NUMERIC)
        return False

    def _values(self, cand: Candidate) -> dict[Node, np.ndarray]:
        env = {n: np.asarray(self.inputs[n.attr], dtype=np.float64) for n in self.program.inputs}
        return evaluate_nodes(list(cand.abstracts), env)

    # -- whole programs --------------------------------------------------------------------------------

    def programs(self, cand: Candidate) -> Iterator[Program]:
        """Each combination of surviving kernel maps as a checked program (printed and parsed back)."""
        options = []
        for step in cand.steps:
            opts = self.kernel_options(cand, step) if isinstance(step, Sketch) else [None]
            if not opts:
                return
            options.append(opts)
        for combo in itertools.islice(itertools.product(*options), MAX_COMBINATIONS):
            prog = self.assemble(cand, combo)
            if prog is not None:
                yield prog

    def assemble(self, cand: Candidate, combo) -> Program | None:
        names = {cand.outputs[i]: name for i, (name, _) in enumerate(self.program.outputs)}
        nodes: list[Node] = list(self.program.inputs)
        customs = 0
        for step, choice in zip(cand.steps, combo):
            base = len(nodes)
            if isinstance(step, Predefined):
                nodes.append(rebuild(step.op, [nodes[a] for a in step.args]))
                continue
            customs += 1
            uf, order = index_classes(step)
            store_names = [names.get(base + i, f"t{base + i}") for i in range(len(step.outputs))]
            built = build_choice(step, choice, uf, order, f"fused{customs}" if len(cand.steps) > 1 else "fused",
                                 param_suffix("" if customs == 1 else str(customs), self.dim_names),
                                 [nodes[i] for i in step.inputs],
                                 store_names, base)
            if isinstance(built, NoKernel):
                return None
            nodes += built[1]
        outs = tuple((name, nodes[cand.outputs[i]]) for i, (name, _) in enumerate(self.program.outputs))
        for (name, node), (_, want) in zip(outs, self.program.outputs):
            if not same_shape(node.shape, want.shape):
                self.stats.prune(Rejection.SHAPE)
                return None
        names_map = {nodes[i]: f"t{i}" for i in range(len(self.program.inputs), len(nodes)) if i not in names}
        prog = Program(self.program.name, self.program.dims, self.program.inputs, outs, {}, names_map, self.program.loc)
        text = print_program(prog, keep_names=False)
        if text in self.seen_texts:
            self.stats.prune(Rejection.DUPLICATE)
            return None
        self.seen_texts.add(text)
        try:
            return check.load("<candidate>", text).program()
        except PrismError:
            self.stats.prune(Rejection.CHECKER)
            return None

    def prove(self, candidate: Program) -> Future:
        self.stats.proofs += 1
        return self.prover.submit(candidate)

    def steady(self, candidate: Program) -> bool:
        """Whether the candidate keeps, in float64, what the input program gives on inputs whose rows sit far from
        zero (`far_inputs`): a rewrite exact in real numbers may cancel or overflow there where the input does not
        (LayerNorm's variance as E[x^2] - E[x]^2, as f32 loses it at offsets of a few tens; a softmax written
        out turned into exp(x) / sum(exp(x))), and its kernels would carry that into f32 and f16. On the
        benchmark programs the steady candidates came within 6e-14 of the input's values, LayerNorm's moments
        3.8e-5 from them. A program with an f32 or f64 input is held closer (`_steady_limit`): LayerNorm's centring
        moved through its product (X @ W - mean(X) * colsum(W)), 1.5e-10 from the input's values there, missed an
        f32 check at rows 100 times their spread from zero, where the program as written met it."""
        if self.far is None:  # rows far from zero along the last dim, and whole tensors (a transposed one's rows)
            self.far = [far_inputs(self.program, self.small, seed=2, whole=whole) for whole in (False, True)]
            self.far_values = []
            for inputs in self.far:
                try:
                    self.far_values.append(evaluate(self.program, inputs))
                except (PrismError, ShapeError, ValueError, IndexError):
                    self.far_values.append({})
        limit = _steady_limit(self.program)
        for inputs, values in zip(self.far, self.far_values):
            try:
                got = evaluate(candidate, inputs, prefer="split")
            except (PrismError, ShapeError, ValueError, IndexError):
                return True  # no value here: the proof and the other checks judge it
            if not all(_lost(want, got[name]) <= limit for name, want in values.items() if name in got):
                return False
        return True


def _steady_limit(program: Program) -> float:
    """What a candidate may lose far from zero (STEADY_RTOL, and the comment below it)."""
    if not any(n.dtype in (DType.F32, DType.F64) for n in program.inputs):
        return STEADY_RTOL
    stored = {n.dtype.value for n in [*program.inputs, *(v for _, v in program.outputs)] if n.dtype is not DType.F64}
    return max((FLOOR[d] for d in stored), default=FLOOR["f32"]) * UNIT["f64"] / UNIT["f32"]


def far_inputs(program: Program, binding, seed: int, whole: bool = False) -> dict[str, np.ndarray]:
    """Random inputs (`random_inputs`, unrounded) with every row offset from zero by FAR/2 to FAR of either sign, the
    same offset along the row: activations whose mean dwarfs their spread. `whole`: one offset for the whole
    tensor, so that its columns (the rows of a transposed tensor, say) sit far from zero as well; there the
    weights (a product's right operand, which no such offset models: it would make the input program itself
    cancel, x @ (c + w) with the rows of x summing to 0) keep their values as drawn."""
    rng = np.random.default_rng(seed)
    weights = set()
    for m in program.nodes():
        if m.op == "matmul":
            b = m.args[1]
            while b.op == "transpose":
                b = b.args[0]
            if b.op == "input":
                weights.add(b.attr)
    out = {}
    for name, a in random_inputs(program, binding, seed).items():
        if whole and name in weights:
            out[name] = a
            continue
        row = () if whole or not a.ndim else a.shape[:-1] + (1,)
        out[name] = a + rng.choice([-FAR, FAR], size=row) * rng.uniform(0.5, 1.0, size=row)
    return out


def _lost(want: np.ndarray, got: np.ndarray) -> float:
    """The largest difference where the input's value is finite, over its largest magnitude; infinite where the
    candidate is not finite there (it overflowed, or is NaN) or has another shape."""
    if want.shape != got.shape:
        return float("inf")
    finite = np.isfinite(want)
    if not finite.any():
        return 0.0
    if not np.isfinite(got[finite]).all():
        return float("inf")
    return float(np.abs(want[finite] - got[finite]).max()) / max(float(np.abs(want[finite]).max()), 1e-300)


class Prover:
    """Proofs that candidates equal one program, in a pool of egglog sessions (one per thread, each
    loaded with the library once). A future's result is True only for a proof of every output; a
    candidate that cannot even be written as terms next to the program (other outputs) is not proved.
    A proof that cannot run (its egglog worker died, egglog rejected the terms) raises in its future:
    `proof_error` reads that as an error, which is not a "not proved". Used by the search, and by the
    compile pipeline to prove again what it takes from the checkpoint."""

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
        return self.pool.submit(self.prove, candidate)

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

    def prove(self, candidate: Program) -> bool:
        """One proof, in this thread's egglog session (started on its first proof)."""
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
        setup, goals = proof_terms(to_terms(candidate), to_terms(self.program), self.pairs)
        try:
            outcome = session.run(setup, goals, schedule(list(self.library.rulesets)), self.limits)
        finally:
            with self.lock:
                if self.closed:
                    session.close()
        return all(outcome.proved)


def proof_error(future: Future) -> str | None:
    """Why a finished proof could not run (the exception it raised, in words), or None when it ran."""
    error = future.exception()
    return None if error is None else f"{type(error).__name__}: {error}"


def smallest_tiles_fit(kernel: Kernel, dims: dict, hardware: Hardware) -> bool:
    """Shared memory with every split as fine as it can be (grid sizes and F at the sizes they split):
    if even that does not fit, no instantiation does."""
    biggest: dict[sympy.Symbol, int] = {}
    for size, splitters in splits(kernel):
        full = value(size, dims)
        if full is None:
            continue  # a size set by another kernel's parameter (a split's number of pieces)
        for sym in splitters:
            if isinstance(sym, sympy.Symbol) and sym not in dims:
                biggest[sym] = min(biggest.get(sym, full), full)
    smem = shared_memory_at(kernel, {**dict.fromkeys(kernel.symbols(), 1), **dims, **biggest})
    return smem is None or smem <= hardware.smem_per_block


def _split_params(kernel: Kernel, dims: dict) -> dict[str, int]:
    """Grid sizes and loop range for the numeric filter: 2 wherever that divides what they split (so
    every split and the loop are exercised), else 1."""
    def halves(size, splitters) -> bool:  # 2 for every symbol that splits this dim divides it
        full = value(size, dims)
        return full is not None and full % 2 ** len(splitters) == 0

    syms = [s for s in [g for _, g in kernel.grid] + [kernel.loop] if isinstance(s, sympy.Symbol)]
    return {s.name: 2 if all(halves(*d) for d in splits(kernel) if s in d[1]) else 1 for s in syms}


def _near(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape or not (np.isfinite(got).all() and np.isfinite(want).all()):
        return False
    scale = max(float(np.abs(want).max()), 1e-30)
    return float(np.abs(got - want).max()) / scale <= NUMERIC_RTOL
