"""Dims rounded up for tiles (`pipeline.padding`): which dims may be (`ir.shapes.independent_dims`), which sizes are
tried, and a compile built at the rounded size and checked against the reference at it."""

from __future__ import annotations

import json

import pytest

from prism_dsl.cli.main import main
from prism_dsl.ir.shapes import independent_dims
from prism_dsl.lang.check import load
from prism_dsl.pipeline.padding import candidates
from test_codegen import ROOT, needs_cxx


@pytest.mark.parametrize("name, free", [
    ("rmsnorm_linear", {"n"}), ("llama_mlp", {"n"}), ("gpt2_mlp", {"n"}),  # the rows of the projections
    ("attention", {"b", "h", "q"}), ("qk_norm_attention", {"b", "h", "q"}),  # not the keys: softmax runs along them
    ("causal_attention", {"b", "h"}),  # the mask places by the queries' and the keys' positions
    ("lora", {"n", "m"}),  # the output's columns too: nothing contracts them
    ("gqa_decode", {"b", "hk", "g"}),
    ("fused/attention", set()),  # custom kernels: not looked into
])
def test_the_dims_a_program_computes_element_by_element(name, free):
    program = load(ROOT / "programs" / f"{name}.prism").program()
    assert {s.name for s in independent_dims(program.nodes())} == free


def test_a_reduction_along_a_dim_or_a_product_contracting_it_binds_it(write):
    program = load(write("dims n = 8, d = 64\nprogram p(X: f16[n, d], W: f16[n, d]) {\n"
                         "    Y = sum(X, 0) + transpose(W, 0, 1) @ X\n    return Y\n}\n")).program()
    assert {s.name for s in independent_dims(program.nodes())} == {"d"}  # the rows of the product: free


def test_sizes_tried_for_a_dim_no_tile_divides():
    program = load(ROOT / "programs" / "rmsnorm_linear.prism").program()
    assert candidates(program, {"n": 4099, "d": 4096}) == [{"n": 4160}, {"n": 4224}]
    assert candidates(program, {"n": 4096, "d": 4096}) == [] and candidates(program, {"n": 8, "d": 4096}) == []
    assert candidates(program, {"n": 4100, "d": 4099}) == [{"n": 4160}, {"n": 4224}]  # d is contracted: as given
    assert candidates(program, {"n": 130, "d": 256}) == [{"n": 192}, {"n": 256}]
    assert candidates(program, {"n": 200, "d": 256}) == [{"n": 256}]  # one size for both quanta


@needs_cxx
def test_a_compile_at_rows_no_tile_divides_is_built_for_more_and_checked(tmp_path, capsys):
    """rmsnorm_linear as written at 131 rows: built for 192, the rows past 131 zeros to the launcher, its estimate
    under the one at 131; checked in the emulation at 192 against the reference; the floor is the 131 rows'."""
    out = tmp_path / "out"
    args = ["compile", str(ROOT / "programs" / "rmsnorm_linear.prism"), "--search", "none", "--arch", "none", "--dims"]
    assert main([*args, "n=131,d=1024", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["dims"] == {"n": 192, "d": 1024} and report["padded"] == {"n": 131} and report["verified"]
    assert "built for n=192 (given 131)" in said
    text = (out / "launcher.py").read_text()
    assert "'X': {'shape': [131, 1024], 'dtype': 'f16', 'in_place': True}" in text  # its rows past 131 read as zeros
    from prism_dsl.backend.cuda_plan import padded
    with pytest.raises(ValueError, match=r"expects \(131, 1024\) \(the kernels read it in place"):
        padded({"shape": [131, 1024], "dtype": "f16", "in_place": True}, "X", (192, 1024))
    assert "the kernels read X as the caller passes it" in said
    assert any("< 131, g_X)" in f.read_text() for f in out.glob("*.cu"))  # each copy of X's rows guarded
    assert "'Y': {'shape': [192, 1024], 'dtype': 'f16', 'used': [131, 1024]}" in text
    assert main(["verify", str(out)]) == 0  # the directory as built, the caller's shapes in its plan
    capsys.readouterr()
    assert main(["verify", str(out), "--dims", "n=131"]) == 0  # the sizes given name that build too
    assert "at n=192, d=1024 (given n=131: that part of each tensor is what is compared): the .cu files on disk" \
        in capsys.readouterr().out
    assert main([*args, "n=192,d=1024", "-o", str(tmp_path / "at192"), "--no-emulate"]) == 0
    at192 = json.loads((tmp_path / "at192" / "report.json").read_text())
    assert report["estimated_us"] == at192["estimated_us"] and report["roofline"]["floor_us"] < at192["roofline"]["floor_us"]
    assert main([*args, "n=131,d=1024", "--grid", "gx_Y=8", "-o", str(tmp_path / "given"), "--no-emulate"]) == 0
    given = json.loads((tmp_path / "given" / "report.json").read_text())
    assert given["padded"] == {}  # parameters given are for the dims given


def test_a_rounding_not_taken_is_said_with_its_figures(tmp_path, capsys, write):
    """Keys (and head dims) no tile divides, the keys innermost in K, so that the launcher would copy every input to
    pad it: the model finds the copies cost more than rounding saves, and builds at the sizes given; the summary
    and report.json say what the rounding would have cost, not only that none was done."""
    path = write("dims n = 5, d = 96, kv = 1000\nprogram odd(Q: f16[n, d], K: f16[d, kv], V: f16[kv, d]) {\n"
                 "    O = softmax(Q @ K / sqrt(96)) @ V\n    return O\n}\n")
    out = tmp_path / "out"
    assert main(["compile", str(path), "--search", "none", "--arch", "none", "--no-emulate", "--dims", "n=1,kv=997",
                 "-o", str(out)]) == 0
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    (tried,) = report["padding_tried"]
    assert report["padded"] == {} and tried["dims"] == {"d": 128} and tried["estimated_us"] > report["estimated_us"]
    assert tried["copies_us"] > 0 and (f"built at the sizes given, no tile dividing them (a rounding up must save 10% of the "
                                       f"time): by the model, "
                                       f"{report['estimated_us']} us, against d=128 (rounded up) "
                                       f"{tried['estimated_us']} us with the copies") in said


def test_the_rounded_sizes_rank_what_the_one_search_proved(tmp_path, capsys, monkeypatch):
    """With the search, the dims given are searched once; each rounded size ranks the programs that search proved
    (and the program as written) again, without a second search, each keeping the proof it had."""
    from prism_dsl.pipeline import compile as compile_

    calls = []
    real = compile_.optimize

    def counted(program, library, hardware, binding, **kw):
        calls.append({s.name: v for s, v in binding.items()})
        return real(program, library, hardware, binding, **kw)
    monkeypatch.setattr(compile_, "optimize", counted)
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert main(["compile", str(ROOT / "programs" / "rmsnorm_linear.prism"), "--arch", "none", "--no-emulate",
                 "--dims", "n=131,d=1024", "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [c["n"] for c in calls] == [131] and report["padded"] == {"n": 131} and report["dims"]["n"] in (192, 256)
    assert report["search"]["complete"] and report["proved"]
