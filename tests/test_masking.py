"""Dims a program reduces along, built past the size given (`kernels.masking`): which programs may be, and the
kernels that mask each fold's elements past the end, in the block interpreter and in the emulation."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from prism_dsl.backend.codegen import CodegenConfig
from prism_dsl.backend.compare import check
from prism_dsl.kernels.hardware import load_hardware
from prism_dsl.kernels.masking import read_in_place, refusal
from prism_dsl.lang.check import load
from prism_dsl.pipeline import emulation
from prism_dsl.kernels.lower import lower
from prism_dsl.pipeline.build import (BuildOptions, callers_part, check_emulated, check_inputs, padded_inputs, plan_of,
                                      reference_outputs, render, tolerance_of, tune)
from prism_dsl.pipeline.padding import candidates, copy_us
from prism_dsl.semantics.blocks import evaluate
from prism_dsl.cli.main import main
from test_codegen import ROOT, needs_cxx, needs_nvcc


def program(name: str):
    return load(ROOT / "programs" / f"{name}.prism").program()


@pytest.mark.parametrize("name, given, built, why", [
    ("fused/attention", {"kv": 100}, None, None),  # online softmax masks its scores; p @ v reads zeros past the end
    ("fused/attention.decoding", {"kv": 100}, None, None),  # the split's pieces too: each masks by its keys' place
    ("gpt2_mlp", {"f": 100}, None, None),  # contracted: gelu(x @ 0 + 0) is 0 past the end
    ("lora", {"r": 100}, None, None),
    ("attention", {"kv": 100}, None, "softmax outside custom kernels works along the dim"),
    # a causal mask whose diagonal the sizes built leave where it was: the caller's rows keep the columns they kept
    ("fused/causal_attention", {"q": 100, "kv": 100}, {"b": 1, "h": 2, "q": 128, "kv": 128, "dh": 64}, None),
    ("fused/causal_attention", {"kv": 100}, {"b": 1, "h": 2, "q": 1, "kv": 128, "dh": 64}, None),  # one query
    ("fused/causal_attention", {"kv": 100}, {"b": 1, "h": 2, "q": 100, "kv": 128, "dh": 64},
     "causal in kernel 'flash_causal' places its elements by the dim, and would move its diagonal"),
    ("fused/causal_attention", {"q": 100}, {"b": 1, "h": 2, "q": 128, "kv": 128, "dh": 64},
     "causal in kernel 'flash_causal' places its elements by the dim, and would move its diagonal"),
    ("fused/causal_attention", {"q": 100, "kv": 100}, None, "causal in kernel 'flash_causal' places its elements"),
    ("fused/rmsnorm_linear", {"d": 100}, None, "acc_rms_last in kernel 'rmsnorm_matmul' counts the elements it folds"),
    ("rmsnorm_linear", {"d": 100}, None, "rms_norm outside custom kernels works along the dim"),
])
def test_which_programs_compute_a_dim_masked_past_the_end(name, given, built, why):
    got = refusal(program(name), given, built)
    assert got is None if why is None else why in got


def test_a_product_contracting_the_dim_needs_zeros_past_the_end_on_both_sides(write):
    def said(expr: str) -> str | None:
        text = (f"dims n = 8, d = 64, f = 64\nprogram p(X: f16[n, d], W: f16[d, f], B: f16[n, 1]) {{\n"
                f"    Y = {expr}\n    return Y\n}}\n")
        return refusal(load(write(text)).program(), {"d": 60})
    assert said("X @ W") is None and said("silu(X) @ W") is None and said("sqrt(X) @ square(W)") is None
    assert said("(X * B) @ W") is None  # zero past the end, whatever B holds
    assert "contracts the dim" in said("exp(X) @ exp(W)")  # 1 * 1 past the end
    assert "contracts the dim" in said("exp(X + B) @ W")  # exp(B) past the end: it may overflow where X + B does not
    assert "contracts the dim" in said("(X / X) @ W")  # 0 / 0
    assert "contracts the dim" in said("rsqrt(X) @ W")  # inf * 0
    assert "contracts the dim" in said("sqrt(square(X) - 0.00001) @ W")  # the root of a negative


def test_a_zero_broadcast_along_a_dim_past_the_end_leaves_it_unzeroed(write):
    """A [d, 1] * exp(B [1, d]) is zero past the end along its rows only: its columns past the end hold A's values."""
    text = ("dims d = 64, f = 64\nprogram p(A: f16[d, 1], B: f16[1, d], W: f16[d, f]) {\n"
            "    Y = (A * exp(B)) @ exp(W)\n    return Y\n}\n")
    assert "contracts the dim" in refusal(load(write(text)).program(), {"d": 60})
    text = text.replace("(A * exp(B)) @ exp(W)", "(A * B) @ W")  # zero past the end along both: A's and B's
    assert refusal(load(write(text)).program(), {"d": 60}) is None


