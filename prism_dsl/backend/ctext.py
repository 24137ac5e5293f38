"""C text for the code generator: C types, identifiers and comments made from user text, index arithmetic,
and the names of a block taken in a launch order of its own.

Where it sits: shared by `codegen` and `tensor_steps` (and the emulation's harness, for `CTYPE`). Names in
the generated code are derived from the program's, with every character outside [A-Za-z0-9_] replaced, and
comments quote the program sanitized the same way, so no user text reaches the code unsanitized.
"""

from __future__ import annotations

import math
import re

from ..ir.nodes import DType, Node
from ..kernels.constraints import INT_MAX
from ..kernels.kernel import Kernel
from ..kernels.position import launch_order, longest_first

CTYPE = {DType.F16: "half", DType.BF16: "__nv_bfloat16", DType.F32: "float", DType.F64: "double"}
# How each element-wise op reads in C, over the arithmetic type `real` (helpers live in prism.cuh).
C_OPS = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "neg": "(-{0})", "exp": "prism::exp_({0})", "sqrt": "prism::sqrt_({0})", "rsqrt": "prism::rsqrt_({0})",
    "square": "({0} * {0})", "sigmoid": "prism::sigmoid_({0})", "silu": "prism::silu_({0})",
    "gelu": "prism::gelu_({0})", "relu": "prism::relu_({0})", "tanh": "prism::tanh_({0})",
    "gelu_tanh": "prism::gelu_tanh_({0})",
}
# A thread's sum over a row of at least twice this many values keeps that many interleaved partial sums, added
# pairwise at the end: the rounding grows with a sum's length, and one running sum over 256 piece means near 1000
# lost 4e-4 of a LayerNorm's centred values in f32 (8 partial sums: a quarter of that), besides the 8 independent
# adds a thread can have in flight.
SUM_PARTS = 8


def ident(text: str) -> str:
    """A C identifier fragment from user text: [A-Za-z0-9_] only, never starting with a digit."""
    out = re.sub(r"[^A-Za-z0-9_]", "_", text)
    return out if out and not out[0].isdigit() else "_" + out


def comment(text: str) -> str:
    """User text made safe inside a // comment: one line, ASCII, no backslash continuation."""
    return re.sub(r"[^ -~]", "?", text.replace("\\", "/"))[:200]


def tensor_name(node: Node) -> str:
    """The program-level name of a tensor a kernel reads: an input's name or a kernel output's store."""
    if node.op == "input":
        return node.attr
    if node.op == "kernel":
        kernel, index = node.attr
        return kernel.stores[index].name
    raise ValueError(f"a kernel operand must be an input or a kernel output, not {node.op}")


# -- index arithmetic ---------------------------------------------------------------------------------


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def decompose(var: str, shape: tuple[int, ...], prefix: str) -> tuple[list[str], list[str]]:
    """C lines that split flat index `var` (row-major over `shape`) into one index per dim, and those
    index expressions ("0" for dims of size 1)."""
    lines, idx = [], []
    for d, (size, stride) in enumerate(zip(shape, _strides(shape))):
        if size == 1:
            idx.append("0")
            continue
        expr = var if stride == 1 else f"{var} / {stride}"
        if d > 0 and any(s > 1 for s in shape[:d]):
            expr = f"({expr}) % {size}" if stride != 1 else f"{var} % {size}"
        lines.append(f"const int {prefix}{d} = {expr};")
        idx.append(f"{prefix}{d}")
    return lines, idx


def reads(name: str, *uses: str) -> bool:
    """Whether the code `uses` reads the variable `name` (one not read is not declared: nvcc warns of it)."""
    return any(re.search(rf"\b{name}\b", use) for use in uses)


def needed(lines: list[str], *uses: str) -> list[str]:
    """Those of `decompose`'s lines whose index the code `uses` reads."""
    return [line for line in lines if reads(line.split()[2], *uses)]


def address(parts: list[list[str]], shape: tuple[int, ...], reach: int = 0) -> str:
    """Row-major offset in a tensor of `shape` whose index in each dim is the sum of that dim's `parts`: in int
    arithmetic, or in 64-bit where the tensor has more elements than an int counts (a long-context key cache:
    b = 64, h = 8, kv = 131072, dh = 128 is 2^33), each dim's index widened before it meets its stride. In a
    dim that an int cannot index (a vector of 2^33 elements), each part is widened before its own product:
    `blockIdx.y * 33554432` wraps in 32 bits at block 128 however its sum is cast after. `reach`: the elements the
    indices may span, where more than the shape's (a tensor read in place, indexed past its end where guarded)."""
    wide = max(math.prod(shape), reach) - 1 > INT_MAX  # the last element's offset
    terms = []
    for p, size, stride in zip(parts, shape, _strides(shape)):
        if p and stride:
            term = " + ".join(p)
            if size - 1 > INT_MAX:
                term = " + ".join(f"(long long){x}" for x in p)
                terms.append(term if stride == 1 else f"({term}) * {stride}")
                continue
            if wide:
                terms.append(f"(long long)({term})" + ("" if stride == 1 else f" * {stride}"))
                continue
            terms.append(term if stride == 1 else f"({term}) * {stride}" if len(p) > 1 else f"{term} * {stride}")
    return " + ".join(terms) or "0"


