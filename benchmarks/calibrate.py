"""The kernels a GPU measured, priced again by the cost model as it is now: how far each estimate is from its
measurement, and how far it would be with other values of the model's constants. No GPU needed: it reads the
gpu.json files `gpu_fused.py run` wrote (brought back from the GPU machine) beside each prepared workload's
program, dims and parameters, builds each kernel again with those parameters, compiles it with nvcc where nvcc is
here (the estimate is then priced from its SASS, as `prepare` priced it), and sets each estimate beside the
kernel's measured time. The workloads' other choices of kernel parameters (`gpu_fused.py prepare --choices`, `run
--choices`) are priced too: the same kernel at other numbers of blocks, which is what the tuner chooses between.

    python benchmarks/calibrate.py                       # the last GPU run (benchmarks/measured/), the model as it is
    python benchmarks/calibrate.py --set intake.WARP_FILL_BYTES_PER_CLOCK=1.82 --set cost.SCALAR_REACH=0.15
    python benchmarks/calibrate.py --dir out/gpu-tma --only prefill --structure   # no nvcc: from the structure

Each --set names a constant of prism_dsl.backend's `intake` or `cost` module and a number; the table is priced
with all of them set. The summary gives the geometric mean of measured over estimated and the spread about it (the
root mean square of the logarithms' differences: 0.1 is about 10%), over all kernels and by the term the model
found binding. A change to the model that fits the decode kernels better and the prefill ones worse shows here
before any search runs on it. The table's last column is the lines a clock an SM each kernel's copies would have
taken in, were its time (less a launch) all spent taking them in: where the lines bind (strips of a row), it is what
`intake.LINES_PER_CLOCK` is fitted to.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism_dsl.backend import cost, intake  # noqa: E402
from prism_dsl.backend.launch import layout  # noqa: E402
from prism_dsl.base.errors import PrismError  # noqa: E402
from prism_dsl.cli.verify import codegen_of  # noqa: E402
from prism_dsl.kernels.hardware import load_hardware  # noqa: E402
from prism_dsl.lang.check import load  # noqa: E402
from prism_dsl.pipeline.build import BuildOptions, build, compile_check, price  # noqa: E402

MODULES = {"intake": intake, "cost": cost}


def constant(text: str) -> tuple[object, str, float]:
    """MODULE.NAME=NUMBER, a numeric constant of `intake` or `cost`; argparse's error otherwise."""
    where, _, value = text.partition("=")
    module, _, name = where.partition(".")
    if module not in MODULES or not name.isupper() or not isinstance(getattr(MODULES[module], name, None), (int, float)):
        raise argparse.ArgumentTypeError(f"'{where}' is no numeric constant of {' or '.join(MODULES)} "
                                         "(intake.WARP_FILL_BYTES_PER_CLOCK, cost.SCALAR_REACH, ...)")
    try:
        return MODULES[module], name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number (in {text})") from None


def measured_workloads(directory: Path, only: str | None) -> list[Path]:
    """The measured workloads, and their other choices of kernel parameters (`gpu_fused.py prepare --choices`)."""
    found = [*directory.glob("*/gpu.json"), *directory.glob("*/choices/*/gpu.json")]
    return sorted(p.parent for p in found if not only or only in label(p.parent))


def label(workload: Path) -> str:
    """A measured directory's name in the tables: a choice of parameters by its workload's name and number."""
    if workload.parent.name == "choices":
        return f"{workload.parent.parent.name}, choice {workload.name}"
    return workload.name