def test_sizes_tried_for_a_dim_folded_by_a_found_program():
    written, fused = program("attention"), program("fused/attention")
    dims = {"b": 1, "h": 16, "q": 1, "kv": 4099, "dh": 128}
    assert candidates(written, dims) == []  # nothing masks the keys as written
    assert candidates(written, dims, [fused]) == [{"kv": 4160}, {"kv": 4224}]
    causal = program("causal_attention")
    dims = {"b": 1, "h": 16, "q": 4099, "kv": 4099, "dh": 128}  # both rounded alike: the diagonal stays
    assert candidates(causal, dims, [program("fused/causal_attention")]) == [{"q": 4160, "kv": 4160},
                                                                             {"q": 4224, "kv": 4224}]
    assert candidates(causal, {**dims, "q": 1}, [program("fused/causal_attention")]) == [{"kv": 4160}, {"kv": 4224}]
    assert candidates(causal, {**dims, "q": 4000}, [program("fused/causal_attention")]) == []


def scores_below_zero(inputs: dict) -> dict:
    """Queries and keys of opposite signs (RoPE's tables, where there are some, turning nothing): every score the
    caller's keys give is negative, so a key past the end taken as a score of 0 (its zeros, unmasked) would
    outweigh them all."""
    tables = {k: (np.ones_like if k[0] == "C" else np.zeros_like)(v) for k, v in inputs.items() if k in ("CQ", "SQ", "CK", "SK")}
    return {**inputs, "Q": -np.abs(inputs["Q"]), "K": np.abs(inputs["K"]), **tables}


@pytest.mark.parametrize("name, dims, built", [
    ("fused/attention", {"b": 1, "h": 2, "q": 1, "kv": 100, "dh": 64}, 128),
    ("fused/attention.decoding", {"b": 1, "h": 2, "q": 1, "kv": 100, "dh": 64}, 128),
])
def test_the_block_interpreter_masks_the_folds_past_the_end(name, dims, built):
    p = program(name)
    rng = np.random.default_rng(0)
    given = {n.attr: rng.standard_normal([dims[s.name] for s in n.shape]) for n in p.inputs}
    given = scores_below_zero(given)
    zeros = {k: np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, built - a.shape[-1])]) if k == "K" else
             np.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, built - a.shape[-2]), (0, 0)]) if k == "V" else a
             for k, a in given.items()}
    want = evaluate(program("attention"), given)["O"]
    masked = evaluate(p, zeros, {}, "h100", ends={"kv": dims["kv"]})["O"]
    assert check(masked, want, 1e-9)["passed"]
    assert not check(evaluate(p, zeros, {}, "h100")["O"], want, 1e-2)["passed"]  # unmasked: the zeros count


