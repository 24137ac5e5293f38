"""The checker catches what it claims: generated kernels of the programs in programs/ and programs/fused/,
each with one planted bug, are reported by the emulation (a finding, or outputs that disagree), and the
same kernels unmutated pass the sanitizers (both on every kernel of a kind no other program has).

Each mutation is a text edit of a generated .cu, as a person editing one might make it; it applies to the
first kernel of a program that has the code it edits (a program without such code skips it), and every
mutation applies to some program.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import cache

import pytest

from prism_dsl.backend import emulate
from prism_dsl.pipeline import emulation
from prism_dsl.pipeline.build import check_inputs, plan_of, reference_outputs, rtol_of
from test_codegen import FUSED, GOLDEN_PARAMS, PROGRAMS, build_of

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the emulation")
ALL = FUSED + PROGRAMS
# The planted bugs go into the hand-written kernels and into the programs as written whose pre-defined kernels
# are of a kind no other program has (the others repeat matmul, rms_norm, softmax, transposed-operand and
# element-wise kernels).
REPEATS = {"rmsnorm_mlp", "swiglu", "qk_norm_attention", "gqa", "lora", "ntrans", "llama_qkv", "gqa_decode",
           "llama_mlp"}
# The hand-written causal kernel is attention's online softmax in registers with a mask and RoPE steps: the
# mutations (generic edits of barriers, copies, indices) have fused/attention's kernel to catch them in.
# fused/swiglu's kernel is fused/rmsnorm_mlp's (the gated products on shared fragments) without the row sums.
PLANTED = ([p for p in FUSED if p.stem not in ("causal_attention", "swiglu")]
           + [p for p in PROGRAMS if p.stem not in REPEATS])
# Both sanitizers on every hand-written kernel and every program whose kernels are of a kind no other has
# (fused/swiglu's kernel is fused/rmsnorm_mlp's steps: AddressSanitizer alone). The repeats' kernels are the
# same code at other shapes: the plain emulation runs them (test_codegen, test_search).
SANITIZED = [(p, s) for p in ALL for s in emulate.SANITIZERS
             if (p.parent.name == "fused" and (p.stem != "swiglu" or s == "address"))
             or (p.parent.name != "fused" and p.stem not in REPEATS)]


def _active(lines: list[str]) -> list[bool]:
    """Which lines the emulation compiles: not those of the plain path beside a tensor-core one (#else)."""
    out, skipping = [], False
    for line in lines:
        s = line.strip()
        skipping = True if s == "#else" else False if s == "#endif" else skipping
        out.append(not skipping)
    return out


def remove_barrier(src: str, grid) -> str | None:
    """The barrier between a tile's copy and its readers: in a pipelined loop the one after the wait for the
    iteration's tiles, else the one after the loop's first load step (or the first load's, with none in the
    loop). (The prologue's can be redundant: a barrier in the loop may follow.)"""
    lines = src.splitlines(keepends=True)
    landed = next((i for i, l in enumerate(lines) if "this iteration's tiles have landed" in l), None)
    if landed is not None:
        at = next(i for i in range(landed, len(lines)) if lines[i].strip().startswith("__syncthreads();"))
        return "".join(lines[:at] + lines[at + 1:])
    loop = next((i for i, l in enumerate(lines) if "for (int it = 0;" in l), 0)
    loads = [i for i, l in enumerate(lines) if "= load " in l and l.strip().startswith("//")]
    first_load = next((i for i in loads if i > loop), loads[0] if loads else None)
    if first_load is None:
        return None
    at = next((i for i in range(first_load, len(lines)) if lines[i].strip() == "__syncthreads();"), None)
    return None if at is None else "".join(lines[:at] + lines[at + 1:])


def drop_block_index(src: str, grid) -> str | None:
    """A store's offset for one grid axis with several blocks: they all write the same elements."""
    store = src.find("// store ")
    several = "".join(a for a, g in zip("xyz", grid) if g > 1)
    if store < 0 or not several:
        return None
    m = re.compile(rf"blockIdx\.[{several}](?: \* \d+)*").search(src, store)
    if not m:
        return None
    before, after = src[: m.start()], src[m.end():]
    if after.startswith(" + "):
        after = after[3:]
    elif before.endswith(" + "):
        before = before[:-3]
    else:
        return before + "0" + after
    return before + after


def skip_warp_reduction(src: str, grid) -> str | None:
    """A warp's sum; a shuffle that adds the threads' parts of a row sum after the loop (`row_parts`); in
    online softmax in registers, a shuffle of the row sums over a row's 4 lanes; a shuffle that adds a row's
    lanes' parts in a row-wise op (`row_parts.rowwise`: rms_norm's sum of squares, softmax's sum); or, where
    there is none of those, a warp's max (online softmax's running max only guards exp against overflow, so skipping it
    changes nothing the check can see at these sizes, and it is the last resort)."""
    for pattern in (r"^\s*part = prism::warp_sum\(part\);\n", r"^\s*part \+= prism::shfl_xor\(part, \d+\);\n",
                    r"^\s*sum \+= prism::shfl_xor\(sum, 2\);\n", r"^\s*(ss|sum) \+= prism::shfl_xor\(\1, \d+\);\n",
                    r"^\s*part = prism::warp_max\(part\);\n"):
        new = re.sub(pattern, "", src, count=1, flags=re.M)
        if new != src:
            return new
    return None


def shift_tensor_core_load(src: str, grid) -> str | None:
    """A wmma fragment's pointer, or else an ldmatrix row address, one element off."""
    new = re.sub(r"(wmma::load_matrix_sync\(a, )([^,]+)", r"\1\2 + 1", src, count=1)
    if new == src:
        new = re.sub(r"(prism::ldmatrix<\d(?:, true)?>\(\w+(?:\[\w\])?, )([^;]+)\);", r"\1\2 + 1);", src, count=1)
    return None if new == src else new


def read_past_tile(src: str, grid) -> str | None:
    """One more element in the first loop over a tile after the loads: a read past the tile's end. Of the forms
    of a step's loop (templates/steps.j2, `each`), one guarded pass (`if (const int e = ...; e < N)`) takes
    one more element by its bound; passes counted from 0 (`for (int e0 = 0; e0 < N; ...)`) take one more
    pass with every item past N + 1 stopped (a ragged last pass's own stop moves by one). One unguarded pass
    of every thread (`{ const int e = ...;`) is passed over."""
    lines = src.splitlines(keepends=True)
    active = _active(lines)
    start = next((i for i, l in enumerate(lines) if "cp_async_wait_all" in l or "= load " in l), 0)
    start = next((i for i in range(start, len(lines)) if lines[i].strip() == "__syncthreads();"), start)
    once = re.compile(r"if \(const int (?:k|j|e|row) = [^;]+; \w+ < \d+\)")  # not the loop's, nor a load's
    passes = re.compile(r"for \(int (k|j|e|row)0 = 0; \w+ < (\d+);")
    for i in range(start, len(lines)):
        if not active[i]:
            continue
        if m := once.search(lines[i]):
            lines[i] = lines[i][: m.end() - 1].replace(" < ", " <= ") + lines[i][m.end() - 1:]
            return "".join(lines)
        if m := passes.search(lines[i]):
            var, n = m.groups()
            lines[i] = lines[i].replace(f" < {n};", f" <= {n};", 1)
            stop = f"if ({var} >= {n}) break;"
            pad = lines[i + 1][: len(lines[i + 1]) - len(lines[i + 1].lstrip())]
            if stop in lines[i + 2]:
                lines[i + 2] = lines[i + 2].replace(stop, f"if ({var} > {n}) break;")
            else:
                lines.insert(i + 2, f"{pad}if ({var} > {n}) break;\n")
            return "".join(lines)
    return None


def remove_cp_async_wait(src: str, grid) -> str | None:
    """The loop's wait (the prologue's can be redundant: the loop's first wait covers its copies too); in a
    pipelined loop, the wait for the stage about to be read."""
    loop = src.find("for (int it = 0;")
    m = re.compile(r"^\s*prism::cp_async_wait(?:_all\(\)|<\d+>\(\));.*\n", re.M)
    found = (m.search(src, loop) if loop >= 0 else None) or m.search(src)
    return None if not found else src[: found.start()] + src[found.end():]


# name: (edit, the sanitizer the emulation runs under)
MUTATIONS = {
    "remove a barrier": (remove_barrier, "thread"),
    "drop a block index from a store": (drop_block_index, None),
    "skip a warp reduction": (skip_warp_reduction, None),
    "shift a tensor-core load": (shift_tensor_core_load, None),
    "read past a tile's end": (read_past_tile, "address"),
    "leave a cp.async without its wait": (remove_cp_async_wait, None),
}


@cache
def built(path):
    """The program at the tests' small dims; the fused ones with the golden files' parameters, whose tiles
    are wide enough for the register-tiled tensor-core path."""
    grid, loop = GOLDEN_PARAMS.get(path.stem, (None, None)) if path.parent.name == "fused" else (None, None)
    b, _ = build_of(path, grid, loop, archs=())
    return b


def check(b, sanitizer, extra="all"):
    inputs = check_inputs(b, 0)
    return emulation.check(b, plan_of(b), inputs, reference_outputs(b, inputs), seed=0, rtol=rtol_of(b.reference),
                           checked_against="input program", sanitizer=sanitizer, extra=extra)


def mutated(path, mutation: str):
    """The program's build with its first kernel that the mutation applies to edited, or None."""
    b = built(path)
    edit, _ = MUTATIONS[mutation]
    for i, k in enumerate(b.kernels):
        if (src := edit(k.source, k.grid)) is not None:
            kernels = list(b.kernels)
            kernels[i] = replace(k, source=src)
            return replace(b, kernels=tuple(kernels))
    return None


@pytest.mark.parametrize("path, sanitizer", SANITIZED, ids=[f"{p.parent.name}/{p.stem}-{s}" for p, s in SANITIZED])
def test_generated_kernels_pass_the_sanitizers(path, sanitizer):
    """Every block of the hand-written kernels; for the programs as written (pre-defined kernels of up to
    512 blocks, every block the same code), the corner blocks along every axis and 4 more at random."""
    result = check(built(path), sanitizer, "all" if path.parent.name == "fused" else 4)
    assert result.passed, result.errors()


# A read past a tile's end and a missing barrier are found by a sanitizer the same way in every kernel
# (test_emulation checks each sanitizer on a hand-written one): planted in one program of each kind of kernel,
# not all of them.
ONE_OF_A_KIND = {"fused/attention.decoding", "fused/rmsnorm_mlp", "programs/causal_attention", "programs/gpt2_mlp"}
PLANTINGS = [(p, m) for p in PLANTED for m in MUTATIONS
             if MUTATIONS[m][1] is None or f"{p.parent.name}/{p.stem}" in ONE_OF_A_KIND]


@pytest.mark.parametrize("path, mutation", PLANTINGS, ids=[f"{p.parent.name}/{p.stem}-{m}" for p, m in PLANTINGS])
def test_a_planted_bug_is_reported(path, mutation):
    b = mutated(path, mutation)
    if b is None:
        pytest.skip(f"no kernel of {path.stem} has the code '{mutation}' edits")
    result = check(b, MUTATIONS[mutation][1])
    assert not result.passed, f"{mutation} in {path.stem} went unnoticed"
    if mutation == "remove a barrier":
        assert result.finding and result.finding["kind"] == "data race", result.errors()
    if mutation == "shift a tensor-core load":
        message = result.finding["message"] if result.finding else ""
        assert ("256-bit aligned" in message or "not 16-byte aligned" in message) and result.finding["where"]


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_every_mutation_applies_to_some_program(mutation):
    assert any(MUTATIONS[mutation][0](k.source, k.grid) for p, m in PLANTINGS if m == mutation for k in built(p).kernels)


def test_a_buffer_whose_use_is_cut_short_is_reported():
    """A shared buffer declared as used before the loop only, though the loop reads it (the query tile of
    attention): on the GPU the loop's tiles may overwrite its bytes by then. The emulation refills it
    where its declared use ends, so the outputs disagree, and the address sanitizer names the read."""
    b = built(next(p for p in FUSED if p.stem == "attention"))
    k = b.kernels[0]
    src, n = re.subn(r"(PRISM_SHARED_IN\(half, \d+, \d+), 0, 1\);", r"\1, 0, 0);", k.source, count=1)
    assert n == 1
    cut = replace(b, kernels=(replace(k, source=src),) + b.kernels[1:])
    plain = check(cut, None)
    assert not plain.passed and plain.finding is None  # no finding: NaN outputs
    found = check(cut, "address").finding
    assert found and "use-after-poison" in found["message"] and found["where"]
