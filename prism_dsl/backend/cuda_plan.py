"""The runtime plan `cuda_runtime` launches: what a well-formed one holds (`problems`), and the tensor maps of the
kernels whose loop tiles the tensor memory accelerator copies (`backend.copies`), which the CUDA driver encodes
for the tensors' device addresses (`encode_map`); and what host data becomes in its storage dtype (bf16's bit
patterns, `to_bf16_bits`; a value past the dtype's range, `past_range`).

A plan is a JSON-compatible dict: the program's name, its inputs and outputs, every tensor's shape and storage
dtype, and the kernels to launch in order, each with its file, function, grid, block, dynamic shared memory,
the tensors it takes (`args`, in parameter order), those zeroed before it (`zero`), the tile counters of a
combining kernel in its launch or of sums across blocks (`tickets`), the f32 workspaces those sums add into
(`sums`, elements), and the tensor maps its first parameters are (`maps`: per map the tensor and the box one copy
brings, outer dims first).

A kernel's parameters go to the GPU as one buffer (pycuda packs it by a struct format), which must hold each at
the offset the compiled code reads it from (`parameter_layout`, `argument_format`): pointers alone fall one after
another, but a tensor map (`__grid_constant__ CUtensorMap`) sits where nvcc aligned it, 0x70 bytes in where it
is the first parameter on sm_90 (0x20 on sm_80), and everything after it moves with it.

Standalone like `cuda_runtime`, which loads it from beside itself: it imports nothing of the package, and the
compiler copies both beside the kernels it writes. It raises nothing of its own: problems come back as text,
which `cuda_runtime` raises as its PlanError.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct

import numpy as np

ITEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}  # per storage dtype
# The largest finite value of each storage dtype. The package's own table is `semantics.reference`'s, which says
# the same of a user's .npz (`held`); this module is standalone (copied beside the kernels), so it keeps its own.
LARGEST = {"f16": 65504.0, "bf16": 3.3895313892515355e38, "f32": 3.4028234663852886e38,
           "f64": 1.7976931348623157e308}
DTYPES = tuple(ITEM_BYTES)
MAX_THREADS = 1024
# CUtensorMapDataType of each storage dtype, and the encoding choices (cuda.h): the 128-byte swizzle wgmma reads
# (CU_TENSOR_MAP_SWIZZLE_128B), L2 lines of 128 bytes (CU_TENSOR_MAP_L2_PROMOTION_L2_128B), no interleave, no fill
# of what lies outside the tensor (the generated boxes never reach past it)
MAP_DTYPE = {"f16": 6, "bf16": 9, "f32": 7, "f64": 8}
SWIZZLE_128B, L2_PROMOTION_128B, MAP_BYTES, MAX_BOX = 3, 2, 128, 256
POINTER_BYTES = 8
KPARAM_INFO, SIZED = 0x17, 0x04  # a .nv.info attribute (EIATTR_KPARAM_INFO) and the format of one with a sized value


def problems(plan) -> str | None:
    """What is wrong with a plan, every problem at once; None for a well-formed one."""
    if not isinstance(plan, dict):
        return f"a plan is a dict, not {type(plan).__name__}"
    kinds = {"program": str, "inputs": list, "outputs": list, "tensors": dict, "kernels": list}
    found = [f"plan needs '{key}' ({kind.__name__})" for key, kind in kinds.items() if not isinstance(plan.get(key), kind)]
    if found:
        return "\n".join(found)
    tensors = plan["tensors"]
    for name, spec in tensors.items():
        shape, dtype = (spec.get("shape"), spec.get("dtype")) if isinstance(spec, dict) else (None, None)
        if not (isinstance(shape, list) and all(_positive_int(n) for n in shape)):
            found.append(f"tensor '{name}': shape must be a list of positive ints, not {shape!r}")
        elif "used" in spec and not (isinstance(u := spec["used"], list) and len(u) == len(shape)
                                     and all(_positive_int(n) and n <= m for n, m in zip(u, shape))):
            found.append(f"tensor '{name}': used (its first rows, as the caller passes it) must be a list of positive "
                         f"ints, one a dim, none past its shape {shape}, not {spec['used']!r}")
        if dtype not in DTYPES:
            found.append(f"tensor '{name}': dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    for role in ("inputs", "outputs"):
        if not all(isinstance(n, str) for n in plan[role]):
            return f"plan '{role}' must list tensor names (strings), not {plan[role]!r}"
        found += [f"{role[:-1]} '{n}' is not in 'tensors'" for n in plan[role] if n not in tensors]
        found += [f"{role[:-1]} '{n}' is listed twice" for n in sorted(set(plan[role])) if plan[role].count(n) > 1]
    found += [f"'{n}' is both an input and an output" for n in plan["outputs"] if n in plan["inputs"]]
    names = [k.get("name") for k in plan["kernels"] if isinstance(k, dict)]
    found += [f"kernel name '{n}' is used twice" for n in sorted(set(names), key=str) if names.count(n) > 1]
    for i, kernel in enumerate(plan["kernels"]):
        found += _kernel_problems(i, kernel, tensors, plan["inputs"])
    return f"plan for '{plan['program']}' is malformed:\n  " + "\n  ".join(found) if found else None


def used(spec: dict) -> tuple[int, ...]:
    """A tensor's shape as the caller passes or gets it: the kernels' (`shape`), or, where the compile rounded dims
    up for its tiles (`pipeline.padding`), the first rows of it (`used`): the rest of an input is zeros, the rest
    of an output is dropped."""
    return tuple(spec.get("used", spec["shape"]))


def padded(spec: dict, name: str, shape, error=ValueError) -> bool:
    """Whether input `name` of `shape` is to be padded to the kernels' shape: True at the caller's (`used`), False
    at the kernels' own (the caller padded it, zeros past its part: used as it is); `error` raised at any other."""
    full, want = tuple(spec["shape"]), used(spec)
    if tuple(shape) not in (want, full):
        built = (f" (or {full}, the size built, zeros past it)" if want != full else
                 " (the kernels read it in place, at the caller's size)" if spec.get("in_place") else "")
        raise error(f"input '{name}' has shape {tuple(shape)}; the program expects {want}{built}")
    return tuple(shape) != full