@needs_cxx
@pytest.mark.parametrize("name, dims, built, grid, wgmma, mask, sanitized", [
    # online softmax in registers, on wgmma and on mma.sync (the same masking code): the scores' fragments masked
    # after the product
    ("fused/attention", {"b": 1, "h": 2, "q": 64, "kv": 100, "dh": 64}, 128, {"gq": 1}, True, "past the 100 the caller",
     True),
    ("fused/attention", {"b": 1, "h": 2, "q": 64, "kv": 100, "dh": 64}, 128, {"gq": 1}, False, "past the 100 the caller",
     False),
    # the split's pieces, each folding its keys' scores in shared memory (one query)
    ("fused/attention.decoding", {"b": 1, "h": 2, "q": 1, "kv": 100, "dh": 64}, 128, {}, True, "< 100 ?", True),
    # one query under a causal mask, which keeps every key of the caller's and the keys past them too (the same fold)
    ("fused/causal_attention", {"b": 1, "h": 2, "q": 1, "kv": 100, "dh": 64}, 128, {}, True, "< 100 ?", False),
])
def test_kernels_built_past_the_keys_given_mask_them(name, dims, built, grid, wgmma, mask, sanitized):
    """Built for `built` keys where the caller has `dims["kv"]`: the generated code takes each score past the
    caller's keys as -inf; it passes the compile's check plain (and under both sanitizers, once for each masking
    code: the fragments in registers, the plain fold), and on inputs whose every score is negative (where a key
    past the end unmasked would decide the output) the emulation agrees with the reference of the input program at
    the caller's keys, where the same kernels without the masks do not."""
    options = BuildOptions(dims={**dims, "kv": built}, padded={"kv": dims["kv"]}, grid=grid,
                           loop={"F": 2} if grid else {}, codegen=CodegenConfig(wgmma=wgmma))
    tuned = tune(lower(program(name)), program(name), load_hardware("h100"), options)
    b = render(tuned, options.codegen)
    assert mask in "\n".join(k.source for k in b.kernels)
    for sanitizer in (None, "thread", "address")[:3 if sanitized else 1]:  # the compile's check: zeros past the end
        assert check_emulated(b, 0, sanitizer).passed

    def emulated(built_) -> emulation.EmulationCheck:
        plan = plan_of(built_)
        cut = callers_part(built_)
        caller = {k: v[cut.get(k, ())] for k, v in check_inputs(built_, 0).items()}
        inputs = padded_inputs(built_, scores_below_zero(caller))
        return emulation.check(built_, plan, inputs, reference_outputs(built_, inputs), seed=0,
                               rtol=tolerance_of(built_, inputs), checked_against="input program",
                               callers=cut)
    assert emulated(b).passed
    bare = render(replace(tuned, in_place=frozenset()), replace(options.codegen, ends=()))  # the same kernels, no mask
    assert mask not in "\n".join(k.source for k in bare.kernels)
    assert not emulated(bare).passed



@needs_cxx
@pytest.mark.parametrize("source, dims, codegen, copy", [
    ("rmsnorm_linear", {"n": 5, "d": 64}, CodegenConfig(), "cp_async_or_zero<8>"),  # 16-byte copies of X's rows
    ("rmsnorm_linear", {"n": 5, "d": 64}, CodegenConfig(vector_loads=False), "load_or_zero("),  # an element at a time
    ("dims n = 5, d = 65\nprogram p(X: f32[n, d]) {\n    Y = rms_norm(X)\n    return Y\n}\n", {"n": 5, "d": 65},
     CodegenConfig(), "cp_async_or_zero<1>"),  # f32 rows of odd length: 4-byte copies
])
def test_inputs_read_in_place_are_guarded_past_the_callers_end(source, dims, codegen, copy, tmp_path):
    """Rows built for 16 where the caller has 5: the kernels read X as the caller passes it (the plan's shape,
    the only array of it the emulation has), each copy of a row past 5 writing zeros and reading nothing. They pass
    the check under the address sanitizer; without the guard, the sanitizer reports the first row past the end."""
    if "\n" in source:
        (tmp_path / "p.prism").write_text(source)
        p = load(tmp_path / "p.prism").program()
    else:
        p = program(source)
    options = BuildOptions(dims={**dims, "n": 16}, padded={"n": 5}, codegen=codegen)
    b = render(tune(lower(p), p, load_hardware("h100"), options), options.codegen)
    assert b.in_place == {"X"} and plan_of(b)["tensors"]["X"]["shape"] == [5, dims["d"]]
    text = "\n".join(k.source for k in b.kernels)
    assert copy in text and ("< 5, " in text or "< 5)" in text)
    assert check_emulated(b, 0, "address").passed
    unguarded = tuple(replace(k, source=re.sub(r", [^,]*< 5(, g_X\)|\))", r", true\1", k.source)) for k in b.kernels)
    assert "< 5, " not in "\n".join(k.source for k in unguarded)
    found = check_emulated(replace(b, kernels=unguarded), 0, "address")
    assert not found.passed and "heap-buffer-overflow" in found.finding["message"]
    assert found.finding["threads"][0].startswith("block (5,")  # the first row past the caller's


