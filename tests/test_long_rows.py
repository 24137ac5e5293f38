"""Rows longer than a block's shared memory holds, as written: a reduction over the last dim is a loop kernel that
walks the row (a loop range of 1 is the kernel that holds it whole), and a softmax over a vocabulary's logits,
whose one-kernel form has no valid parameters there, is lowered in two kernels (`lower(long_rows=True)`: the
row's running max and sum of exp(x - max) in a loop, kept in f32, then exp(x - max) / sum), as are layer_norm and
rms_norm (a row's statistics in f32, then the division), each taking the form that fits it; compiled, emulated
and verified as a user runs them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prism_dsl.backend import emulate
from prism_dsl.ir.nodes import DType
from prism_dsl.kernels.kernel import kernels_of, stored_dtype
from prism_dsl.kernels.lower import lower, lowered_forms
from prism_dsl.lang.check import load
from test_cli import prismc

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the emulation")

SOFTMAX = """dims n = 4, v = 128256
program probs(X: f16[n, v]) {
    P = softmax(X / 0.7)
    return P
}
"""


def _report(out) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("op", ["max", "sum", "mean"])
def test_a_reduction_over_rows_of_65536_floats_walks_them_in_a_loop(op, write, tmp_path, capsys):
    """A row of 65536 f32 is 256 KiB: no block holds it whole, which left `max(X, -1)` with no valid parameters."""
    src = write(f"dims n = 4, v = 65536\nprogram r(X: f32[n, v]) {{\n    M = {op}(X, -1)\n    return M\n}}\n")
    kernel = kernels_of(lower(load(src).program()))[0]
    assert kernel.loop is not None and kernel.stores[0].value.op == {"max": "acc_max_last", "sum": "acc_sum_last",
                                                                   "mean": "acc_mean_last"}[op]
    code, text, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "-o", tmp_path / "o")
    assert code == 0, err
    assert "verified: yes" in text and _report(tmp_path / "o")["parameters"]["F_M"] > 1


def test_a_softmax_over_a_vocabulary_is_two_kernels_with_its_sums_in_f32(write, tmp_path, capsys):
    src = write(SOFTMAX)
    program = load(src).program()
    usual, apart, long = lowered_forms(program)
    assert [k.name for k in kernels_of(usual)] == ["softmax_P"]  # X / 0.7 computed in its kernel (no block holds it)
    assert [k.name for k in kernels_of(apart)] == ["div_t0", "softmax_P"]  # each in a kernel of its own
    stats, apply = kernels_of(long)  # X / 0.7 computed in both
    assert [s.name for s in stats.stores] == ["P_max", "P_sum"] and stats.loop is not None and apply.loop is None
    # partial states, kept in f32 (a sum up to 128256 would be past f16's range, and is even unsplit)
    assert [stored_dtype(stats, i) for i in range(2)] == [DType.F32, DType.F32]
    unsplit = kernels_of(load(write("dims n = 4, v = 128256\nprogram s(X: f16[n, v]) {\n    kernel k grid(x = gx) "
                                    "loop(F) {\n        xt = load X[x, loop]\n        store S[x, :] = "
                                    "acc_softmax_sum(xt)\n    }\n    return S\n}\n", "s.prism")).program())[0]
    assert stored_dtype(unsplit, 0) is DType.F32
    for search in ("none", "full"):  # the search's choice is the same two kernels: emulated once, as written
        out = tmp_path / search
        code, text, err = prismc(capsys, "compile", src, "--search", search, "--arch", "none", "-o", out,
                                 *(["--no-emulate"] if search == "full" else []))
        assert code == 0, err
        assert ("verified: yes" in text) if search == "none" else ("with 2 kernel(s)" in text), text
        report = _report(out)
        assert [k["name"] for k in report["kernels"]] == ["softmax_stats_P", "softmax_P"]  # X / 0.7 in both
        assert report["verified"] is (search == "none")
    # the two-kernel form is proved equal to the input (the pieces' max and sums combined: rules/layout.rules)
    code, text, err = prismc(capsys, "prove", src, tmp_path / "none" / "probs.prism")
    assert code == 0 and "proved" in text, text + err
    # every logit equal: the row's sum is 128256, which f16 would hold as inf (and every probability as 0)
    np.savez(tmp_path / "flat.npz", X=np.full((4, 128256), 3.0, np.float16))
    code, text, err = prismc(capsys, "verify", tmp_path / "none", "--inputs", tmp_path / "flat.npz")
    assert code == 0 and "verified: yes" in text, text + err
    # searched again: the tuning database's entry for the long form (the ranking's, `optimize.rank`) is used as it
    # is, with no warning
    code, text, err = prismc(capsys, "compile", src, "--arch", "none", "--no-emulate", "-o", tmp_path / "again")
    assert code == 0 and "not a valid" not in err and _report(tmp_path / "again")["parameters"] == \
        _report(tmp_path / "full")["parameters"]


def test_a_softmax_over_more_rows_than_a_grid_axis_y_holds_puts_them_on_x(write, tmp_path, capsys):
    """131072 tokens' logits: the rows on grid axis x (up to 2^31 - 1 blocks), the pieces of each on y, where
    y's limit of 65535 left the rows no axis."""
    src = write(SOFTMAX.replace("n = 4", "n = 131072"))
    code, text, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "--no-emulate",
                             "-o", tmp_path / "o")
    assert code == 0, err
    kernels = _report(tmp_path / "o")["kernels"]
    assert [k["name"] for k in kernels] == ["softmax_stats_P", "softmax_P"]
    assert [k["grid"][0] for k in kernels] == [131072, 131072] and kernels[0]["grid"][1] > 1


