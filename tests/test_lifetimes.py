"""Shared memory by lifetime: which phase of a kernel uses each buffer, the layout that lets buffers never in
use at once share bytes, and the symbolic bound the shared-memory constraint takes from it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import sympy

from prism_dsl.backend.launch import CodegenConfig, layout
from prism_dsl.kernels.fusion import least_smem
from prism_dsl.kernels.constraints import instantiate, instantiate_program, shared_memory, valid
from prism_dsl.kernels.fusion import plan
from prism_dsl.kernels.hardware import load_hardware
from prism_dsl.kernels.kernel import kernels_of
from prism_dsl.kernels.lifetimes import AFTER, BEFORE, LOOP, arrange, in_use, lifetimes
from prism_dsl.lang.check import load
from prism_dsl.kernels.lower import lower
from prism_dsl.kernels.params import candidates, choose

ROOT = Path(__file__).resolve().parent.parent
H100 = load_hardware("h100")
FUSED = sorted((ROOT / "programs" / "fused").glob("*.prism"))


def _kernel(name: str):
    return kernels_of(load(ROOT / "programs" / "fused" / f"{name}.prism").program())[0]


def test_attention_with_rope_uses_its_query_tables_before_the_loop_only():
    k = _kernel("causal_attention")
    by_node = {b.node.attr if b.node is not None and b.role == "tile" else b.name: lifetimes(k)[b.name]
               for b in plan(k).buffers}
    for once in ("qt", "cqt", "sqt"):  # read only to make the RoPE'd query tile, before the loop
        assert by_node[once] == (BEFORE, BEFORE), once
    for walked in ("kt", "ckt", "skt", "vt"):
        assert by_node[walked] == (LOOP, LOOP), walked
    # the RoPE'd, scaled query tile: made before the loop, read in it; the RoPE'd key tile and the scores
    # (in the plain form): in it
    values = sorted(lifetimes(k)[b.name] for b in plan(k).buffers if b.role == "value")
    assert values[0] == (BEFORE, LOOP) and set(values[1:]) == {(LOOP, LOOP)}
    assert {lifetimes(k)[b.name] for roles in plan(k).state.values() for b in roles.values()} == {(BEFORE, AFTER)}


def test_states_held_in_registers_are_used_after_the_loop_only_and_share_the_tiles_bytes():
    program = load(ROOT / "programs" / "fused" / "causal_attention.prism").program()
    dims = program.default_binding()
    c = instantiate_program(program, {**dims, **choose(program, dims, {}, H100)}, H100)["flash_causal"]
    laid = layout(c, CodegenConfig())
    assert laid.flash  # online softmax in registers: its states are written once, after the loop
    states = [b.name for roles in plan(c.kernel).state.values() for b in roles.values()]
    assert {laid.live[n] for n in states} == {(AFTER, AFTER)}
    tiles = [n for n, live in laid.live.items() if live == (LOOP, LOOP)]
    assert any(laid.offsets[s] < laid.offsets[t] + laid.sizes[t] and laid.offsets[t] < laid.offsets[s] + laid.sizes[s]
               for s in states for t in tiles)
    # without the sharing the block would need the sum of every buffer
    assert laid.smem < sum(-(-laid.sizes[n] // 128) * 128 for n in laid.sizes)


def test_arrange_lays_classes_out_so_that_only_buffers_never_in_use_at_once_share_bytes():
    live = {"a": (0, 1), "b": (0, 2), "c": (1, 2), "d": (1, 1), "e": (0, 0), "f": (2, 2), "g": (1, 1)}
    size = {"a": 128, "b": 256, "c": 128, "d": 512, "e": 1024, "f": 384, "g": 128}
    offsets, total = arrange(list(live), size, live)
    assert offsets == {"a": 0, "b": 128, "c": 384, "d": 512, "g": 1024, "e": 384, "f": 512}
    assert total == 128 + 256 + max(1024, 128 + 512 + 128, 128 + 384)
    for x in live:
        for y in live:
            meet = live[x][0] <= live[y][1] and live[y][0] <= live[x][1]
            overlap = offsets[x] < offsets[y] + size[y] and offsets[y] < offsets[x] + size[x]
            assert x == y or not (meet and overlap), (x, y)
    assert [in_use(v) for v in [(0, 0), (0, 1), (1, 2), (0, 2)]] == [
        "before the loop", "before and in the loop", "in and after the loop", "in use throughout"]


@pytest.mark.parametrize("path", FUSED + [ROOT / "programs" / "rmsnorm_linear.prism"], ids=lambda p: p.stem)
def test_the_generated_layout_never_needs_more_than_the_constraint_allows(path):
    """The constraint bounds the same layout with every padding and alignment; the code's buffers are never
    in use at once where they share bytes. The parameters are ones the constraint allows (`choose`): the
    tuner's may fit only the layout the code generator makes, which is what the pipeline checks them by."""
    program = load(path).program()
    if path.parent.name != "fused":
        program = lower(program)
    dims = program.default_binding()
    for c in instantiate_program(program, {**dims, **choose(program, dims, {}, H100)}, H100).values():
        for config in (CodegenConfig(stages=1), CodegenConfig(tensor_cores=False, stages=1), CodegenConfig()):
            laid = layout(c, config)
            if config.stages == 1:
                assert laid.smem <= c.smem_bytes, (c.kernel.name, config)
            for x in laid.offsets:
                for y in laid.offsets:
                    meet = laid.live[x][0] <= laid.live[y][1] and laid.live[y][0] <= laid.live[x][1]
                    overlap = (laid.offsets[x] < laid.offsets[y] + laid.sizes[y]
                               and laid.offsets[y] < laid.offsets[x] + laid.sizes[x])
                    assert x == y or not (meet and overlap), (c.kernel.name, x, y)
        assert isinstance(sympy.sympify(shared_memory(c.kernel)), sympy.Expr)


@pytest.mark.parametrize("path", FUSED, ids=lambda p: p.stem)
def test_the_least_shared_memory_the_tuner_passes_over_by_is_never_more_than_a_layout_takes(path):
    """`fusion.least_smem` lets the tuner pass over a choice without laying it out: it must never exceed what
    any layout of it takes, or a choice that fits would be lost. Every choice of the tuner's candidates (up
    to 200 a kernel, spread over them), laid out for the default code, without tensor cores, unpipelined and
    without wgmma."""
    program = load(path).program()
    dims = program.default_binding()
    configs = (CodegenConfig(), CodegenConfig(tensor_cores=False), CodegenConfig(stages=1), CodegenConfig(wgmma=False))
    for k in kernels_of(program):
        syms = sorted((s for s in k.symbols() if s not in dims), key=str)
        choices = list(itertools.product(*(candidates(program, s, dims) for s in syms)))
        tried = 0
        for values in choices[::max(1, len(choices) // 200)]:
            binding = {**dims, **dict(zip(syms, values))}
            if not valid(k, binding, H100, smem=False):
                continue
            c = instantiate(k, binding, H100, lambda _: 0)  # laid out below, whatever it takes
            least = least_smem(k, binding)
            for config in configs:
                assert least <= layout(c, config).smem, (k.name, values, config)
            tried += 1
        assert tried, k.name
