"""The reference semantics: a float64 NumPy interpreter for checked programs, the oracle of the project.

Every operator's meaning is one entry of `NUMPY`. Inputs of any float dtype are cast to float64 and every
operation runs in float64; storage dtypes only decide how random inputs are rounded (`quantize`), so that
inputs saved as f16 and re-read give the same result (and, asked for, how a product's operands are rounded:
`evaluate_nodes`'s `rounded`). Sizes come from a binding of the dim symbols: the
defaults, `--dims` overrides, and whatever the given input arrays fix. A whole program is evaluated by
`blocks.evaluate`, which runs custom kernels in the block interpreter and everything else here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping

import numpy as np
import sympy

from ..ir.accumulators import ACCUMULATORS, fold_along
from ..base.errors import PrismError
from ..ir.nodes import DType, Node, Program
from ..ir.ops import GELU_TANH_CUBIC, GELU_TANH_SCALE, LOOP_DIM, OPS, Kind
from ..ir.shapes import fmt_shape
from ..kernels.position import extent

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x):
    # Split by sign so that exp never overflows: 1/(1+e^-x) for x >= 0, e^x/(1+e^x) otherwise.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softmax(x):
    shifted = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=-1, keepdims=True)


def _padded(x: np.ndarray, *dims: int) -> tuple[np.ndarray, list[int]]:
    """`x` with leading size-1 dims so that every (negative) dim in `dims` exists, and those dims as indices."""
    rank = max(x.ndim, *(-d for d in dims))
    x = x.reshape((1,) * (rank - x.ndim) + x.shape)
    return x, [d % rank for d in dims]


def _split(x, dim: int, block: int, count: int):
    """Cut `dim` into `count` equal pieces and lay them along `block` (a size-1 dim): piece k at index k."""
    x, (i, j) = _padded(np.asarray(x), dim, block)
    if i == j or x.shape[j] != 1 or count < 1 or x.shape[i] % count:
        raise ValueError(f"cannot split a dim of size {x.shape[i]} into {count} pieces along a dim of size {x.shape[j]}")
    return np.concatenate(np.split(x, count, axis=i), axis=j)


def _concat(x, dim: int, block: int):
    """The inverse of `_split`: the pieces along `block` side by side in `dim`, in order."""
    x, (i, j) = _padded(np.asarray(x), dim, block)
    if i == j:
        raise ValueError("concat needs two different dims")
    return np.concatenate(np.split(x, x.shape[j], axis=j), axis=i)


def rotate_half(x):
    """The last dim's second half negated, then its first half (NumPy arrays of numbers or of formulas)."""
    if x.shape[-1] % 2:
        raise ValueError(f"rope needs an even last dim, got {x.shape[-1]}")
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _causal(x):
    """-inf above the diagonal that ends at the last row's last column (rows aligned to the end of the columns)."""
    x, _ = _padded(np.asarray(x), -2)
    rows, cols = x.shape[-2:]
    above = np.arange(cols)[None, :] > np.arange(rows)[:, None] + (cols - rows)
    return np.where(above, -np.inf, x)


def _from_end(x, dim: int):
    """Each index along `dim` counted from the end, in a tensor of rank -dim whose other dims have size 1."""
    x, (i,) = _padded(np.asarray(x), dim)
    n = x.shape[i]
    return np.arange(n - 1, -1, -1, dtype=np.float64).reshape((n,) + (1,) * (-dim - 1))


def _causal_at(x, rows, cols):
    """-inf where a column's place from the end is below its row's: `_causal` for tiles placed in whole tensors."""
    x = np.asarray(x)
    return np.where(np.asarray(cols) < np.asarray(rows), -np.inf, x)


def _layer_norm(x, eps):
    centred = x - np.mean(x, axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(np.square(centred), axis=-1, keepdims=True) + eps)


def _swap(x, i: int, j: int):
    x, (i, j) = _padded(np.asarray(x), i, j)
    return np.swapaxes(x, i, j)


NUMPY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "matmul": np.matmul,
    "neg": np.negative,
    "exp": np.exp,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "square": np.square,
    "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "relu": lambda x: np.maximum(x, 0.0),
    "tanh": np.tanh,
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(GELU_TANH_SCALE * (x + GELU_TANH_CUBIC * x**3))),
    "sum": lambda x, axis: np.sum(x, axis=axis, keepdims=True),
    "max": lambda x, axis: np.max(x, axis=axis, keepdims=True),
    "mean": lambda x, axis: np.mean(x, axis=axis, keepdims=True),
    "rms_norm": lambda x: x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True)),
    "rms_norm_eps": lambda x, eps: x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps),
    "layer_norm": _layer_norm,
    "softmax": _softmax,
    "rope": lambda x, c, s: x * c + rotate_half(x) * s,
    "transpose": _swap,
    "causal": _causal,
    "causal_at": _causal_at,
    "from_end": _from_end,
    "split": _split,
    "concat": _concat,
}
NUMPY.update({name: (lambda name: lambda *xs: fold_along(name, LOOP_DIM, *xs))(name) for name in ACCUMULATORS})

