"""The layouts of register-tiled products (prism_dsl/backend/warp_mma.py), checked on their own; the code
they render is checked lane by lane in the emulation (tests/test_emulation.py, tests/test_codegen.py)."""

import pytest

from prism_dsl.backend.warp_mma import MAX_ACCUMULATORS, tiling


def covers(t) -> bool:
    """The warps' tiles cover C exactly once per share of the contraction."""
    if t.orient == "mn":
        rows, cols = t.wm * t.tm * 16, t.wn * t.tn * 8
    else:
        rows, cols = t.wm * t.tn * 8, t.wn * t.tm * 16
    return (rows, cols) == (t.m, t.n) and t.wk * t.k_steps * 16 == t.k


@pytest.mark.parametrize("m,n,k", [(128, 128, 64), (128, 256, 32), (64, 128, 64), (16, 8, 64), (48, 32, 16),
                                   (8, 16, 64), (8, 32, 128), (24, 64, 32), (256, 128, 16)])
def test_every_layout_covers_the_output_and_fits_in_registers(m, n, k):
    t = tiling(m, n, k)
    assert t is not None and covers(t) and t.accumulators <= MAX_ACCUMULATORS
    assert t.wm * t.wn * t.wk <= t.warps and t.warps in (4, 8)


def test_prefill_tiles_reach_four_mma_per_ldmatrix():
    t = tiling(128, 128, 64)
    assert (t.orient, t.wm, t.wn, t.wk, t.warps) == ("mn", 2, 2, 1, 4)
    assert t.mma_per_k / t.ldmatrix_per_k >= 4  # 64 x 64 warp tiles: 4 A loads, 4 B pairs, 32 mma
    assert tiling(128, 256, 64).warps == 8  # 4 warps cannot hold it in 128 registers each


def test_few_rows_use_the_transposed_orientation_and_share_the_contraction():
    t = tiling(8, 32, 128)
    assert t.orient == "nm" and t.wm * t.wn * t.wk == 4 and t.wk > 1


@pytest.mark.parametrize("m,n,k", [(8, 8, 64), (12, 16, 64), (16, 16, 8), (16, 12, 16), (4096, 4096, 64)])
def test_shapes_tensor_cores_cannot_take_have_no_layout(m, n, k):
    assert tiling(m, n, k) is None