def test_a_softmax_whose_rows_fit_keeps_its_one_kernel_unless_two_are_faster(write, tmp_path, capsys):
    """Both forms are tuned, the faster by the model taken: f16 rows of 4096 in one kernel; f32 rows of 29696, which
    one block holds with registers spilled (20.5 us by the H100 model), in two (9.2 us)."""
    program = load(write(SOFTMAX)).program()
    assert [len(lowered_forms(program, {d.symbol: v for d, v in zip(program.dims, size)}))
            for size in ((4, 8192), (4, 8193))] == [2, 3]  # rows of SHORT_ROW or fewer: no form for long rows
    # (the usual form, and X / 0.7 in a kernel of its own, `lower(rows_apart=True)`)
    for dims, kernels in (("n=4,v=4096", ["softmax_P"]),
                          ("n=4,v=29696", ["softmax_stats_P", "softmax_P"])):
        src = write(SOFTMAX if "4096" in dims else SOFTMAX.replace("f16", "f32"))
        out = tmp_path / dims
        code, text, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "--dims", dims,
                                 "-o", out)
        assert code == 0, err
        assert [k["name"] for k in _report(out)["kernels"]] == kernels


def test_a_softmax_of_rank_4_over_long_rows_says_how_to_compile_it(write, tmp_path, capsys):
    """The two-kernel form puts a row's pieces and its rows on the three grid axes: rank 3 at most. A rank-4 one
    whose rows no block holds says so, and what to do, rather than only its shared memory."""
    src = write("dims a = 2, b = 2, s = 2, v = 60000\nprogram p(X: f32[a, b, s, v]) {\n    Y = softmax(X)\n"
                "    return Y\n}\n")
    code, _, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "-o", tmp_path / "o")
    assert code == 1 and "above the limit of 232448" in err
    assert "lowered in two kernels at rank 3 or less: fold its leading dims into one" in err


def test_norms_over_rows_no_block_holds_are_two_kernels_with_their_statistics_in_f32(write, tmp_path, capsys):
    """layer_norm and rms_norm (with an epsilon or without) over 100000 f16: blocks take pieces of each row, each
    walking its piece for its mean and variance (Chan's merge), or the mean of its squares, stored in f32 (a split's
    partial results), then an element-wise kernel combines a row's pieces and normalises. Rows 1000 from zero that
    vary by 4 keep their centring (an f16 mean there is 0.5 off); `prismc prove` proves the written program; a
    norm the program returns keeps its dtype."""
    src = write("dims n = 3, d = 100000\nprogram p(X: f16[n, d]) {\n    Y = layer_norm(X, 1e-5)\n"
                "    Z = rms_norm(X) * rms_norm(X, 1e-6)\n    return Y, Z\n}\n")
    code, text, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "-o", tmp_path / "o")
    assert code == 0, err
    report = _report(tmp_path / "o")
    names = [k["name"] for k in report["kernels"]]
    assert names[:2] == ["layer_norm_stats_Y", "layer_norm_Y"] and "rms_norm_stats_t1" in names
    assert "rms_norm_eps_stats_t2" in names and report["verified"]
    kernels = kernels_of(load(tmp_path / "o" / "p.prism").program())
    assert [s.name for s in kernels[0].stores] == ["Y_mean", "Y_var"] and report["kernels"][0]["grid"][1] > 1  # pieces
    assert [stored_dtype(kernels[0], i) for i in range(2)] == [DType.F32, DType.F32]
    assert stored_dtype(kernels[1], 0) is DType.F16
    x = np.random.default_rng(1).standard_normal((3, 100000)) * 4 + 1000
    np.savez(tmp_path / "far.npz", X=x.astype(np.float16))
    code, text, err = prismc(capsys, "verify", tmp_path / "o", "--inputs", tmp_path / "far.npz")
    assert code == 0 and "verified: yes" in text, text + err
    code, text, err = prismc(capsys, "prove", src, tmp_path / "o" / "p.prism")
    assert code == 0 and "proved" in text, text + err