@needs_nvcc
def test_a_guarded_copy_compiles_to_an_async_copy_that_fills_zeros(tmp_path):
    """cp.async with a source size of 0 bytes where the row is past the caller's end: on sm_90 and sm_80 one
    LDGSTS, its zero-fill predicate its last operand (no branch around it, no second store)."""
    from prism_dsl.backend import sass
    from prism_dsl.backend.nvcc import nvcc_check

    p = program("rmsnorm_linear")
    options = BuildOptions(dims={"n": 16, "d": 64}, padded={"n": 5})
    b = render(tune(lower(p), p, load_hardware("h100"), options), options.codegen)
    results = nvcc_check(b.kernels, tmp_path, ("sm_90", "sm_80"), read=())
    assert all(r["ok"] for per in results.values() for r in per.values()), results
    guarded = next(k for k in b.kernels if "cp_async_or_zero" in k.source)
    if sass.available():
        listing = sass.functions(sass.disassemble(tmp_path / "unit0.sm_90.cubin"))[guarded.function]
        assert re.search(r"LDGSTS\.E\.BYPASS\.128 \[[^]]*\], desc\[[^]]*\]\[[^]]*\], !?P\d ;", listing), listing[:2000]


@needs_cxx
def test_a_tile_copied_by_tma_past_the_callers_end_takes_the_maps_zeros():
    """Loop tiles copied by TMA (`--tma`) of a tensor read in place: its map has the caller's dims, so a box
    reaching past the 100th key gets the hardware's zeros there (the emulation's map fills them as the hardware
    does, where a box past the end of another tensor's map is an error); the masked kernel passes its check under
    the address sanitizer, and the same kernel with V's map said not to be read in place is stopped at its box. Where
    a box would exceed the caller's dims, the tiles are copied by the threads instead (guarded)."""
    options = BuildOptions(dims={"b": 1, "h": 2, "q": 64, "kv": 128, "dh": 64}, padded={"kv": 100}, grid={"gq": 1},
                           loop={"F": 2}, codegen=CodegenConfig(tma=True))
    p = program("fused/attention")
    b = render(tune(lower(p), p, load_hardware("h100"), options), options.codegen)
    maps = {m.tensor: m for k in b.kernels for m in k.maps}
    assert maps["V"].fill and not maps["K"].fill and b.in_place == {"V"}, maps  # K [b, h, dh, kv]: padded
    assert "the map's zeros past the caller's end" in b.kernels[0].source
    assert check_emulated(b, 0, "address").passed
    unmeant = replace(b, kernels=tuple(replace(k, maps=tuple(replace(m, fill=False) for m in k.maps)) for k in b.kernels))
    found = check_emulated(unmeant, 0)
    assert not found.passed and "the hardware fills what is outside with zeros" in found.finding["message"]
    short = BuildOptions(dims=options.dims, padded={"kv": 60}, grid=options.grid, loop=options.loop,
                         codegen=options.codegen)  # 60 keys: a box of 64 rows would exceed V's map
    assert not any(k.maps for k in render(tune(lower(p), p, load_hardware("h100"), short), short.codegen).kernels)


def test_what_is_read_in_place():
    """An input with a dim built past the size given is read in place unless that dim is its innermost (its rows
    would not start aligned), a size of it is an expression, or the caller passes it padded (--padded-inputs:
    `CodegenConfig.in_place` off)."""
    attention = {n.attr: n for n in program("attention").inputs}  # K [b, h, dh, kv], V [b, h, kv, dh]
    assert [read_in_place(attention[k], {"kv": 100}) for k in "QKV"] == [False, False, True]
    options = BuildOptions(dims={"b": 1, "h": 2, "q": 1, "kv": 128, "dh": 64}, padded={"kv": 100}, padded_inputs=True)
    assert not options.codegen.in_place
    tuned = tune(lower(program("attention")), program("attention"), load_hardware("h100"), options)
    assert tuned.in_place == frozenset() and plan_of(render(tuned, options.codegen))["tensors"]["V"]["used"][2] == 100