Binding = Mapping[sympy.Symbol, int]


def concrete_shape(shape, binding: Binding) -> tuple[int, ...]:
    return tuple(int(s.xreplace(binding)) if isinstance(s, sympy.Basic) else int(s) for s in shape)


def apply(node: Node, args: list[np.ndarray], rounded: bool = False, kernel_arithmetic: DType | None = None
          ) -> np.ndarray:
    """One node's value from its operands' values, in float64. `rounded`: a product's operands are first
    rounded to their storage dtypes, as tensor cores take them, and the arithmetic is a kernel's (`evaluate_nodes`):
    `kernel_arithmetic`, that of the kernel the node is in (`kernels.fusion.compute_dtype`), else `arithmetic`'s."""
    if node.op == "const":
        return np.float64(node.attr)
    if rounded and node.op == "matmul":
        args = [quantize(np.asarray(a, dtype=np.float64), n.dtype) for a, n in zip(args, node.args)]
    extra = node.attr if OPS[node.op].kind in (Kind.SPLIT, Kind.CONCAT, Kind.TRANSPOSE) else ((node.attr,) if node.attr is not None else ())
    if rounded and (kernel_arithmetic or arithmetic(node)) is DType.F32:  # operands, result and NumPy's own steps (a product's sums) in f32
        single = NUMPY[node.op](*(np.asarray(a, dtype=np.float32) for a in args), *extra)
        return np.asarray(single, dtype=np.float32).astype(np.float64)
    return np.asarray(NUMPY[node.op](*args, *extra), dtype=np.float64)


def arithmetic(node: Node) -> DType:
    """The type a kernel computes `node` in, where the kernel is not known: f32, or f64 where it or an operand is f64
    (`kernels.fusion.compute_dtype` decides it per kernel, from the same dtypes over the kernel's body)."""
    return DType.F64 if DType.F64 in (node.dtype, *(a.dtype for a in node.args)) else DType.F32


def evaluate_nodes(roots: list[Node], env: Mapping[Node, np.ndarray], kernels=None,
                   rounded: bool = False) -> dict[Node, np.ndarray]:
    """Evaluate `roots` given values for the leaves in `env` (inputs); every node computed once, in float64.

    Outputs of custom kernels are computed by `kernels(node, operand values)` (the block interpreter).
    `rounded`: the operands of every product are rounded to their storage dtypes first, the roundings no
    kernel on tensor cores can avoid, and every operation runs in the type a kernel computes it in (`arithmetic`:
    f32 but where f64 is stored), so that an output the program's own conditioning makes sensitive to f32's
    roundings (scores in the tens before an exp) shows it. It is not the oracle: the checks measure against it
    only how far those roundings alone move an output (`backend.compare.Tolerance`)."""
    values: dict[Node, np.ndarray] = dict(env)
    with np.errstate(all="ignore"):  # inf/nan are results to report, not exceptions
        for root in roots:
            for node in root.walk():
                if node in values:
                    continue
                if node.op == "input":
                    raise KeyError(f"no value for input '{node.attr}'")
                args = [values[a] for a in node.args]
                values[node] = kernels(node, args) if node.op == "kernel" else apply(node, args, rounded)
    return values