def test_each_long_row_takes_the_form_that_fits_it(write, tmp_path, capsys):
    """A vocabulary's softmax beside a softmax over 70000 short rows: each takes its own form (the two-kernel one
    for the first; one kernel, its rows on x, for the second), where one form for both fitted neither."""
    src = write("dims n = 4, v = 128256, m = 70000, d = 64\nprogram p(X: f16[n, v], Y: f32[m, d]) {\n"
                "    P = softmax(X)\n    Q = softmax(Y)\n    return P, Q\n}\n")
    assert len(lowered_forms(load(src).program())) == 4
    code, text, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "--no-emulate",
                             "-o", tmp_path / "o")
    assert code == 0, err
    assert [k["name"] for k in _report(tmp_path / "o")["kernels"]] == ["softmax_stats_P", "softmax_P", "softmax_Q"]


def test_a_plain_mean_over_a_row_keeps_the_dtype_of_the_program(write, tmp_path, capsys):
    """A row mean the program returns, folded in a loop (`acc_mean_last`), is stored in the program's f16, and a
    kernel a program's value names (`add_Y` beside an epilogue kernel of Y's sum), or one a user's kernel has
    (`exp_E`), gets a name of its own."""
    src = write("dims n = 4, d = 64\nprogram p(X: f16[n, d], W: f16[d, d], C: f16[n, d]) {\n    M = mean(X, -1)\n"
                "    add_Y = X @ W\n    Y = (X @ W) * 2.0 + C\n    kernel exp_E grid(x = gx) {\n"
                "        ct = load C[:, x]\n        store B[:, x] = ct * 2\n    }\n    E = exp(X)\n"
                "    return M, add_Y, Y, B, E\n}\n")
    program = lower(load(src).program())
    kernels = kernels_of(program)
    assert stored_dtype(kernels[0], 0) is DType.F16 and len({k.name for k in kernels}) == len(kernels)
    code, text, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "-o", tmp_path / "o")
    assert code == 0 and "verified: yes" in text, text + err


@pytest.mark.parametrize("op", ["softmax(X)", "rms_norm(X)"])
def test_a_single_long_row_as_written_takes_the_two_kernels(op, write, tmp_path, capsys):
    """A rank-1 softmax or norm lowers, the usual way, to one block and no parameter: that form, which cannot hold
    128256 f16, is not the only one tried where no parameters were given."""
    src = write(f"dims v = 128256\nprogram p(X: f16[v]) {{\n    Y = {op}\n    return Y\n}}\n")
    code, text, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "-o", tmp_path / "o")
    assert code == 0 and "verified: yes" in text, text + err
    assert len(_report(tmp_path / "o")["kernels"]) == 2


def test_the_chain_that_makes_a_long_row_is_computed_in_both_of_its_kernels(write, tmp_path, capsys):
    """Logits over a temperature and a bias (`softmax(X / T + B)`, T a row's, B a column's) in the two kernels of a
    long row: each evaluates the chain from X, T and B itself (the loop walking B with the row, T whole), where a
    kernel of its own stored the chain for both to read back; a LayerNorm of a scaled row alike. Verified."""
    src = write("dims n = 1, v = 65536\nprogram p(X: f32[n, v], T: f32[n, 1], B: f32[v]) {\n"
                "    P = softmax(X / T + B)\n    Q = layer_norm(X * 0.5, 0.00001)\n    return P, Q\n}\n")
    out = tmp_path / "o"
    code, text, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "-o", out)
    assert code == 0 and "verified: yes" in text, err + text
    kernels = _report(out)["kernels"]
    assert [k["name"] for k in kernels] == ["softmax_stats_P", "softmax_P", "layer_norm_stats_Q", "layer_norm_Q"]
    stats = (out / "softmax_stats_P.cu").read_text()
    assert "g_T" in stats and "g_B" in stats  # the chain's operands, read by the kernel itself
