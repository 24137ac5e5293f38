"""The shape of a generated kernel, decided once for the code generator and the cost model to share.

Where it sits: between parameter instantiation and `codegen`; `cost` reads the same decisions, so the model
prices the code that is written. For one concrete kernel and a `CodegenConfig`, `layout` says:

- which products run on tensor cores and how: register-tiled `wgmma` (sm_90a, `warp_mma.wgmma_tiling`) or
  `mma.sync` (`warp_mma.tiling`) for a loop's `acc_sum(a @ b)`, online softmax over `q @ kt` with `p @ v`
  entirely in registers (`warp_mma.flash`, on warpgroups or warps), wmma fragments for other products of
  suitable shape (`mma_shape`);
- which buffers wgmma reads (`swizzled`): stored in its 128-byte swizzle, unpadded, every buffer of such a
  kernel then starting on a 1024-byte atom; where another product would read one as padded rows, or the
  atoms' alignment overflows shared memory, the kernel keeps `mma.sync` instead; which loaded tiles of
  rows of 32 or 64 bytes have their 16-byte chunks permuted by row instead of padded (`xor_rows`);
- the threads per block: the configured count, or more where a register-tiled product needs more warps;
- the stages of the loop's copy pipeline: with every loop tile copied by 16-byte `cp.async`, the loads of
  iteration `it + stages - 1` are issued while iteration `it` computes, each loop tile then having `stages`
  buffers; as many stages as the config allows (`CodegenConfig.stages`) and shared memory holds
  (`CodegenConfig.smem_limit`, the hardware's opt-in maximum per block). A loop whose tiles are too small
  for that to cover the memory latency (FlashDecoding's combining loop: a max, a sum and a row per piece)
  goes deeper, up to `MAX_STAGES` and its own length, until the iterations ahead hold the bytes an SM needs
  in flight (`CodegenConfig.flight`, Little's law: `deepened`), but for loops with products on warpgroups,
  whose tiles are large. Where wgmma products read only loop tiles, each iteration's batch stays in flight
  into the next (`in_flight`), and online softmax on wgmma runs `p @ v` one iteration late, beside the next
  iteration's softmax (`overlap`); the loads then run `stages - 2` iterations ahead. Where that online softmax
  is the whole loop on two warpgroups, they take turns on the tensor cores (`pingpong`): one's products run
  while the other computes its softmax, and mbarriers take the place of the loop's block-wide barrier; the
  loads then run `stages - 3` ahead. Each of those holds a stage more than the config asks for, so that the
  loads still run `CodegenConfig.stages - 1` ahead, where shared memory holds the stage without fewer blocks
  per SM (`held_by_batches`: a tile's latency and transfer take longer than an iteration's products). On
  sm_90a the loop tiles such a kernel reads by wgmma are copied by the tensor memory accelerator where each
  is a box of its tensor (`copies`): one thread issues them, an mbarrier per stage says when they have landed;
  where the batch stays in flight and the loop writes no shared memory, or warpgroups take turns, a warp of their
  own launched after the computing threads (`copy_warp`, `copies.copy_warp`), and the loop has no block-wide barrier;
- the shared-memory buffers, their offsets (128-byte aligned) and the bytes per block: buffers never in use
  at once share bytes (`kernels.lifetimes.arrange`). Online softmax in registers has no buffer for its
  scores, their exp or its rescaling factors, and it and register-tiled products write their state only
  after the loop: those kernels need tensor cores (sm_80 or later; `--no-tensor-cores` writes the plain
  form, which keeps them in shared memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import DType, Node
from ..kernels.constraints import Concrete
from ..kernels.fusion import ALIGN, Buffer, Place, Plan, buffer_shapes, compute_dtype, matrix_transpose, plan
from ..ir.ops import OPS, Kind
from ..kernels.kernel import after_loop, in_loop, loop_varying, storage
from ..kernels.lifetimes import AFTER, Lifetime, arrange, lifetimes
from .copies import COPY_WARP, copied_by_tma, copy_bytes, copy_warp
from .warp_mma import MAX_ACCUMULATORS, Flash, Tiling, flash, tiling, wgmma_tiling

WGMMA_ARCHS = ("sm_90", "sm_90a")  # the targets with wgmma (compiled as sm_90a: its arch-specific features)
DEFAULT_STAGES = 3  # cp.async pipeline depth: 2 overlaps one load with compute, 3 covers latency jitter
MAX_STAGES = 16  # the deepest pipeline a loop of small tiles gets (`deepened`)


@dataclass(frozen=True)
class CodegenConfig:
    threads: int = 128  # threads per block (at least; register-tiled products may take more)
    tensor_cores: bool = True  # emit tensor-core paths (mma.sync, wmma) where tile shapes allow
    vector_loads: bool = True  # 16-byte copies from global memory where alignment allows
    stages: int = DEFAULT_STAGES  # loop-tile pipeline depth (1: no pipeline; small tiles go deeper: `deepened`)
    smem_limit: int = 232448  # bytes of shared memory a block may use (the hardware's; H100: 227 KiB)
    wgmma: bool = True  # warpgroup products from swizzled shared memory where the arch has them (sm_90a)
    arch: str = "sm_90"  # the target GPU's (`Hardware.arch`)
    sms: int = 132  # the target GPU's SMs (`Hardware.sms`): whether blocks wait for a slot (`position.longest_first`)
    pingpong: bool = True  # two warpgroups of online softmax take turns on the tensor cores where they can (`pingpong`)
    flight: int = 13636  # bytes an SM keeps in flight to cover the DRAM latency (`cost.for_hardware`; H100's here)
    smem_per_sm: int = 233472  # the hardware's (`cost.for_hardware`): a deeper pipeline keeps the blocks per SM
    one_launch: bool = True  # a split's combining kernel runs in the launch of the kernel it combines (`tails`)
    ends: tuple[tuple[str, int], ...] = ()  # dims built past the sizes the caller gave, with those sizes: a fold
    # along one takes its elements past the size as its identity (`kernels.masking`)
    in_place: bool = True  # inputs with a dim in `ends` read as the caller passes them where they can be
    # (`kernels.masking.read_in_place`); off where the caller passes them at the sizes built (--padded-inputs)
    tma: bool = False  # a kernel on wgmma copies its loop tiles by the tensor memory accelerator where it can
    # (`copies`); off unless asked for (`prismc compile --tma`) until a GPU runs it: on an H200 (their maps packed at
    # the wrong offsets, `cuda_plan.parameter_layout`) such kernels stopped at their first copy
    copy_warp: bool = True  # a warp of its own issues those TMA copies where it can (`copies.copy_warp`)

    @property
    def warpgroups(self) -> bool:
        """Whether register-tiled products may run on wgmma (`warp_mma.wgmma_tiling`)."""
        return self.tensor_cores and self.wgmma and self.arch in WGMMA_ARCHS


@dataclass(frozen=True)
class Layout:
    threads: int
    registers: dict[Node, Tiling]  # register-tiled products, by the acc_sum that folds them
    flash: dict[Node, Flash]  # online softmax in registers, by its scores
    stages: int  # 1: the loop's tiles load, wait, then compute
    pads: dict[str, int]  # buffer name -> elements after each row (`padding`)
    swizzled: frozenset[str]  # buffers in wgmma's 128-byte swizzle (`swizzled`; no padding)
    offsets: dict[str, int]  # buffer name -> byte offset in the block's shared memory
    sizes: dict[str, int]  # buffer name -> bytes (every stage, for loop tiles)
    smem: int  # bytes per block
    live: dict[str, Lifetime]  # buffer name -> the phases it is in use (`kernels.lifetimes`)
    in_flight: bool = False  # each iteration's wgmma batch runs on while the next iteration starts (`in_flight`)
    overlap: bool = False  # online softmax's p @ v of the iteration before runs beside this one's softmax (`overlap`)
    pingpong: bool = False  # two warpgroups take turns on the tensor cores; mbarriers pace the pipeline (`pingpong`)
    mbarriers: int = 0  # byte offset of the pipeline's mbarriers after every buffer: with `pingpong` a full and an
    # empty one per stage, with `tma` alone a full one
    tma: frozenset[str] = frozenset()  # the loop tiles copied by TMA (`copies.copied_by_tma`): every staged one, or none
    xor_rows: frozenset[str] = frozenset()  # loaded tiles with each row's 16-byte chunks permuted (`xor_rows`; no padding)
    copy_warp: bool = False  # a warp besides `threads` issues the TMA copies (`copies.copy_warp`): an empty mbarrier
    # per stage beside the full one, and no block-wide barrier in the loop

    @property
    def launched(self) -> int:
        """The block's threads as launched: `threads`, and the copy warp's 32 after them."""
        return self.threads + COPY_WARP * self.copy_warp

    @property
    def lead(self) -> int:
        """How many iterations ahead a pipelined loop's copies run: stages - 1, or stages - 2 where a wgmma
        batch still reads the stage of the iteration before (`in_flight`, `overlap`), or stages - 3 where the
        warpgroups take turns (`pingpong`: the later one may still read the stage of two iterations before)."""
        return self.stages - (3 if self.pingpong else 2 if self.in_flight or self.overlap else 1)


def mma_shape(m: int, n: int, k: int) -> tuple[int, int] | None:
    """The wmma fragment (rows, cols; depth 16) for an m x k @ k x n product, or None.

    Fragment pointers must be 32-byte aligned: with f16/bf16 operands and f32 results that holds when
    fragment columns are multiples of 16, so the 32 x 8 shape is not used."""
    if k % 16:
        return None
    return next(((fm, fn) for fm, fn in ((16, 16), (8, 32)) if m % fm == 0 and n % fn == 0), None)


def stored_operand(n: Node) -> tuple[Node, bool]:
    """What a product's right operand reads in shared memory: the node itself, or for a transpose of the
    last two dims the tile it views, read transposed (K as stored for Q @ K^T: `ldmatrix` without
    `.trans`, a column-major wmma fragment)."""
    if matrix_transpose(n):
        return n.args[0], True
    return n, False


def tensor_core_operands(a: Node, b: Node, p: Plan, shape_of) -> bool:
    """Whether a @ b has what tensor cores take: f16/bf16 tiles or values in shared memory (as stored: a
    tile of an f32 partial result is f32; b may be a transpose), matrices (leading dims 1)."""
    sb = shape_of(b)
    b = stored_operand(b)[0]
    # a tile, or a value kept in 16 bits for the products that read it (`fusion.plan`)
    if p.place.get(a) is not Place.SMEM or p.place.get(b) is not Place.SMEM:
        return False
    da, db = p.buffer(a).dtype, p.buffer(b).dtype
    if da != db or da not in (DType.F16, DType.BF16):
        return False
    sa = shape_of(a)
    return len(sa) >= 2 and len(sb) >= 2 and all(s == 1 for s in sa[:-2] + sb[:-2])


def uses_tensor_cores(a: Node, b: Node, p: Plan, shape_of) -> bool:
    """Whether the product a @ b of a kernel body runs on wmma tensor-core tiles (`codegen`'s "mma" step)."""
    if not tensor_core_operands(a, b, p, shape_of):
        return False
    sa, sb = shape_of(a), shape_of(b)
    return mma_shape(sa[-2], sb[-1], sa[-1]) is not None


def flash_products(c: Concrete, config: CodegenConfig) -> dict[Node, Flash]:
    """The loop's online-softmax groups that run in registers (`warp_mma.flash`): scores s = q @ kt of
    f16/bf16 tiles in shared memory, read only by online-softmax accumulators (no store, no other op),
    each `acc_softmax_out` folding a tile v of the same dtype with the same columns."""
    if not config.tensor_cores or compute_dtype(c.kernel) is not DType.F32:
        return {}
    p = plan(c.kernel)
    stored = {st.value for st in c.kernel.stores}
    out = {}
    for s in p.groups:
        users, m = p.users[s], scores_product(s, p)
        if m is None or s in stored or m in stored or not tensor_core_operands(*m.args, p, c.shape):
            continue
        if not all(u.op in ACCUMULATORS and ACCUMULATORS[u.op].online for u in users):
            continue
        vs = [u.args[1] for u in users if len(u.args) > 1]
        dtype = p.buffer(m.args[0]).dtype
        if not all(p.place.get(v) is Place.SMEM and v.op == "tile" and p.buffer(v).dtype is dtype
                   and all(x == 1 for x in c.shape(v)[:-2]) for v in vs) or len({c.shape(v)[-1] for v in vs}) > 1:
            continue
        sq, sk = c.shape(m.args[0]), c.shape(m.args[1])
        if (f := flash(sq[-2], sq[-1], sk[-1], c.shape(vs[0])[-1] if vs else 16, len(vs), config.warpgroups)) is not None:
            out[s] = f
    return out


def scores_product(s: Node, p: Plan) -> Node | None:
    """The product q @ kt that online softmax's scores `s` are: s itself, or the product that `causal(..)`
    masks and nothing else reads (masked in registers); None for other scores."""
    m = s.args[0] if s.op == "causal" and p.users[s.args[0]] == [s] else s
    return m if m.op == "matmul" else None


def unbuffered(p: Plan, flash_of: dict[Node, Flash]) -> set[str]:
    """Buffers the plan lists that online softmax in registers leaves out: the scores (and the product a
    mask reads), their exp, the factors."""
    return {b.name for s in flash_of for b in [p.buffer(n) for n in flash_values(p, flash_of) if p.place[n] is Place.SMEM]
            + [p.groups[s]["scale"], p.groups[s]["p"]]}


def flash_values(p: Plan, flash_of: dict[Node, Flash]) -> set[Node]:
    """The body values that online softmax in registers computes there: its scores, and a masked product."""
    return set(flash_of) | {scores_product(s, p) for s in flash_of}


def register_products(c: Concrete, config: CodegenConfig) -> tuple[dict[Node, Tiling], int]:
    """The loop's products that run register-tiled (`warp_mma`): each `acc_sum(a @ b)` whose product is
    fused into it, with f16/bf16 tiles in shared memory that `warp_mma.tiling` can lay out; and the threads
    per block the kernel then needs (at least `config.threads`)."""
    if not config.tensor_cores or compute_dtype(c.kernel) is not DType.F32:
        return {}, config.threads
    p = plan(c.kernel)

    products = [acc for acc in c.kernel.body() if acc.op == "acc_sum" and p.place.get(acc.args[0]) is Place.FUSED
                and tensor_core_operands(*acc.args[0].args, p, c.shape)]
    share = MAX_ACCUMULATORS // max(1, len(products))  # their accumulators are all live through the loop

    def layouts(min_warps: int, groups: bool) -> dict[Node, Tiling]:
        out = {}
        for acc in products:
            sa, sb = c.shape(acc.args[0].args[0]), c.shape(acc.args[0].args[1])
            t = wgmma_tiling(sa[-2], sb[-1], sa[-1], min_warps, share) if groups else None
            if (t := t or tiling(sa[-2], sb[-1], sa[-1], min_warps, share)) is not None:
                out[acc] = t
        return out

    def chosen(groups: bool) -> tuple[dict[Node, Tiling], int]:
        first = layouts(config.threads // 32, groups)
        warps = max([config.threads // 32] + [t.warps for t in first.values()])
        return (layouts(warps, groups) if warps * 32 != config.threads else first), warps * 32

    return chosen(config.warpgroups)


def _wgmma_products(c: Concrete, registers: dict[Node, Tiling], flash_of: dict[Node, Flash]) -> list[tuple[Node, list[Node]]]:
    """The products on wgmma, each with the nodes whose buffers it reads: "wg" register-tiled ones (a and
    b as stored) and online softmax on warpgroups (q, k as stored, every v)."""
    p = plan(c.kernel)
    out = [(acc.args[0], [acc.args[0].args[0], stored_operand(acc.args[0].args[1])[0]])
           for acc, t in registers.items() if t.orient == "wg"]
    for s, f in flash_of.items():
        if f.wg:
            m = scores_product(s, p)
            out.append((m, [m.args[0], stored_operand(m.args[1])[0]] + [u.args[1] for u in p.users[s] if len(u.args) > 1]))
    return out


def swizzled(c: Concrete, registers: dict[Node, Tiling], flash_of: dict[Node, Flash]) -> frozenset[str]:
    """The buffers wgmma reads: stored in the 128-byte swizzle, unpadded."""
    p = plan(c.kernel)
    return frozenset(p.buffer(x).name for _, xs in _wgmma_products(c, registers, flash_of) for x in xs)


def xor_rows(c: Concrete, buffers: list[Buffer], dims: dict, registers: dict[Node, Tiling],
             flash_of: dict[Node, Flash]) -> frozenset[str]:
    """The loaded 16-bit tiles with rows of 16 or 32 elements (32 or 64 bytes), stored unpadded with each row's
    16-byte chunks permuted (`ctext.xor_column`): an ldmatrix's 8 rows and a quarter warp's 16-byte copies then
    fall on distinct banks, where padded 64-byte rows took 2-way conflicts in those copies and unpadded 32-byte
    rows in those ldmatrix (counted: `backend.banks`). Not where wmma reads one: its loads take a row stride."""
    p = plan(c.kernel)
    tiled = {acc.args[0] for acc in registers} | {scores_product(s, p) for s in flash_of}
    wmma = {p.buffer(x).name for n in c.kernel.body() if n.op == "matmul" and n not in tiled
            and uses_tensor_cores(n.args[0], n.args[1], p, c.shape)
            for x in (n.args[0], stored_operand(n.args[1])[0]) if p.place.get(x) is Place.SMEM}
    return frozenset(b.name for b in buffers if b.role == "tile" and b.dtype.bytes == 2 and len(dims[b.name]) >= 2
                     and dims[b.name][-1] in (16, 32) and b.name not in wmma)


def _only_wgmma_reads(c: Concrete, registers: dict[Node, Tiling], flash_of: dict[Node, Flash]) -> bool:
    """Whether no product other than those on wgmma reads a swizzled buffer (element reads are fine: they go
    through the same address arithmetic; ldmatrix and wmma assume padded rows)."""
    names, p = swizzled(c, registers, flash_of), plan(c.kernel)
    wg = {m for m, _ in _wgmma_products(c, registers, flash_of)}
    others = [n for n in c.kernel.body() if n.op == "matmul" and n not in wg]
    return not any(p.place.get(x) is Place.SMEM and p.buffer(x).name in names
                   for n in others for x in (n.args[0], stored_operand(n.args[1])[0]))


def padding(c: Concrete, b: Buffer) -> int:
    """Elements after each row of a buffer: its `Buffer.pad` (the most the shared-memory constraint allows
    for) where rows are 64 bytes or more and a multiple of 32, whose 8 rows of an ldmatrix would otherwise
    share banks 4 to 8 ways; none for other rows, where padding would cost more than it saves."""
    return _pad(b, c.shape(b))


def _pad(b: Buffer, shape: tuple[int, ...]) -> int:
    row = shape[-1] * b.dtype.bytes if shape else 0
    return b.pad if b.pad and row >= 64 and row % 32 == 0 else 0


SWIZZLE_ATOM = 1024  # bytes: 8 rows of 128 bytes, the 128-byte swizzle's repeating pattern


def _aligned(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def layout(c: Concrete, config: CodegenConfig) -> Layout:
    """The kernel's threads, register-tiled products, pipeline stages and shared-memory buffers (worked out once
    per concrete kernel and config: the tuner asks for it to fit each trial and again to price it)."""
    key = ("layout", config)
    if key not in c.memo:
        c.memo[key] = _layout(c, config)
    return c.memo[key]


def _layout(c: Concrete, config: CodegenConfig) -> Layout:
    flash_of = flash_products(c, config)
    need = max([config.threads] + [32 * f.warps for f in flash_of.values()])
    registers, threads = register_products(c, replace(config, threads=need))
    k, p = c.kernel, plan(c.kernel)
    varying = loop_varying(k)
    gone = unbuffered(p, flash_of)
    buffers = [b for b in p.buffers if b.name not in gone]
    live = lifetimes(k) | dict.fromkeys(written_after(p, registers, flash_of), (AFTER, AFTER))
    swizzle = swizzled(c, registers, flash_of)
    if swizzle and not _only_wgmma_reads(c, registers, flash_of):  # another product reads a tile as padded rows
        return layout(c, replace(config, wgmma=False))
    dims = buffer_shapes(c)
    xor = xor_rows(c, buffers, dims, registers, flash_of)
    pads = {b.name: 0 if b.name in swizzle or b.name in xor else _pad(b, dims[b.name]) for b in buffers}
    pads |= written_back(p, registers, flash_of, dims)
    size = {b.name: _size(b, dims[b.name], pads[b.name]) for b in buffers}
    staged = {b.name for b in buffers if b.role == "tile" and b.node in varying}
    names = [b.name for b in buffers]
    most = 1
    turns = (config.pingpong and config.stages >= PINGPONG_STAGES - 1 and takes_turns(c, registers, flash_of, threads)
             and overlap(c, flash_of, PINGPONG_STAGES, staged, threads))
    if c.loop > 1 and staged and all(copy_bytes(c, b.node, config) for b in buffers if b.name in staged):
        most = max(1, min(config.stages + turns, c.loop))  # taking turns, the loads run one stage less ahead
        if config.stages > 1 and not swizzle:  # no products on warpgroups (nor, so, any taking turns)
            most = max(most, deepened(iteration_bytes(c), c.loop, config))
    align = SWIZZLE_ATOM if swizzle else ALIGN  # every buffer, so the swizzled ones start on an atom
    by_tma = copied_by_tma(c, staged, swizzle, config)

    def fit(top: int) -> tuple:
        for stages in range(top, 0, -1):  # as many as fit
            taken = {n: _aligned(size[n], align) * (stages if n in staged else 1) for n in names}
            offsets, smem = arrange(names, taken, live)
            pingpong = turns and stages >= PINGPONG_STAGES
            tma = by_tma if stages > 1 else frozenset()
            warp = copy_warp(c, registers, in_flight(c, registers, flash_of, stages, staged), pingpong, tma, threads,
                             config)
            mbarriers = _aligned(smem, 16)
            if pingpong or tma:  # a full one per stage (and, taking turns or with a copy warp, an empty one)
                smem = mbarriers + (16 if pingpong or warp else 8) * stages
            if smem <= config.smem_limit:
                break
        return stages, taken, offsets, smem, pingpong, tma, mbarriers, warp
    stages, taken, offsets, smem, pingpong, tma, mbarriers, warp = fit(most)
    if most > 1 and (held := held_by_batches(c, registers, flash_of, staged, threads, config)):
        deeper = fit(min(most + held, c.loop))  # only where it leaves as many blocks per SM
        if deeper[0] > stages and config.smem_per_sm // deeper[3] >= config.smem_per_sm // smem:
            stages, taken, offsets, smem, pingpong, tma, mbarriers, warp = deeper
    if swizzle and smem > config.smem_limit:  # the atoms' alignment costs what the limit lacks: no wgmma
        return layout(c, replace(config, wgmma=False))
    sizes = {n: taken[n] if n in staged and stages > 1 else size[n] for n in names}
    return Layout(threads, registers, flash_of, stages, pads, swizzle, offsets, sizes, max(smem, 16),
                  {n: live[n] for n in names}, in_flight(c, registers, flash_of, stages, staged),
                  overlap(c, flash_of, stages, staged, threads), pingpong, mbarriers if pingpong or tma else 0, tma, xor,
                  warp)


def tile_bytes(c: Concrete) -> list[tuple[Node, int]]:
    """Each loaded tile of the kernel with the bytes one load of it brings from device memory (as stored)."""
    k = c.kernel
    return [(n, math.prod(c.shape(n)) * storage(k.inputs[load.source]).bytes) for load in k.loads
            if (n := k.tile_node(load.tile)) is not None]


def iteration_bytes(c: Concrete, but: frozenset[str] = frozenset()) -> int:
    """The bytes a block's loop tiles (less the buffers named in `but`) bring from device memory each iteration."""
    varying, p = loop_varying(c.kernel), plan(c.kernel)
    return sum(b for n, b in tile_bytes(c) if n in varying and p.buffer(n).name not in but)


def deepened(step: int, loop: int, config: CodegenConfig) -> int:
    """The stages of a pipelined loop whose tiles bring `step` bytes per iteration, so that the iterations
    ahead (stages - 1) hold `config.flight` bytes: by Little's law an SM streams at most the bytes it keeps
    in flight per memory latency, and a loop of small tiles at the configured depth would wait a latency
    for every few hundred bytes. At most `MAX_STAGES` and the loop's length (the last stage then holds its
    last iteration); where the tiles are large this is fewer than `config.stages`, which then decides."""
    return max(1, min(1 + -(-config.flight // max(step, 1)), MAX_STAGES, loop))


PINGPONG_STAGES = 4  # the fewest with which two warpgroups taking turns keep a load in flight (`Layout.lead`)


def takes_turns(c: Concrete, registers: dict[Node, Tiling], flash_of: dict[Node, Flash], threads: int) -> bool:
    """Whether the loop is one online softmax on exactly two warpgroups and nothing else, so that the two may
    take turns on the tensor cores (FlashAttention-3's ping-pong): one issues its scores and the late `p @ v`
    while the other computes its softmax, in the order two named barriers set. The block-wide barrier of
    each iteration would hold them in step, so the stages are paced by mbarriers instead: a full one per
    stage that every thread's cp.async arrives at when its copies complete, an empty one that every thread
    arrives at once its `p @ v` of that stage has landed. (With `overlap`, and the stages that leaves
    `lead` 1 or more: `layout`.)"""
    wg = [f for f in flash_of.values() if f.wg]
    if registers or len(flash_of) != 1 or len(wg) != 1 or wg[0].warps != 8 or threads != 256:
        return False
    k, p = c.kernel, plan(c.kernel)
    body = k.body()
    after, varying, (s,) = after_loop(body), loop_varying(k), flash_of
    own = flash_values(p, flash_of) | set(p.users[s])
    return all(n in own or n.op == "tile" or OPS[n.op].kind is not Kind.ACCUMULATE
               and (n not in varying or p.place.get(n) is not Place.SMEM) for n in in_loop(body, after))


def held_by_batches(c: Concrete, registers: dict[Node, Tiling], flash_of: dict[Node, Flash], staged: set[str],
                    threads: int, config: CodegenConfig) -> int:
    """The stages a pipeline at the configured depth gets besides, so that its copies still run `config.stages
    - 1` iterations ahead where a wgmma batch reads the stage of the iteration before (`in_flight`, `overlap`): 1
    there, 0 elsewhere (taking turns adds its own). Loads one iteration ahead wait for their tiles every
    iteration where a tile's latency and transfer exceed an iteration's products (`intake.pipeline_seconds`:
    48 KB at 8 warps' intake and 600 ns, 1.5 us, against about 1 us for 4.2 MFLOP of wgmma on one SM)."""
    return int(config.stages >= 3 and (in_flight(c, registers, flash_of, 3, staged)
                                       or overlap(c, flash_of, 3, staged, threads)))


def in_flight(c: Concrete, registers: dict[Node, Tiling], flash_of: dict[Node, Flash], stages: int,
              staged: set[str]) -> bool:
    """Whether each iteration's register-tiled wgmma batch stays in flight while the next iteration waits for
    its tiles and computes what comes before its own batch (`wgmma_wait<1>`): where every operand of those
    products is a pipelined loop tile and there are 3 or more stages. The stage a batch reads is then
    refilled only after the next iteration's barrier, so the copies run stages - 2 iterations ahead. Not
    beside online softmax on wgmma, whose waits count the batches it commits in the same iteration."""
    wg = [acc.args[0] for acc, t in registers.items() if t.orient == "wg"]
    p = plan(c.kernel)
    return stages >= 3 and bool(wg) and not any(f.wg for f in flash_of.values()) and all(
        p.buffer(x).name in staged for m in wg for x in (m.args[0], stored_operand(m.args[1])[0]))


def overlap(c: Concrete, flash_of: dict[Node, Flash], stages: int, staged: set[str], threads: int) -> bool:
    """Whether online softmax on wgmma runs `p @ v` one iteration late (FlashAttention-3's pipelining of the
    two products with the softmax): iteration `it` issues its scores' batch and then the iteration before's
    `p @ v`, waits only for the scores (`wgmma_wait<1>`), and computes their max and exp while `p @ v` runs;
    the last one follows the loop. Where every tile v that `p @ v` reads is a pipelined loop tile and there
    are 3 or more stages: v's stage of the iteration before is then read through this iteration, so the
    copies run stages - 2 iterations ahead. Only where every warp of the block takes part: ptxas serializes
    a batch issued under the branch that leaves the others out (note C7520)."""
    p = plan(c.kernel)
    wg = [(s, f) for s, f in flash_of.items() if f.wg]
    vs = [u.args[1] for s, _ in wg for u in p.users[s] if len(u.args) > 1]
    return (stages >= 3 and bool(vs) and all(p.buffer(v).name in staged for v in vs)
            and all(32 * f.warps == threads for _, f in wg))


def written_after(p: Plan, registers: dict[Node, Tiling], flash_of: dict[Node, Flash]) -> set[str]:
    """State buffers the code first writes after the loop (they need no start value, and share bytes with
    buffers used before and in it): those of register-tiled products, and online softmax's in registers."""
    accs = list(registers) + [u for s in flash_of for u in p.users[s] if u in p.state]
    return {b.name for acc in accs for b in p.state[acc].values()}


def written_back(p: Plan, registers: dict[Node, Tiling], flash_of: dict[Node, Flash], dims: dict) -> dict[str, int]:
    """Elements after each row of the f32 states that register-tiled products and online softmax write from
    registers after the loop, so that those writes fall on distinct banks. A warp writes 8 rows at a time: in
    the accumulators' layout each lane 2 adjacent floats of one row (a half warp, 4 rows of 32 bytes, one
    wavefront where rows are 8 banks apart: a row stride of 8 or 24 floats modulo 32, 8 floats padding rows
    that are a multiple of 16); transposed ("nm"), each lane 1 float of rows 0, 2, 4, 6 (one wavefront where
    those are 8 banks apart: a stride of 4 or 12 modulo 16). Rows under 32 floats are left alone, whose readers
    may take a quarter warp across rows."""
    accs = [(acc, t.orient) for acc, t in registers.items()] + [
        (u, "mn") for s in flash_of for u in p.users[s] if u in p.state and ACCUMULATORS[u.op].like == "matmul"]
    pads = {}
    for acc, orient in accs:
        b = p.state[acc][ACCUMULATORS[acc.op].state[-1]]
        shape = dims[b.name]
        if b.dtype.bytes == 4 and len(shape) >= 2 and math.prod(shape[:-1]) > 1 and shape[-1] >= 32:
            pads[b.name] = 4 if orient == "nm" else 8 if shape[-1] % 32 in (0, 16) else 0
    return pads


def _size(b: Buffer, shape: tuple[int, ...], pad: int) -> int:
    rows = math.prod(shape[:-1]) if shape else 1
    return (math.prod(shape) + rows * pad) * b.dtype.bytes


def stage_elements(laid: Layout, b: Buffer) -> int:
    """Elements from one stage of a pipelined loop tile to the next (each stage aligned as `layout` laid it)."""
    return laid.sizes[b.name] // laid.stages // b.dtype.bytes


def blocks_per_sm(smem: int, threads: int, registers: int, hardware) -> int:
    """How many blocks an SM holds: by shared memory, threads, registers (64K per SM) and the block limit."""
    by_regs = 65536 // max(1, registers * threads) if registers else hardware.max_blocks_per_sm
    return max(0, min(hardware.smem_per_sm // max(smem, 1), hardware.max_threads_per_sm // threads, by_regs,
                      hardware.max_blocks_per_sm))