def priced(workload: Path, structure: bool) -> list[tuple]:
    """(workload, kernel, estimate, measured us) for each kernel the GPU timed, built with the code generator's
    options its report records (`prismc verify`'s reading of them)."""
    measured = json.loads((workload / "gpu.json").read_text())
    report = json.loads((workload / "report.json").read_text())
    hardware = load_hardware(measured["hardware"])
    options = BuildOptions(dims=report["dims"], params=report["parameters"], emulate=False, codegen=codegen_of(report),
                           archs=() if structure else (hardware.arch,), padded=report.get("padded") or {},
                           padded_inputs=bool(report.get("padded_inputs")))
    built = build(load(workload / (report.get("best") or f"{report['program']}.prism")).program(), hardware, options)
    if options.archs:  # compiled, and priced from its SASS as `prepare` priced it (from the structure without nvcc)
        built = price(built, compile_check(built.kernels, options.archs, hardware.arch)[1], options.codegen)
    times = {k["name"]: k["us"] for k in measured.get("per_kernel", []) if "us" in k}
    return [(label(workload), e, times[e.kernel], line_rate(built.concrete[e.kernel], options.codegen, hardware,
                                                             times[e.kernel]))
            for e in built.estimates if e.kernel in times]


def line_rate(c, codegen, hardware, us: float) -> float:
    """The lines a clock an SM the kernel's copies took in, were its whole time less a launch's spent taking them
    in (`intake.line_seconds` the other way round): what `intake.LINES_PER_CLOCK` is fitted to where they bind."""
    lines = intake.lines(c, layout(c, cost.for_hardware(codegen, hardware)), cost.iterations(c))
    seconds = max(us - hardware.launch_overhead_us, 1e-3) * 1e-6
    return lines / (seconds * min(c.blocks(), hardware.sms) * intake.CLOCK_GHZ * 1e9)


def spread(ratios: list[float]) -> tuple[float, float]:
    """(geometric mean, root mean square of the logarithms about it) of `ratios`."""
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    return math.exp(mean), math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=str(ROOT / "benchmarks" / "measured" / "h200-2026-11-30"),
                        help="the workloads a GPU measured, each with its gpu.json (default: the last run's, kept here)")
    parser.add_argument("--only", help="workloads whose directory name contains this")
    parser.add_argument("--set", action="append", type=constant, default=[], metavar="MODULE.NAME=NUMBER",
                        help="a constant of the cost model set for this run (repeatable)")
    parser.add_argument("--structure", action="store_true", help="price from the code's structure, without nvcc")
    args = parser.parse_args()
    workloads = measured_workloads(Path(args.dir), args.only)
    if not workloads:
        print(f"no measured workloads (gpu.json) in {args.dir}"
              + (f" whose name contains {args.only!r}" if args.only else ""), file=sys.stderr)
        return 1
    for module, name, value in args.set:
        setattr(module, name, value)
    rows, skipped = [], []
    for workload in workloads:
        try:
            rows += priced(workload, args.structure)
        except (PrismError, OSError, KeyError, ValueError) as err:
            skipped.append(f"- {label(workload)}: {str(err).splitlines()[0]}")
    if not rows:
        print("no kernel of the measured workloads could be priced", *skipped, sep="\n", file=sys.stderr)
        return 1
    setting = ", ".join(f"{m.__name__.rsplit('.', 1)[-1]}.{n} = {v:g}" for m, n, v in args.set) or "as it is"
    print(f"# The measured kernels priced again (the model {setting}; priced from "
          f"{'the structure' if args.structure else 'the SASS where nvcc is here'})\n")
    print("| workload | kernel | model us (bound) | priced from | measured us | measured / model | lines a clock an SM |\n"
          "|---|---|---|---|---|---|---|")
    for name, e, us, rate in rows:
        print(f"| {name} | {e.kernel} | {e.time_us:.1f} ({e.bound}) | {e.priced} | {us:.1f} | {us / e.time_us:.2f} | "
              f"{rate:.2f} |")
    print("\n| kernels | count | geometric mean of measured / model | spread |\n|---|---|---|---|")
    groups = {"all": rows, **{f"{b}-bound": [r for r in rows if r[1].bound == b]
                             for b in sorted({r[1].bound for r in rows})}}
    for kind, group in groups.items():
        mean, rms = spread([us / e.time_us for _, e, us, _ in group])
        print(f"| {kind} | {len(group)} | {mean:.2f} | {rms:.2f} |")
    if skipped:
        print("\nNot priced:", *skipped, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
