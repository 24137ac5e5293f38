"""The GPUs a kernel is instantiated for: one TOML file per GPU in `gpus/`.

A hardware gives the limits the constraints check (shared memory per block, grid size), the figures the
cost model reads (SMs, bandwidths and matrix rates as kernels reach them, launch overhead), and the datasheet's
peaks, which only the roofline floor reads (`backend.roofline`: a time no program beats). Adding a GPU is adding a
file; `like = "NAME"` takes every figure the file does not give from another GPU's.
"""

import tomllib
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Mapping

from ..base.errors import PrismError


@dataclass(frozen=True)
class Hardware:
    name: str
    arch: str
    sms: int
    smem_per_block: int
    smem_per_sm: int
    max_threads_per_block: int
    max_grid: tuple[int, int, int]
    l2_bytes: int
    bandwidth_gbs: float
    launch_overhead_us: float
    peak_tflops: Mapping[str, float]
    l2_bandwidth_gbs: float
    iteration_latency_us: float
    dram_latency_ns: float
    max_threads_per_sm: int
    max_blocks_per_sm: int
    datasheet_bandwidth_gbs: float  # the memory's peak, as the datasheet gives it (the floor's)
    datasheet_tflops: Mapping[str, float]  # the peak rates by type, dense (the floor's; f32: the CUDA cores')

    def __hash__(self) -> int:
        return hash(self.name)


HARDWARE_DIR = Path(__file__).parent / "gpus"


def hardware_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.toml"))


def for_device(device: str) -> str | None:
    """The hardware file named in a CUDA device's name ("NVIDIA H200" -> "h200"), or None where none is. The
    files describe the SXM parts: an H100 PCIe (114 SMs, 2 TB/s) matches h100 by name all the same."""
    words = device.lower().replace("-", " ").split()
    return next((name for name in hardware_names() if name in words), None)


@cache
def load_hardware(name: str = "h100") -> Hardware:
    path = HARDWARE_DIR / f"{name.lower()}.toml"
    if not path.is_file():
        raise PrismError(f"unknown hardware '{name}' (known: {', '.join(hardware_names())})")
    try:
        data = tomllib.loads(path.read_text())
        if like := data.pop("like", None):  # another GPU's file, with this file's figures over its own
            if str(like).lower() == path.stem:
                raise PrismError(f"hardware file {path} is malformed: it is `like` itself")
            data = {**asdict(load_hardware(like)), **data}
        data["max_grid"] = tuple(data["max_grid"])
        return Hardware(**data)
    except (tomllib.TOMLDecodeError, TypeError, KeyError) as e:
        raise PrismError(f"hardware file {path} is malformed: {e}") from None