def test_the_copies_that_pad_a_call_are_priced_as_the_launcher_makes_them():
    """Each input padded is read at the caller's size and written at the size built (torch's constant pad, two
    launches counted); an output whose caller's part is a contiguous prefix (rows) is handed back as a view, one
    cut along an inner dim (the keys) is copied out; inputs the caller passes at the sizes built cost nothing."""
    h100 = load_hardware("h100")
    per_byte, launch = 1 / (h100.bandwidth_gbs * 1e3), h100.launch_overhead_us
    rows = program("rmsnorm_linear")  # X [n, d] and W [d, d] in, Y [n, d] out: only X and Y have the rows
    got = copy_us(rows, {"n": 100, "d": 64}, {"n": 128}, h100, codegen=CodegenConfig(in_place=False))
    assert got == pytest.approx(2 * launch + (100 + 128) * 64 * 2 * per_byte)
    assert copy_us(rows, {"n": 100, "d": 64}, {"n": 128}, h100) == 0  # read in place, Y's rows a view
    keys = program("attention")  # K [b, h, dh, kv]: the keys innermost, padded; V [b, h, kv, dh] read in place
    dims = {"b": 1, "h": 2, "q": 1, "kv": 100, "dh": 64}
    assert copy_us(keys, dims, {"kv": 128}, h100) == pytest.approx(2 * launch + 2 * 64 * (100 + 128) * 2 * per_byte)
    lora = program("lora")  # Y [n, m] out, cut along m: copied out
    dims = {"n": 64, "d": 64, "m": 100, "r": 16}
    ins = sum(n.dtype.bytes * np.prod([dims[str(s)] for s in n.shape]) for n in lora.inputs if "m" in map(str, n.shape))
    out = np.prod([dims[str(s)] for s in lora.outputs[0][1].shape]) * lora.outputs[0][1].dtype.bytes
    assert copy_us(lora, dims, {"m": 128}, h100, inputs=False) == pytest.approx(launch + 2 * out * per_byte)
    assert copy_us(lora, dims, {"m": 128}, h100) > copy_us(lora, dims, {"m": 128}, h100, inputs=False) + ins * per_byte


