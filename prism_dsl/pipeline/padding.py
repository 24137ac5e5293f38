"""Dims rounded up for tiles: the sizes a compile is built for, where no tile divides the size given.

Where it sits: before the search (`compile.compile_program`). Every split of a dim must be exact (a tile is
`D / g / F`), so a prompt of 4099 tokens leaves the projections at prefill one row a tile, on the plain f32
path: rmsnorm_linear at n = 4099, d = 4096 is 7421 us by the model, 29.6 times its 250.9 at n = 4096 (at
n = 4100, 23 times; at 4104 and 4000, 1.5 times, with tiles of 8 and 32 rows). But a dim along which the
program computes element by element (`ir.shapes.independent_dims`: the rows of a projection, attention's
queries) may be built larger: the first D rows of every value are what they would be at D, whatever the rows
past them hold; and a dim it reduces along (attention's keys) may be too, for the programs whose folds mask the
elements past the size given (`kernels.masking`: `masked` names such dims, and only those programs are ranked
there). So for each such dim past ROUNDING that ROUNDING does not divide, the program is also ranked again at
that dim rounded up to a multiple of each quantum in QUANTA (the programs its search proved, and the program as
written, tuned there: `retuned`; the search is not run again), and built at the size whose estimate, with the
copies that pad the inputs and cut the outputs (`copy_us`), beats the size given by more than MARGIN. The
runtime plan gives every tensor's shape as the kernels see it and, where a dim was rounded, as the caller
passes it (`used`): the launcher pads the inputs with zeros (or takes them at the size built, zeros past the
caller's part) and hands back the outputs cut (`backend.cuda_runtime`). The checks draw the inputs at the sizes
given, pad them with zeros, run the kernels at the size built and compare the caller's part of each tensor
(`pipeline.build`); the roofline floor is the size given's.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Collection, Mapping, Sequence

from ..backend.codegen import CodegenConfig
from ..backend.copies import in_place
from ..base import forked
from ..base.errors import PrismError
from ..ir.nodes import Program
from ..ir.shapes import independent_dims
from ..kernels.hardware import Hardware
from ..kernels.masking import refusal
from ..semantics.reference import bind_dims, concrete_shape
from . import optimize
from .report import MARGIN  # the share of the estimate a rounded size must save (the summary says it)

ROUNDING = 64  # a dim this divides is left as it is (wgmma's rows, two tiles of 32 columns)
QUANTA = (64, 128)  # the multiples tried, a dim at a time rounded to each


def candidates(program: Program, dims: dict[str, int], found: Sequence[Program] = ()) -> list[dict[str, int]]:
    """The dims to try besides `dims` (given, by name): every dim past ROUNDING that it does not divide, independent
    or one that a program of `found` (or `program`) computes masked past the end (`kernels.masking`; with the
    others of the try, or else alone), rounded up to each quantum of QUANTA (together); none where no dim is so."""
    binding = bind_dims(program, dims)
    sizes = {d.name: int(binding[d.symbol]) for d in program.dims}
    ragged = {name: n for name, n in sizes.items() if n > ROUNDING and n % ROUNDING}
    tries = []
    for q in QUANTA:
        rounded = {name: -(-n // q) * q for name, n in ragged.items()}
        built = {**sizes, **rounded}

        def masks(names) -> bool:
            return any(refusal(p, {n: sizes[n] for n in names}, built) is None for p in [*found, program])
        folded = masked(program, rounded)
        if not masks(folded):
            kept = [name for name in folded if masks([name])]
            drop = set(folded) - (set(kept) if masks(kept) else set())
            rounded = {name: n for name, n in rounded.items() if name not in drop}
        tries.append(rounded)
    return [t for i, t in enumerate(tries) if t and t not in tries[:i]]


def fastest(program: Program, given: dict[str, int], tries: Sequence[dict[str, int]], hardware: Hardware,
            at_given: float, estimate: Callable[[dict[str, int], dict[str, int]], tuple[float, object]],
            inputs: bool = True, codegen: CodegenConfig = CodegenConfig(),
            tried: list[dict] | None = None) -> tuple[dict[str, int], object]:
    """Of the rounded dims `tries`, the one to build for, and what `estimate(rounded, masking)` gave with its time
    (`masking`: the dims of it built past the size given only masked, with their sizes given; it raises PrismError
    where the program cannot be built there): the fastest with the copies that pad the call (`copy_us`), where that
    beats `at_given`, the estimate at the sizes given, by more than MARGIN; else ({}, None). Each try's figure, or
    why it cannot be built, is added to `tried` (report.json's `padding_tried`)."""
    best: tuple[float, dict[str, int], object] = (at_given, {}, None)
    for rounded in tries:
        masking = {name: given[name] for name in masked(program, rounded)}
        try:
            us, found = estimate(rounded, masking)
            copies = copy_us(program, given, rounded, hardware, inputs, codegen)
            us += copies
        except PrismError as e:
            if tried is not None:
                tried.append({"dims": rounded, "refused": str(e).splitlines()[0]})
            continue
        if tried is not None:
            tried.append({"dims": rounded, "estimated_us": round(us, 3), "copies_us": round(copies, 3)})
        if us < best[0] * (1 - MARGIN):
            best = (us, rounded, found)
    return best[1], best[2]


def masked(program: Program, rounded: Collection[str]) -> list[str]:
    """The dims of `rounded` (by name) that `program` reduces along: built past the size given only masked."""
    free = independent_dims(program.nodes())
    return [d.name for d in program.dims if d.name in rounded and d.symbol not in free]


def copy_us(program: Program, dims: dict[str, int], padded: dict[str, int], hardware: Hardware,
            inputs: bool = True, codegen: CodegenConfig = CodegenConfig()) -> float:
    """What padding costs a call at `padded` (dims by name), as the launcher does it for tensors on the device
    (`backend.cuda_runtime`): each input with a rounded dim read at its size given and written at its size built
    (torch's constant pad: its part and the zeros past it, two launches counted), but those the kernels read in
    place (`masking.read_in_place`, as `codegen` allows); each output
    whose caller's part is not a contiguous prefix of it (rounded past its first dim) read and written at its
    size given, a launch. Not `inputs`: the caller passes them at the sizes built (`cuda_runtime`), no copy."""
    if not padded:
        return 0.0
    rounded = bind_dims(program, {**dims, **padded})
    given = bind_dims(program, dims)
    moved = launches = 0
    codegen = replace(codegen, ends=tuple(sorted((name, dims[name]) for name in padded)))
    for n in program.inputs if inputs else ():
        if in_place(n, codegen):
            continue
        built, used = concrete_shape(n.shape, rounded), concrete_shape(n.shape, given)
        if built != used:
            moved += (math.prod(built) + math.prod(used)) * n.dtype.bytes
            launches += 2
    for _, n in program.outputs:
        built, used = concrete_shape(n.shape, rounded), concrete_shape(n.shape, given)
        first = next((i for i, (b, u) in enumerate(zip(built, used)) if b != u), None)
        if first is not None and (any(b > 1 for b in built[:first]) or built[first + 1:] != used[first + 1:]):
            moved += 2 * math.prod(used) * (n.dtype.bytes if n.dtype else 4)
            launches += 1
    return launches * hardware.launch_overhead_us + moved / (hardware.bandwidth_gbs * 1e3)


def retuned(outcome: optimize.Outcome, program: Program, binding: dict, hardware: Hardware, codegen: CodegenConfig,
            use_cache: bool = True, jobs: int | None = None, masking: Mapping[str, int] = {}) -> optimize.Outcome:
    """`outcome`'s programs (what its search proved that fit the dims given, and `program` as written) ranked again
    at `binding` (dims rounded up), each keeping the proof it had (one from a checkpoint is proved again only
    where it is built, as before): `optimize`'s ranking, not its search. Where dims it reduces along are among those
    rounded up (`masking`: their sizes given, by name), only the programs that compute them masked past those sizes
    (`kernels.masking.refusal`) are ranked. Raises PrismError where none fits."""
    how = optimize.Choosing(binding, hardware, codegen, use_cache=use_cache)
    built = {d.name: int(binding[d.symbol]) for d in program.dims}
    found = [r for r in outcome.ranked if not r.as_written and refusal(r.program, masking, built) is None]
    proved = {id(r.program): r.proved for r in found}
    why = refusal(program, masking, built)
    written = why is None
    if not (found or written):
        raise PrismError(f"no program computes {', '.join(masking)} masked past the size given: {why}")
    programs = [*(r.program for r in found), program][:len(found) + written]
    with optimize.rankers(programs, how, jobs or forked.cores()) as futures:
        ranked, info = optimize.choose_ranked(program, [r.program for r in found], how, None, futures, written)
    if not written:  # not that its pre-defined kernels do not fit: it would compute something else
        info["as_written_fits"], info["as_written_refused"] = None, why
    for r in ranked:  # `choose_ranked` without a prover takes them as proved: they keep what they had
        r.proved = r.as_written or proved[id(r.program)]
    return optimize.Outcome(ranked[0], ranked, {**outcome.search, **info}, outcome.from_checkpoint)