def bind_dims(program: Program, overrides: Mapping[str, int] | None = None,
              inputs: Mapping[str, np.ndarray] | None = None) -> dict[sympy.Symbol, int]:
    """Sizes for every dim: `overrides` first, then what the input arrays fix, then the defaults.

    Every given array is checked against its declared shape under the final binding.
    """
    overrides = dict(overrides or {})
    for name in overrides:
        if program.dim(name) is None:
            known = ", ".join(d.name for d in program.dims) or "none"
            raise PrismError(f"program '{program.name}' has no dim '{name}' (its dims: {known})")
        if overrides[name] < 1:
            raise PrismError(f"dim {name} must be at least 1, got {overrides[name]}")
    binding = {d.symbol: overrides[d.name] for d in program.dims if d.name in overrides}
    arrays = dict(inputs or {})
    for node in program.inputs:  # let inputs fix the dims nobody named
        arr = arrays.get(node.attr)
        if arr is None or np.ndim(arr) != node.rank:
            continue
        for size, actual in zip(node.shape, np.shape(arr)):
            if isinstance(size, sympy.Symbol) and size not in binding:
                if actual < 1:
                    raise PrismError(f"input '{node.attr}' has shape {list(np.shape(arr))}: dim {size} must be at least 1")
                binding[size] = int(actual)
    for d in program.dims:
        binding.setdefault(d.symbol, d.default)
    for node in program.inputs:
        if node.attr in arrays:
            check_input(node, arrays[node.attr], binding)
    for _, rope in _with_kernel_bodies(program, "rope"):  # a tile holds the whole last dim RoPE rotates
        try:
            last = concrete_shape(rope.shape[-1:], binding)[0]
        except TypeError:  # a size that names a kernel parameter not chosen yet
            continue
        if last % 2:
            raise PrismError(f"rope needs an even last dim (it rotates its two halves); under this binding the "
                             f"last dim of {fmt_shape(rope.shape)} is {last}", program.locs.get(rope))
    _check_causal(program, binding)
    return binding


def _with_kernel_bodies(program: Program, op: str):
    """(the kernel or None, node) for each node of `op` in the program and in its kernels' bodies."""
    for node in program.nodes():
        kernel = node.attr[0] if node.op == "kernel" else None
        for n in kernel.body() if kernel is not None else [node]:
            if n.op == op:
                yield kernel, n


def _check_causal(program: Program, binding: Binding) -> None:
    """`causal` places the query rows at the end of the key positions, so it needs at least as many columns as
    rows: with more, the first rows would have every column masked, and their softmax no value. Checked
    under the binding, for the program's masks and those in its kernels (placed in the whole scores)."""
    def size(s) -> int | None:  # None: a size that names a kernel parameter not chosen yet
        with contextlib.suppress(TypeError):
            return concrete_shape((s,), binding)[0]
        return None

    def shape_of(node: Node) -> tuple[int | None, ...]:  # (a tile's rows may hold a parameter where its columns
        return tuple(size(s) for s in node.shape)       # do not: causal(sum(xt, -1)) is n x 1 at every one)

    for kernel, mask in _with_kernel_bodies(program, "causal"):
        rows, cols = extent(shape_of, kernel, mask)
        if rows is not None and cols is not None and rows > cols:
            raise PrismError(f"causal needs at least as many columns as rows (the query rows are the last of "
                             f"the key positions); under this binding the scores are {rows} x {cols}, so their "
                             f"first {rows - cols} rows would have every column masked", program.locs.get(mask))


# The float64 reference evaluates tensors of at most this many elements (8 GiB each in float64): a larger
# one would exhaust a workstation's memory, and a binding such as n = 2^62 is a mistake, not a workload.
MAX_ELEMENTS = 2**30
NUMPY_MAX_DIMS = 64  # NumPy's limit on an array's dims


def check_sizes(program: Program, binding: Binding, nodes: list[Node] | None = None) -> None:
    """Refuse, before anything is allocated, a binding under which a tensor of the program (its inputs and
    every intermediate value, or just `nodes`) is beyond what the reference can hold. Sizes that name a
    symbol `binding` lacks (a kernel parameter not chosen yet) are not checked."""
    for node in program.nodes() if nodes is None else nodes:
        what = f"input '{node.attr}'" if node.op == "input" else f"a tensor of shape {fmt_shape(node.shape)}"
        where = program.locs.get(node)
        if node.rank > NUMPY_MAX_DIMS:
            raise PrismError(f"{what} has {node.rank} dims; the float64 reference handles at most {NUMPY_MAX_DIMS} "
                             "(NumPy's limit)", where)
        sizes = [s.xreplace(binding) if isinstance(s, sympy.Basic) else s for s in node.shape]
        if any(isinstance(s, sympy.Basic) and not s.is_Integer for s in sizes):
            continue

        count = math.prod(int(s) for s in sizes)
        if count > MAX_ELEMENTS:
            named = sorted({x for s in node.shape if isinstance(s, sympy.Basic) for x in s.free_symbols}, key=str)
            dims = ", ".join(f"{x} = {binding[x]}" for x in named)
            sizes = (f"dim {dims} is" if len(named) == 1 else f"dims {dims} are") if named else "these sizes are"
            raise PrismError(f"{sizes} too large: {what} would have "
                             f"{count:,} elements; the float64 reference evaluates tensors of at most "
                             f"{MAX_ELEMENTS:,} (2^30) elements", where)


