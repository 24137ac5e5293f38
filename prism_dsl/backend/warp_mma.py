"""Register-tiled tensor-core products: how a loop's `acc_sum(a @ b)` is spread over the warps of a block.

Where it sits: `codegen` asks `tiling` whether a product it folds into an `acc_sum` can run this way and
renders the step from the answer; `cost` prices the same answer. The product's accumulator then lives in
registers for the whole loop (each warp owns a fixed block of the output), operands come from shared memory
by `ldmatrix` (rows padded by 16 bytes, `fusion.ROW_PAD`, so the 8 rows of each 8x8 matrix fall in different
banks), and every k step of 16 issues `mma.sync.m16n8k16` (f16/bf16 in, f32 accumulate) for every pair of
the warp's A and B fragments. After the loop the registers are written to the accumulator's state once.

Two orientations:
- "mn": C = A B with m16n8 tiles: A fragments by `ldmatrix.x4` from A's rows, B fragments by
  `ldmatrix.x4.trans` (two n8 tiles each; `.x2.trans`, one, where a warp has an odd number) from B's
  rows. Needs m and k multiples of 16, n of 8.
- "nm": for few rows (m a multiple of 8, not of 16: decode), C^T = B^T A^T, so B's columns fill the
  16-row side of the instruction and A's 8 rows its 8-column side: B^T fragments by `ldmatrix.x4.trans`,
  A^T fragments by `ldmatrix.x2` from A's rows. Needs m multiple of 8, n and k multiples of 16.

- "wg" (sm_90a, `wgmma`): a warpgroup of 4 warps computes 64 x N_w blocks of C (N_w 64, 128 or 256) by
  `wgmma.mma_async` straight from shared memory, with no ldmatrix: both operands are stored in the 128-byte
  swizzle (`launch.swizzled`; tiles with rows and columns in multiples of 64). Warp w of a group holds rows
  16 w ... of each 64-row block in mma.sync's C layout, so the store after the loop is the "mn" one with
  64-row blocks. Needs m, n and k multiples of 64; 8 warps (2 groups) where their accumulators fit, so one
  group's tensor-core work runs while the other waits.

Warps split the output (wm x wn) and, when the output has too few tiles for them, the contraction too (wk):
each such warp folds its share of every tile's k steps, and the partial sums are added in turn after the
loop. The accumulators of a warp (tm x tn tiles of 4 floats per thread) are capped at MAX_ACCUMULATORS
registers, shared equally by the products a kernel holds in registers at once (the two of a gated MLP),
and a layout uses 4 warps, or 8 where 4 cannot hold the outputs in registers.

Online softmax on wgmma (`Flash.wg`, sm_90a): the same dataflow with 16 rows per warp, 4 warps a group of
64: s = q @ kt by wgmma from the swizzled q and k tiles (its accumulators are the same layout as mma.sync's),
p @ v by wgmma with p's A fragments from registers and v from its swizzled tile.

Online softmax on tensor cores (`Flash`, FlashAttention-2's dataflow): for scores s = q @ kt folded by
`acc_softmax_out(s, v)` and `acc_softmax_sum(s)`, each warp owns 16 rows of q (tm blocks of them) and
computes its rows of s with mma.sync into registers ("mn" as above: q by `ldmatrix.x4`, kt by
`ldmatrix.x4.trans`). A thread then holds, per 16-row block, two rows (lane / 4 and lane / 4 + 8) and two
adjacent columns of each n8 tile: the row max takes two shuffles over the 4 lanes of a row. The running
max, the rescaled sums and the output stay in registers for the whole loop. exp(s - max) is packed to
f16/bf16 pairs in registers, and the accumulator layout of two adjacent n8 tiles of s is exactly the A
fragment of a k16 step, so p @ v needs only v's fragments from shared memory (`ldmatrix.x4.trans`).
Neither s nor p is ever stored. After the loop the warp's row sums are added over the row's 4 lanes and
the running max, sums and outputs are written to their states once.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_ACCUMULATORS = 128  # f32 accumulator registers per thread
WARPS = (4, 8)  # warps per block a register-tiled kernel may use (the first that holds the output)


@dataclass(frozen=True)
class Tiling:
    orient: str  # "mn", "nm" or "wg" (see the module docstring)
    m: int
    n: int
    k: int
    wm: int  # warps along C's rows (m)
    wn: int  # warps along C's columns (n)
    wk: int  # warps sharing the contraction
    tm: int  # instruction tiles per warp along the instruction's M side (16 rows; "nm": 16 of C's columns;
    #          "wg": 64-row blocks per warpgroup, wm then counting 4 warps per group)
    tn: int  # along its N side (8 columns; "nm": 8 of C's rows; "wg": N_w / 8)
    warps: int  # warps in the block (some may idle when the output is small)

    @property
    def accumulators(self) -> int:
        return self.tm * self.tn * 4

    @property
    def mma_per_k(self) -> int:
        """mma.sync per warp and k step of 16."""
        return self.tm * self.tn

    @property
    def ldmatrix_per_k(self) -> int:
        """ldmatrix per warp and k step: x4 loads of the 16-row side; x4.trans pairs or x2 of the other (none
        for wgmma, which reads shared memory itself)."""
        if self.orient == "wg":
            return 0
        return self.tm + (self.tn // 2 if self.orient == "mn" and self.tn % 2 == 0 else self.tn)

    @property
    def row_step(self) -> int:
        """Rows of C between a warp's instruction tiles along M (16; 64 for a warpgroup's blocks)."""
        return 64 if self.orient == "wg" else 16

    @property
    def groups(self) -> int:
        """Warpgroups computing ("wg")."""
        return self.wm * self.wn // 4

    @property
    def k_steps(self) -> int:
        """k steps of 16 each warp takes per loop iteration."""
        return self.k // 16 // self.wk

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True)
class Flash:
    m: int  # rows of q and s
    d: int  # q's columns, the contraction of s = q @ kt
    n: int  # s's columns (kt's), the contraction of p @ v
    dv: int  # v's columns
    outs: int  # acc_softmax_out accumulators folding these scores (each its own output registers)
    tm: int  # 16-row blocks per warp
    warps: int  # warps that compute (m / 16 / tm)
    wg: bool = False  # on wgmma: q @ kt from shared memory, p @ v with p from registers (tm 1, 4 warps a group)

    @property
    def accumulators(self) -> int:
        """f32 registers per thread held across the loop, or live in it: outputs, scores, max and sum."""
        return self.tm * (self.outs * self.dv + self.n) // 2 + 4 * self.tm


def flash(m: int, d: int, n: int, dv: int, outs: int, wgmma: bool = False) -> Flash | None:
    """The warp layout of online softmax over s = q @ kt (m x d @ d x n) folding p @ v (n x dv) `outs`
    times, or None when tensor cores cannot take it: the fewest 16-row blocks per warp that keep the
    warps at most max(WARPS) and the registers at most MAX_ACCUMULATORS (plus the running max and sum).
    With `wgmma`, on warpgroups where the shapes allow: 16 rows per warp, m a multiple of 64, the key tile
    and the value columns 64, 128 or 256 wide, d a multiple of 64."""
    if m % 16 or d % 16 or n % 16 or dv % 16:
        return None
    if wgmma and m % 64 == 0 and d % 64 == 0 and n in WGMMA_N and dv in WGMMA_N and m // 16 <= max(WARPS):
        f = Flash(m, d, n, dv, outs, 1, m // 16, True)
        if f.accumulators <= MAX_ACCUMULATORS + 4:
            return f
    for tm in _divisors(m // 16):
        f = Flash(m, d, n, dv, outs, tm, m // 16 // tm)
        if f.warps <= max(WARPS) and f.accumulators <= MAX_ACCUMULATORS + 4 * tm:
            return f
    return None


WGMMA_N = (64, 128, 256)  # the instruction widths prism::wgmma is written for


def wgmma_tiling(m: int, n: int, k: int, min_warps: int = 4, most: int = MAX_ACCUMULATORS) -> Tiling | None:
    """The warpgroup layout ("wg") of an m x k @ k x n product, or None: 8 warps where the accumulators fit,
    else 4 (at least min_warps); among those, the fewest bytes wgmma reads from shared memory per k step."""
    if m % 64 or n % 64 or k % 64:
        return None
    for warps in sorted({max(w, min_warps) for w in WARPS}, reverse=True):
        best, key = None, None
        for gm in _divisors(m // 64):
            gn = warps // 4 // gm
            if gm * gn * 4 != warps or (n // 64) % gn or n // gn not in WGMMA_N:
                continue
            t = Tiling("wg", m, n, k, 4 * gm, gn, 1, m // 64 // gm, n // gn // 8, warps)
            if t.accumulators > most:
                continue
            read = gm * gn * t.tm * (64 + n // gn)  # rows of A and columns of B per k step, all groups
            if key is None or read < key:
                best, key = t, read
        if best is not None:
            return best
    return None


def tiling(m: int, n: int, k: int, min_warps: int = 4, most: int = MAX_ACCUMULATORS) -> Tiling | None:
    """The layout of an m x k @ k x n product over a block's warps, or None when tensor cores cannot take it.

    Among the layouts that fit (accumulators at most `most`, the product's share of MAX_ACCUMULATORS
    where a kernel holds several; the fewest block warps, at least `min_warps`, that allow one), the one using most warps, then with fewest warps sharing the
    contraction (each such warp holds a whole copy of its tiles), then with the most mma.sync per ldmatrix."""
    if k % 16 or n % 8:
        return None
    if m % 16 == 0:  # tiles: 16-row blocks of C; 16-column pairs of n8 tiles where n allows, else n8 tiles
        orient, big, small = ("mn", (m // 16, n // 16), (1, 2)) if n % 16 == 0 else ("mn", (m // 16, n // 8), (1, 1))
    elif m % 8 == 0 and n % 16 == 0:
        orient, big, small = "nm", (n // 16, m // 8), (1, 1)
    else:
        return None
    for warps in sorted({max(w, min_warps) for w in WARPS}):
        best, key = None, None
        for w1 in _divisors(big[0]):
            for w2 in _divisors(big[1]):
                for wk in _divisors(k // 16):
                    if w1 * w2 * wk > warps:
                        continue
                    t1, t2 = big[0] // w1 * small[0], big[1] // w2 * small[1]
                    wm, wn = (w1, w2) if orient == "mn" else (w2, w1)
                    t = Tiling(orient, m, n, k, wm, wn, wk, t1, t2, warps)
                    if t.accumulators > most:
                        continue
                    score = (w1 * w2 * wk, -wk, t.mma_per_k / t.ldmatrix_per_k)
                    if key is None or score > key:
                        best, key = t, score
        if best is not None:
            return best
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