def _positive_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def _kernel_problems(i: int, kernel, tensors: dict, inputs: list) -> list[str]:
    if not isinstance(kernel, dict):
        return [f"kernel {i} is a {type(kernel).__name__}, not a dict"]
    where = f"kernel {i} ('{kernel.get('name', '?')}')"
    found = [f"{where}: '{key}' must be a string" for key in ("name", "file", "function")
             if not isinstance(kernel.get(key), str)]
    for key in ("grid", "block"):
        value = kernel.get(key)
        if not (isinstance(value, list) and len(value) == 3 and all(_positive_int(n) for n in value)):
            found.append(f"{where}: '{key}' must be 3 positive ints, not {value!r}")
        elif key == "block" and (threads := value[0] * value[1] * value[2]) > MAX_THREADS:
            found.append(f"{where}: a block of {value} has {threads} threads; CUDA allows at most {MAX_THREADS}")
    smem = kernel.get("smem", 0)
    if not (isinstance(smem, int) and not isinstance(smem, bool) and smem >= 0):
        found.append(f"{where}: 'smem' must be a non-negative int (bytes), not {smem!r}")
    if "tickets" in kernel and not _positive_int(tickets := kernel["tickets"]):  # tiles whose pieces it combines
        found.append(f"{where}: 'tickets' must be a positive int (tiles whose pieces it combines), not {tickets!r}")
    if "sums" in kernel and not (_positive_int(n := kernel["sums"]) and kernel.get("tickets")):  # sums' workspaces
        found.append(f"{where}: 'sums' must be a positive int (f32 elements its blocks add into), with 'tickets', "
                     f"not {n!r}")
    for key in ("args", "zero"):
        names = kernel.get(key, [] if key == "zero" else None)
        if not isinstance(names, list):
            found.append(f"{where}: '{key}' must be a list of tensor names")
            continue
        found += [f"{where}: {key} names unknown tensor {n!r}" for n in names if not isinstance(n, str) or n not in tensors]
        if key == "zero":
            found += [f"{where}: zeroes input '{n}', which the program must not write" for n in names if n in inputs]
    maps = kernel.get("maps", [])
    if not isinstance(maps, list):
        return found + [f"{where}: 'maps' must be a list of tensor maps"]
    return found + [f"{where}: {p}" for m in maps if (p := _map_problem(m, kernel.get("args"), tensors))]


