"""Online softmax in registers moves its running max lazily (`prism::kLazyMax`, `tensor_steps.lazy_max`): the
outputs are rescaled only on the iterations where a row's scores pass the max by more than kLazyMax, and the
result still matches the float64 reference, whether the max moves late in the loop or never after its first
tile. Where the max or an output is read on its own, the max stays exact."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from prism_dsl.backend.emulate import compiler
from prism_dsl.backend.tensor_steps import lazy_max
from prism_dsl.cli.main import main
from prism_dsl.kernels.fusion import plan
from prism_dsl.kernels.kernel import kernels_of
from prism_dsl.kernels.lower import lower
from prism_dsl.lang.check import load
from prism_dsl.semantics.reference import bind_dims, random_inputs

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = ROOT / "programs/fused/attention.prism"
# the threshold as the generated code has it (templates/prism.cuh: kLazyMax, 8 ln 2)
LAZY_MAX = float(re.search(r"constexpr float kLazyMax = ([0-9.]+)f;",
                           (ROOT / "templates/prism.cuh").read_text()).group(1))
needs_cxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++ or clang++) for the CPU emulation")


def moves(dims: dict[str, int], step: int) -> tuple[int, int]:
    """On the inputs the emulation draws (seed 0) for fused attention: how many (row, key tile past the first)
    move the running max by more than kLazyMax, and how many raise it by less (the max then lags)."""
    program = load(ATTENTION).program()
    x = random_inputs(program, bind_dims(program, dims), 0)
    s = np.einsum("bhqd,bhdk->bhqk", x["Q"], x["K"])
    tiles = s.reshape(*s.shape[:-1], -1, step).max(axis=-1)
    kept, far, near = tiles[..., 0], 0, 0
    for t in range(1, tiles.shape[-1]):
        far += int(np.sum(tiles[..., t] > kept + LAZY_MAX))
        near += int(np.sum((tiles[..., t] > kept) & (tiles[..., t] <= kept + LAZY_MAX)))
        kept = np.where(tiles[..., t] > kept + LAZY_MAX, tiles[..., t], kept)
    return far, near


@needs_cxx
@pytest.mark.parametrize("dims, options, path", [
    ("b=1,h=2,q=128,kv=512,dh=64", ["--no-pingpong", "--sanitize", "address"], "wgmma, p @ v one iteration late"),
    ("b=1,h=2,q=128,kv=512,dh=128", [], "wgmma, two warpgroups taking turns"),
    ("b=1,h=2,q=64,kv=512,dh=64", ["--no-wgmma", "--sanitize", "thread"], "mma.sync"),
])
def test_the_max_moves_lazily_and_the_outputs_match_the_reference(dims, options, path, tmp_path):
    out = tmp_path / "out"
    assert main(["compile", str(ATTENTION), "--search", "none", "-o", str(out), "--arch", "none", "--dims", dims,
                 "--grid", "gb=1,gh=2,gq=1", "--loop", "F=8", *options]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["checked"]["emulation"]["passed"], report["checked"]
    src = (out / "flash_attention.cu").read_text()
    assert "prism::moves(" in src, path
    assert ("wgmma<" in src) != ("--no-wgmma" in options)
    # the outputs' rescaling runs only where a row's max moved
    assert re.search(r"if \((moves|rescale\[0\]\[0\] != real\(1\) \|\| rescale\[0\]\[1\] != real\(1\))\) \{", src)
    far, near = moves({k: int(v) for k, v in (p.split("=") for p in dims.split(","))}, 64)
    assert far and near, (far, near)  # the inputs take both paths: the max moved late, and left to lag


def test_the_max_stays_exact_where_it_or_an_output_is_read_alone(write):
    """A split's pieces store their max (acc_max_last), outputs and sums for the combining kernel: the max they
    are taken against is read, so it is exact. So where the output or the sum is stored itself; not where only
    their quotient is."""
    def group(text: str) -> bool:
        k = kernels_of(lower(load(write(text)).program()))[0]
        p = plan(k)
        s = next(n for n in k.body() if n.op == "matmul")
        return lazy_max(s, p, {st.value for st in k.stores})

    assert group(ATTENTION.read_text())
    assert not group((ROOT / "programs/fused/attention.decoding.prism").read_text())
    alone = ATTENTION.read_text().replace("store O[x, y, z, :] = o / l", "store O[x, y, z, :] = o / l\n"
                                          "        store L[x, y, z, :] = l")
    assert not group(alone)
    summed = ATTENTION.read_text().replace("o / l", "o / l + l")
    assert not group(summed)