def offset(idx: list[str], shape: tuple[int, ...], pad: int = 0, swizzle: bool = False, xor: bool = False) -> str:
    """Row-major offset of index expressions `idx` (aligned to the right of `shape`; size-1 dims
    broadcast and read index 0), in a buffer whose rows have `pad` elements more (`Buffer.pad`); or, with
    `swizzle`, in wgmma's 128-byte swizzle of a 16-bit matrix (`swizzled`); or, with `xor`, with each row's
    16-byte chunks permuted (`xor_column`: rows of 16 or 32 16-bit elements)."""
    rank = len(shape)
    idx = list(idx[len(idx) - rank:]) if len(idx) >= rank else ["0"] * (rank - len(idx)) + list(idx)
    idx = ["0" if size == 1 else i for i, size in zip(idx, shape)]  # a broadcast dim: its one row, unpermuted too
    if swizzle:
        return swizzled(idx[-2], idx[-1], shape[-2], shape[-1])
    if xor and idx[-2] != "0":  # row 0's chunks stay where they are
        idx = idx[:-1] + [xor_column(idx[-2], idx[-1], shape[-1])]
    terms = []
    for i, size, stride in zip(idx, shape, _strides(shape[:-1] + (shape[-1] + pad,) if shape else shape)):
        if size == 1 or i == "0":
            continue
        terms.append(i if stride == 1 else f"{i} * {stride}")
    return " + ".join(terms) or "0"


def xor_column(row: str, col: str, cols: int) -> str:
    """Where column `col` of row `row` sits in a row of `cols` 16-bit elements (16 or 32: rows of 32 or 64 bytes)
    whose 16-byte chunks are permuted by the row: chunk c at c ^ (row / L) % C, C the row's chunks and L the
    rows of a 128-byte line (`launch.xor_rows`). The 8 rows an ldmatrix reads, and the rows a quarter warp's
    16-byte copies fill, then fall on distinct banks without padding; a chunk's 8 elements stay together."""
    chunks, lines = cols // 8, 64 // cols
    c = col if col.isidentifier() or col.isdigit() else f"({col})"
    r = row if row.isidentifier() or row.isdigit() else f"({row})"
    return f"({c} ^ {r} / {lines} % {chunks} * 8)"


def swizzled(row: str, col: str, rows: int, cols: int) -> str:
    """The element offset of (row, col) in a rows x cols matrix of 16-bit elements stored for wgmma (cols a
    multiple of 64): blocks of 64 columns one after another, each rows x 128 bytes, and in each 8-row atom
    of 1024 bytes row r's 16-byte chunk c at chunk c ^ r % 8 (prism.cuh, "wgmma")."""
    r, c = (f"({x})" if not x.isidentifier() and not x.isdigit() else x for x in (row, col))
    block = f"{c} / 64 * {rows * 64} + " if cols > 64 else ""
    if row == "0":
        return f"{block}{c} % 64" if cols > 64 else c
    return f"{block}{r} * 64 + ({c} / 8 % 8 ^ {r} % 8) * 8 + {c} % 8"


def block_names(kernel: Kernel, grid: dict[str, int], sms: int) -> list[str]:
    """For a kernel that takes its blocks longest first (`kernels.position.longest_first`), the C lines that
    name the block the launch's block computes (`blk_x`, `blk_y`, `blk_z`, from the launch's index)."""
    rows, size = longest_first(kernel, grid, sms), {a: grid.get(a, 1) for a in ("x", "y", "z")}
    at, stride = {}, 1
    for a in launch_order(kernel, grid, sms):
        if grid[a] > 1:
            at[a] = f"launched / {stride} % {grid[a]}" if stride > 1 else f"launched % {grid[a]}"
            stride *= grid[a]
    at[rows] = f"{grid[rows] - 1} - {at[rows]}"
    return [f"const int launched = blockIdx.x + {size['x']} * (blockIdx.y + {size['y']} * blockIdx.z);"] + [
        f"[[maybe_unused]] const int blk_{a} = {at.get(a, '0')};" for a in ("x", "y", "z") if a in grid]


def reduction(op: str, length: int, term: str, init: str) -> list[str]:
    """C lines that leave in `acc` the sum (or max, by `op`) of `term` over `r` in [0, length) (`SUM_PARTS`)."""
    if op == "max" or length < 2 * SUM_PARTS:
        fold = f"acc = prism::max_(acc, {term});" if op == "max" else f"acc += {term};"
        return [f"real acc = {init};", f"for (int r = 0; r < {length}; ++r) {fold}"]
    parts = [f"part[{i}]" for i in range(SUM_PARTS)]
    while len(parts) > 1:
        parts = [f"({a} + {b})" for a, b in zip(parts[::2], parts[1::2])]
    whole = length - length % SUM_PARTS  # each part indexed by a constant once unrolled: registers, not the stack
    tail = [f"for (int r = {whole}; r < {length}; ++r) part[0] += {term};"] if whole < length else []
    step = f"r{SUM_PARTS}"
    return [f"real part[{SUM_PARTS}] = {{}};", f"for (int {step} = 0; {step} < {whole}; {step} += {SUM_PARTS}) {{",
            "#pragma unroll", f"    for (int p = 0; p < {SUM_PARTS}; ++p) {{ const int r = {step} + p; part[p] += {term}; }}",
            "}", *tail, f"const real acc = {parts[0][1:-1]};"]