def _map_problem(m, args, tensors: dict) -> str | None:
    """What is wrong with one tensor map of a kernel (its tensor one of the kernel's, a box the driver encodes)."""
    if not (isinstance(m, dict) and isinstance(m.get("tensor"), str) and isinstance(m.get("box"), list)):
        return f"a tensor map is {{'tensor': NAME, 'box': [...]}}, not {m!r}"
    name, box = m["tensor"], m["box"]
    if not isinstance(args, list) or name not in args or not isinstance(tensors.get(name), dict):
        return f"a tensor map's tensor '{name}' is not one of its args"
    shape, dtype = tensors[name].get("shape"), tensors[name].get("dtype")
    if not isinstance(shape, list) or len(box) != len(shape) or not 1 <= len(box) <= 5 or dtype not in ITEM_BYTES:
        return f"the tensor map of '{name}' needs a box of one size per dim of the tensor (1 to 5), not {box!r}"
    if not all(_positive_int(b) and b <= min(MAX_BOX, s if _positive_int(s) else 0) for b, s in zip(box, shape)):
        return f"the tensor map of '{name}': each box size is 1 to {MAX_BOX} and at most the tensor's, not {box!r}"
    if box[-1] * ITEM_BYTES[dtype] != 128 or shape[-1] * ITEM_BYTES[dtype] % 16:
        return (f"the tensor map of '{name}': its box's rows are 128 bytes (the swizzle's) and the tensor's a "
                f"multiple of 16, not {box[-1]} and {shape[-1]} elements of {dtype}")
    return None


