"""The .npz archives of `prismc run`: inputs read member by member, header first; outputs written atomically.

An archive is the user's, and may be hostile or damaged: only a regular file is opened (`files`), only the
members the program reads are read, each one's .npy header (dtype, shape) is checked, against its stored
size and by the caller against the program's signature, before its data is decompressed. So a 2 MB
archive that would expand to gigabytes, a shape that does not fit, an encrypted or oddly compressed or
damaged member are each a message, never a traceback or memory without bound.
"""

from __future__ import annotations

import math
import struct
import zipfile
import zlib

import numpy as np

from ..base import files
from ..base.errors import PrismError
from ..semantics.reference import MAX_ELEMENTS, NUMPY_MAX_DIMS, held
from ..lang.syntax import clip

# Compression methods zipfile reads (stored, deflated, bzip2, lzma); numpy.savez writes the first two.
_ZIP_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
# What a damaged or hostile archive makes zipfile, zlib or numpy raise while a member is read.
_ZIP_ERRORS = (OSError, EOFError, ValueError, RuntimeError, NotImplementedError, zipfile.BadZipFile,
               zipfile.LargeZipFile, zlib.error, struct.error, OverflowError, SyntaxError)


def read_npz(path: str, program, vet=None) -> dict[str, np.ndarray]:
    """The program's inputs from a .npz archive, by input name, in float64 rounded to each input's storage type
    as a GPU stores them (an f16 input holds no 1.0000001; random inputs are rounded so too).

    Only the members the program reads are read, and each only after its header: dtype and shape are
    checked (numbers only; the stored size must be what the header says) and handed to `vet` (the shapes
    as stand-in arrays that hold no data), which may refuse them, before any data is decompressed. So a
    small archive that would expand to gigabytes, or a shape that does not fit, costs nothing."""
    try:
        f = files.open_regular(path)
    except (OSError, ValueError) as e:  # missing, a directory, a FIFO, a device
        raise PrismError(f"cannot read inputs '{path}': {files.describe(e)}") from None
    with f:
        try:
            archive = zipfile.ZipFile(f)
        except _ZIP_ERRORS:
            raise PrismError(f"cannot read inputs '{path}': not a .npz archive (as numpy.savez writes)") from None
        with archive:
            members = _npz_members(path, archive, program.input_names())
            headers = {name: _npz_header(path, archive, info) for name, info in members.items()}
            if vet is not None:  # zero-stride views: the shapes and dtypes, no data
                vet({name: np.broadcast_to(np.zeros((), dtype), shape) for name, (shape, dtype) in headers.items()})
            dtypes = {n.attr: n.dtype for n in program.inputs}
            return {name: held(name, _npz_array(path, archive, info, headers[name]), dtypes[name])
                    for name, info in members.items()}


def _npz_members(path: str, archive: zipfile.ZipFile, wanted) -> dict[str, zipfile.ZipInfo]:
    """The archive's member for each input, named as numpy.savez names them (`X.npy`, read as `X`)."""
    found: dict[str, list[zipfile.ZipInfo]] = {}
    for info in archive.infolist():
        found.setdefault(info.filename.removesuffix(".npy"), []).append(info)
    missing = [n for n in wanted if n not in found]
    if missing:
        has = ", ".join(sorted(clip(k) for k in found)) or "nothing"
        raise PrismError(f"inputs '{path}' lack {', '.join(repr(m) for m in missing)} (it has: {has})")
    twice = [n for n in wanted if len(found[n]) > 1]
    if twice:
        raise PrismError(f"cannot read inputs '{path}': it holds {', '.join(repr(n) for n in twice)} more than once")
    return {n: found[n][0] for n in wanted}


def _npz_header(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype]:
    """A member's shape and dtype from its .npy header, the member's stored size checked against them."""
    what = f"cannot read inputs '{path}': member '{clip(info.filename)}'"
    name = repr(info.filename.removesuffix(".npy"))
    if info.flag_bits & 0x1:
        raise PrismError(f"{what} is encrypted; only plain archives (as numpy.savez writes) are read")
    if info.compress_type not in _ZIP_METHODS:
        raise PrismError(f"{what} uses compression method {info.compress_type}, which cannot be read "
                         "(numpy.savez stores or deflates)")
    try:
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ValueError(f"unknown .npy format version {version}")
            shape, _, dtype = read_header[version](member)
            start = member.tell()
    except _ZIP_ERRORS as e:  # numpy's complaints are about the format; the rest, about the archive
        why = "is not a readable NumPy array" if isinstance(e, (ValueError, SyntaxError)) else "is damaged"
        raise PrismError(f"{what} {why} ({_first_line(e)})") from None
    if dtype.hasobject:  # loading object arrays would run code from the file
        raise PrismError(f"cannot read inputs '{path}': it holds arrays of Python objects; only numeric arrays are read")
    if dtype.kind not in "fiub" or dtype.fields is not None or dtype.subdtype is not None:
        raise PrismError(f"cannot read inputs '{path}': {name} must hold numbers, not {dtype}")
    if not all(isinstance(s, int) and s >= 0 for s in shape):  # numpy's header reader takes (-2, -3)
        raise PrismError(f"{what} is not a readable NumPy array (its header's shape is {clip(repr(shape))})")
    nbytes = math.prod(shape) * dtype.itemsize
    if info.file_size != start + nbytes:
        raise PrismError(f"{what} is damaged: its header says {list(shape)} {dtype} ({nbytes:,} bytes of data), "
                         f"but it holds {max(info.file_size - start, 0):,}")
    if math.prod(shape) > MAX_ELEMENTS or len(shape) > NUMPY_MAX_DIMS:
        raise PrismError(f"cannot read inputs '{path}': {name} has shape {list(shape)}; the float64 reference "
                         f"evaluates tensors of at most {MAX_ELEMENTS:,} (2^30) elements and {NUMPY_MAX_DIMS} dims")
    return tuple(shape), dtype


def _npz_array(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo, header) -> np.ndarray:
    try:
        with archive.open(info) as member:
            array = np.lib.format.read_array(member, allow_pickle=False)
    except _ZIP_ERRORS as e:
        raise PrismError(f"cannot read inputs '{path}': member '{clip(info.filename)}' is damaged "
                         f"({_first_line(e)})") from None
    if (array.shape, array.dtype) != header:  # the file changed since its header was read
        raise PrismError(f"cannot read inputs '{path}': it changed while it was read")
    return array


def _first_line(e: BaseException) -> str:
    return clip(str(e).splitlines()[0] if str(e) else e.__class__.__name__, 120)


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """The archive `numpy.savez` writes (a stored zip of `NAME.npy` members) to `path`, atomically
    (`files.write_atomic`); written member by member, since `savez`'s keywords would take a tensor named `file`
    for its own argument."""
    def write(f) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in arrays.items():
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
    files.write_atomic(path, write)