@needs_cxx
def test_a_compile_past_the_keys_given(tmp_path, capsys):
    """The fused attention at 4099 keys, compiled as written: built for 4160, masked past 4099; with
    --padded-inputs the summary says the caller passes its inputs at that size; `prismc verify` takes each input at
    the caller's sizes or at those built, as the launcher does (one read in place only at the caller's), and refuses
    others."""
    out = tmp_path / "out"
    args = ["compile", str(ROOT / "programs" / "fused" / "attention.prism"), "--search", "none", "--arch", "none",
            "--no-emulate", "--dims", "b=1,h=16,q=1,kv=4099,dh=128", "-o", str(out)]
    assert main([*args, "--padded-inputs"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["dims"]["kv"] == 4160 and report["padded"] == {"kv": 4099} and report["padded_inputs"]
    assert report["codegen"]["ends"] == [["kv", 4099]]
    assert "the caller passes K, V at the sizes built" in capsys.readouterr().out
    assert main([*args[:-1], str(tmp_path / "own")]) == 0  # V read in place; K's keys innermost: padded
    assert "the kernels read V as the caller passes it" in (said := capsys.readouterr().out)
    assert "the launcher pads K with zeros" in said and "(copies: " in said  # priced without a search too
    assert json.loads((tmp_path / "own" / "report.json").read_text())["padding_copies_us"] > 0
    assert "< 4099" in (out / "flash_attention.cu").read_text() or "past the 4099" in (out / "flash_attention.cu").read_text()
    rng = np.random.default_rng(1)  # `prismc verify --inputs`: at the caller's sizes, or at the sizes built
    given = scores_below_zero({"Q": rng.standard_normal((1, 16, 1, 128)), "K": rng.standard_normal((1, 16, 128, 4099)),
                               "V": rng.standard_normal((1, 16, 4099, 128))})
    given = {k: v.astype(np.float16) for k, v in given.items()}
    np.savez(tmp_path / "given.npz", **given)
    np.savez(tmp_path / "built.npz", Q=given["Q"], K=np.pad(given["K"], [(0, 0)] * 3 + [(0, 61)]),
             V=np.pad(given["V"], [(0, 0), (0, 0), (0, 61), (0, 0)]))
    np.savez(tmp_path / "wrong.npz", **{**given, "K": given["K"][..., :4000]})
    capsys.readouterr()
    np.savez(tmp_path / "mixed.npz", Q=given["Q"], K=given["K"], V=np.pad(given["V"], [(0, 0), (0, 0), (0, 61), (0, 0)]))
    for npz in ("given", "built", "mixed"):  # each input as the launcher takes it: at either size
        assert main(["verify", str(out), "--inputs", str(tmp_path / f"{npz}.npz")]) == 0, capsys.readouterr()
    assert main(["verify", str(out), "--inputs", str(tmp_path / "wrong.npz")]) != 0
    assert "(1, 16, 128, 4099) (or (1, 16, 128, 4160), the size built" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "own"), "--inputs", str(tmp_path / "mixed.npz")]) != 0  # V read in place
    assert "(1, 16, 4099, 128) (the kernels read it in place" in capsys.readouterr().err
    np.savez(tmp_path / "ints.npz", **{**given, "Q": given["Q"].astype(np.int8)})  # refused as the launcher refuses it
    assert main(["verify", str(out), "--inputs", str(tmp_path / "ints.npz")]) == 1
    assert "ints.npz: input 'Q' should hold floats, got int8" in capsys.readouterr().err


@needs_cxx
def test_what_kernels_pass_on_is_compared_on_the_callers_part():
    """rmsnorm_linear as written (RMSNorm, then the product) built for 192 rows where the caller has 131: the rows
    past 131 are zeros, normalised without an epsilon to NaN in the tensor the first kernel passes on; sampled, the
    emulation compares that tensor with the block interpreter's on the caller's rows only, and passes."""
    options = BuildOptions(dims={"n": 192, "d": 1024}, padded={"n": 131})
    b = render(tune(lower(program("rmsnorm_linear")), program("rmsnorm_linear"), load_hardware("h100"), options),
               options.codegen)
    check = check_emulated(b, 0, None, 2)
    assert check.passed and not check.emulation["whole_grid"]
    assert {"t0", "Y"} <= set(check.outputs) and check.outputs["t0"]["against"] == "block interpreter"


@needs_cxx
def test_a_build_past_the_sizes_given_that_fails_its_check_is_built_at_them(write, tmp_path, capsys, monkeypatch):
    """Were a program let past the end that does not compute the caller's values there (exp(X) @ exp(W): 1 * 1 past
    the end of the contraction), its check fails, and the compile builds the program at the sizes given and says so
    (with a search, its programs are ranked again at the sizes given: `compile._first_passing`, the same path)."""
    from prism_dsl.pipeline import compile as compile_, padding

    for module in (compile_, padding):
        monkeypatch.setattr(module, "refusal", lambda *a: None)
    monkeypatch.setattr(padding, "MARGIN", -100.0)  # the rounded size taken whatever the model says
    src = write("dims n = 64, d = 100, f = 64\nprogram p(X: f16[n, d], W: f16[d, f]) {\n"
                "    Y = exp(X) @ exp(W)\n    return Y\n}\n")
    out = tmp_path / "out"
    assert main(["compile", str(src), "--arch", "none", "--search", "none", "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["dims"]["d"] == 100 and report["padded"] == {} and report["verified"]
    assert report["padding_failed"].startswith("built for d=128 (given 100), its check failed")
    assert "built at the sizes given: built for d=128 (given 100), its check failed" in capsys.readouterr().out