@functools.cache
def _driver():
    """The CUDA driver library (the one pycuda loaded), for the call pycuda does not wrap."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    return lib


def encode_map(pointer: int, dtype: str, shape, box) -> bytes:
    """The 128-byte CUtensorMap of a contiguous tensor at device address `pointer` (shape and box outer dims
    first), with the 128-byte swizzle, as cuTensorMapEncodeTiled writes it; RuntimeError where the driver refuses."""
    rank, item = len(shape), ITEM_BYTES[dtype]
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims = (u64 * rank)(*reversed(shape))  # the driver's order: innermost dim first
    strides = (u64 * max(1, rank - 1))(*(item * math.prod(shape[rank - i:]) for i in range(1, rank)))  # bytes, dims 1..
    raw = ctypes.create_string_buffer(MAP_BYTES + 64)
    at = -(-ctypes.addressof(raw) // 64) * 64  # the map's address must be 64-byte aligned
    status = _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(at), MAP_DTYPE[dtype], u32(rank), ctypes.c_void_p(pointer), dims, strides,
        (u32 * rank)(*reversed(box)), (u32 * rank)(*[1] * rank), 0, SWIZZLE_128B, L2_PROMOTION_128B, 0)
    if status != 0:
        raise RuntimeError(f"the CUDA driver refuses the tensor map of a {dtype} tensor {list(shape)} at {pointer:#x} "
                           f"with box {list(box)} (cuTensorMapEncodeTiled: CUresult {status})")
    return ctypes.string_at(at, MAP_BYTES)


def parameter_layout(cubin: bytes, function: str) -> list[tuple[int, int]] | None:
    """(offset, bytes) of each parameter of `function`, in order, where its compiled code reads them: the
    EIATTR_KPARAM_INFO attributes of the cubin's `.nv.info.FUNCTION` section (what `cuobjdump -elf` prints as
    "Ordinal", "Offset" and "Size"). Each attribute is a format byte, an attribute byte and a 16-bit field, and
    those of format SIZED carry that many bytes after it: for a parameter, its index (32 bits), ordinal and
    offset (16 bits each), then a word whose top 14 bits are its size. None where `cubin` is not a 64-bit ELF
    image with that section, or the section does not name every parameter from 0 on once."""
    try:
        if cubin[:5] != b"\x7fELF\x02":
            return None
        shoff, = struct.unpack_from("<Q", cubin, 0x28)
        entry, count, names = struct.unpack_from("<HHH", cubin, 0x3A)

        def section(i: int) -> tuple[int, int, int]:  # (name offset, file offset, bytes)
            name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * entry)
            return name, offset, size
        strings = section(names)[1]
        wanted = f".nv.info.{function}".encode() + b"\0"
        found = [(offset, size) for i in range(count) for name, offset, size in [section(i)]
                 if cubin[strings + name:strings + name + len(wanted)] == wanted]
        if len(found) != 1:
            return None
        at, end = found[0][0], found[0][0] + found[0][1]
        params: dict[int, tuple[int, int]] = {}
        while at + 4 <= end:
            form, attribute, field = struct.unpack_from("<BBH", cubin, at)
            if form == SIZED and attribute == KPARAM_INFO and field >= 12:
                _, ordinal, offset, word = struct.unpack_from("<IHHI", cubin, at + 4)
                if ordinal in params:
                    return None
                params[ordinal] = (offset, word >> 18)
            at += 4 + (field if form == SIZED else 0)
    except struct.error:
        return None
    if sorted(params) != list(range(len(params))):
        return None
    return [params[i] for i in range(len(params))]


def argument_format(layout: list[tuple[int, int]] | None, sizes: list[int]) -> str | None:
    """The struct format that packs parameters of `sizes` bytes (MAP_BYTES: a tensor map, as bytes;
    POINTER_BYTES: a device pointer, as an int) at the offsets of `layout` (`parameter_layout`), padded between;
    None where the layout is missing or does not have those sizes."""
    if layout is None or [size for _, size in layout] != list(sizes):
        return None
    form, at = "", 0  # native: pycuda's own struct packer takes no byte-order prefix
    for offset, size in layout:
        if offset < at or size not in (MAP_BYTES, POINTER_BYTES) or (size == POINTER_BYTES and offset % 8):
            return None
        form += (f"{offset - at}x" if offset > at else "") + (f"{size}s" if size == MAP_BYTES else "P")
        at = offset + size
    return form


def kernel_arguments(cubin: bytes, kernel: dict) -> tuple[str, str | None]:
    """(the struct format pycuda packs a plan kernel's parameters by, what is wrong with them or None): its tensor
    maps, its tensors' pointers and its tile counters' at the offsets its `cubin` gives (`parameter_layout`,
    `argument_format`), a map's not where packing them one after another would put them; where the cubin does
    not say, pointers alone one after another (the offsets of a kernel without maps), and a kernel with maps is
    refused, as is one whose cubin takes other parameters than the plan passes."""
    maps = len(kernel.get("maps", []))
    sizes = [MAP_BYTES] * maps + [POINTER_BYTES] * (len(kernel["args"]) + bool(kernel.get("tickets"))
                                                    + bool(kernel.get("sums")))
    layout = parameter_layout(cubin, kernel["function"])
    form = argument_format(layout, sizes)
    if form is not None or (layout is None and not maps):
        return form or "P" * len(sizes), None
    found = "does not say where its parameters are" if layout is None else \
        f"takes {len(layout)} parameters of {', '.join(str(size) for _, size in layout)} bytes"
    return "", (f"kernel '{kernel['name']}': the compiled {kernel['file']} {found}; the plan passes {maps} tensor "
                f"map(s) of {MAP_BYTES} bytes, then {len(sizes) - maps} pointer(s)")


# -- host data ---------------------------------------------------------------------------------------------------


def to_bf16_bits(a) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of `a`, rounded to nearest even through float32; NaN stays NaN."""
    f = np.ascontiguousarray(a, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    # Round to nearest even on the 16 bits dropped: add 0x7FFF plus the lowest kept bit, then truncate.
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x0040).astype(np.uint16)  # rounding could carry a NaN's payload into inf
    return np.where(np.isnan(f), quiet_nan, rounded)


def from_bf16_bits(bits) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact: bf16 is the top half of a float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def past_range(name: str, dtype: str, given, stored) -> str | None:
    """Where a finite value of input `name` became an infinity stored as `dtype` (`stored`: bf16 as its bits), in
    words; None where none did."""
    widened = from_bf16_bits(stored) if dtype == "bf16" and np.asarray(stored).dtype == np.uint16 else stored
    lost = np.isfinite(given) & ~np.isfinite(widened)
    if not lost.any():
        return None
    at = tuple(int(i) for i in np.argwhere(lost)[0])
    return (f"input '{name}'{list(at)} = {float(np.asarray(given)[at]):g} does not fit {dtype} (largest "
            f"{LARGEST[dtype]:g}): stored, it would be an infinity")