def check_input(node: Node, arr: np.ndarray, binding: Binding) -> None:
    expected = concrete_shape(node.shape, binding)
    sym = fmt_shape(node.shape)
    if np.ndim(arr) != node.rank:  # its sizes fixed no dim, so a concrete expected shape would be made up
        raise PrismError(f"input '{node.attr}' should have {node.rank} dims {sym}, got shape {list(np.shape(arr))}")
    if tuple(np.shape(arr)) != expected:
        raise PrismError(
            f"input '{node.attr}' should have shape {list(expected)} ({sym}), got {list(np.shape(arr))}"
        )
    require_floats(node.attr, arr)


def require_floats(name: str, arr) -> None:
    """Input `name`'s array must hold floats (an int or bool array is a mistake, not a value to convert)."""
    if not np.issubdtype(np.asarray(arr).dtype, np.floating):
        raise PrismError(f"input '{name}' should hold floats, got {np.asarray(arr).dtype}")


def held(name: str, arr: np.ndarray, dtype: DType | None) -> np.ndarray:
    """Input `name`'s values as its storage dtype holds them (`quantize`), for a user's file of inputs: an error
    that says where a finite value is past the dtype's range, which the GPU would read as inf (and the outputs then
    not be defined). Not for arrays the checks make: the steadiness screen evaluates in float64 on values far past
    f16's range on purpose (`search.assembly.far_inputs`)."""
    arr = np.asarray(arr, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # what overflows is said below, not warned of
        kept = quantize(arr, dtype)
    lost = np.isfinite(arr) & ~np.isfinite(kept)
    if lost.any():
        at = tuple(int(i) for i in np.argwhere(lost)[0])
        raise PrismError(f"input '{name}'{list(at)} = {float(arr[at]):g} does not fit {dtype.value} (largest "
                         f"{_LARGEST[dtype]:g}; {int(lost.sum())} value(s) past it)")
    return kept


_LARGEST = {DType.F16: 65504.0, DType.BF16: 3.3895313892515355e38, DType.F32: float(np.finfo(np.float32).max),
            DType.F64: float(np.finfo(np.float64).max)}


def quantize(x: np.ndarray, dtype: DType | None) -> np.ndarray:
    """Round float64 values to the storage dtype and back, so the reference sees what the GPU would."""
    if dtype is DType.F16:
        return x.astype(np.float16).astype(np.float64)
    if dtype is DType.F32:
        return x.astype(np.float32).astype(np.float64)
    if dtype is DType.BF16:
        bits = x.astype(np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        return rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def random_inputs(program: Program, binding: Binding, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal inputs rounded to each input's dtype; the same seed gives the same arrays."""
    check_sizes(program, binding, list(program.inputs))
    rng = np.random.default_rng(seed)
    return {
        node.attr: quantize(rng.standard_normal(concrete_shape(node.shape, binding)), node.dtype)
        for node in program.inputs
    }


def check_inputs(program: Program, binding: Binding, seed: int = 0) -> dict[str, np.ndarray]:
    """The inputs the checks run a program on: `random_inputs`, with each weight (`weights`) divided by the square
    root of the longest contraction it takes part in, as a layer's weights are initialised: each product's values
    then stay about as large as its left operand's, where standard-normal weights grow them by that root at every
    product, and a gated MLP of projections of 4096 and 11008 would put most of its f16 output past 65504. The
    values are drawn first and rounded again after the division: the arrays are `random_inputs`' but for the
    weights' scale."""
    inputs = random_inputs(program, binding, seed)
    dtypes = {n.attr: n.dtype for n in program.inputs}
    fan_in = {name: max(concrete_shape(sizes, binding)) for name, sizes in weights(program).items()}
    return {name: quantize(a / np.sqrt(fan_in[name]), dtypes[name]) if fan_in.get(name, 1) > 1 else a
            for name, a in inputs.items()}


def weights(program: Program) -> dict[str, tuple]:
    """The inputs that are weights, with the longest contraction each takes part in: a matrix (rank 2) that is the
    right operand of a product, through transposes, in the program or in one of its custom kernels (as a tile)."""
    from ..kernels.kernel import kernels_of

    found: dict[str, list] = {}

    def note(b: Node, source) -> None:
        flips = 0
        while b.op == "transpose":
            b, flips = b.args[0], flips + 1
        if (w := source(b)) is not None and w.op == "input" and w.rank == 2:
            found.setdefault(w.attr, []).append(w.shape[-1 if flips % 2 else -2])

    for n in program.nodes():
        if n.op == "matmul":
            note(n.args[1], lambda b: b)
    for k in kernels_of(program):
        for n in k.body():
            if n.op == "matmul":
                note(n.args[1], lambda b: k.inputs[k.load(b.attr).source] if b.op == "tile" else None)
    return {name: tuple(sizes) for name, sizes in found.items()}
