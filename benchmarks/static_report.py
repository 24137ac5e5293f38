"""The static performance report: for each workload at decode and prefill shapes, the program `prismc compile`
chooses, and for each of its launches (a kernel, or one with the combining kernel of its pieces: `tails`) what
the compiled code does, read from its SASS (sm_90a): the hot loop's instruction mix (HMMA, HGMMA, LDSM,
LDGSTS, UTMALDG, FFMA, LDS, BAR, and all its instructions), the fewest instructions a warp issues per
iteration of it (`sass.issued`: on any iteration, and on one that copies tiles ahead), registers, spills,
shared memory, blocks per SM, the cost model's estimate and the roofline floor. No GPU is needed; nvcc and
cuobjdump are (cuobjdump from the `sass` extra: pip install -e ".[sass]"). With `--banks`, a last column gives each
kernel's shared-memory wavefronts a block, counted in the emulation over the first and last block along every
grid axis (`prism_dsl.backend.banks`, as `prismc verify --banks`), against the same accesses without a bank
conflict, the time the cost model gives them (t_shared, a floor the estimates in the other columns do not
include), and its worst place; that takes minutes a prefill workload (each block emulated, every thread).

    python benchmarks/static_report.py [--only NAME] [--time-limit SECONDS] [--banks] [--options="--tma ..."]

`--options` passes more options to `prismc compile` (the TMA forms: --options=--tma), named in the first line.

Prints a markdown table (the one in benchmarks/NOTES.md) and the machine it ran on, then which of the static
targets each workload meets. Exits 1 where a workload did not compile (prismc's message in its row; a missed
target is a finding of the report, not a failure of it), 2 where `--only` names no workload.
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism_dsl.backend import sass  # noqa: E402
from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS  # noqa: E402
from prism_dsl.backend.nvcc import nvcc_path  # noqa: E402
from prism_dsl.ir.accumulators import ACCUMULATORS  # noqa: E402
from prism_dsl.ir.ops import OPS, Kind  # noqa: E402
from prism_dsl.kernels.hardware import load_hardware  # noqa: E402
from prism_dsl.kernels.kernel import kernels_of  # noqa: E402
from prism_dsl.kernels.lower import lower  # noqa: E402
from prism_dsl.lang.check import load  # noqa: E402

ATTENTION = "b=2,h=8,q=1,dh=128"
WORKLOADS = [  # (name, program, dims)
    ("rmsnorm_linear decode", "rmsnorm_linear", "n=8,d=4096"),
    ("rmsnorm_mlp decode", "rmsnorm_mlp", "n=8,d=4096"),
    ("swiglu decode", "swiglu", "n=8,d=4096"),
    ("attention decode kv=4096", "attention", ATTENTION + ",kv=4096"),
    ("attention decode kv=32768", "attention", ATTENTION + ",kv=32768"),
    ("qk_norm_attention decode kv=4096", "qk_norm_attention", ATTENTION + ",kv=4096"),
    ("qk_norm_attention decode kv=32768", "qk_norm_attention", ATTENTION + ",kv=32768"),
    ("llama_qkv decode", "llama_qkv", "n=8,d=4096,e=6144"),
    ("gpt2_mlp decode", "gpt2_mlp", "n=8,d=768,f=3072"),
    ("llama_mlp decode", "llama_mlp", "n=8,d=4096,f=11008"),
    ("rmsnorm_linear prefill", "rmsnorm_linear", "n=4096,d=4096"),
    ("rmsnorm_mlp prefill", "rmsnorm_mlp", "n=4096,d=4096"),
    ("swiglu prefill", "swiglu", "n=4096,d=4096"),
    ("attention prefill", "attention", "b=1,h=16,q=4096,kv=4096,dh=128"),
    ("attention prefill q=kv=4099", "attention", "b=1,h=16,q=4099,kv=4099,dh=128"),  # built past the keys, masked
    ("qk_norm_attention prefill", "qk_norm_attention", "b=1,h=16,q=4096,kv=4096,dh=128"),
    ("causal_attention prefill", "causal_attention", "b=1,h=16,q=4096,kv=4096,dh=128"),
    ("gqa_decode", "gqa_decode", "b=1,hk=8,g=4,kv=4096,dh=128"),
    ("gqa_decode kv=4099", "gqa_decode", "b=1,hk=8,g=4,kv=4099,dh=128"),  # K and V read in place, guarded past 4099
]
MIX = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "FFMA", "LDS", "BAR", "total")  # total: every instruction of the loop



SEARCH_ONLY = {"--time-limit": 1, "--max-kernels": 1, "--no-split": 0, "--unsteady": 0}  # flag -> values it takes


def searched(options: list[str], time_limit: float) -> list[str]:
    """`prismc compile`'s options with the search's time limit added, unless they leave the search out (`--search
    none`: prismc refuses a limit of the search it does not run)."""
    flat = " ".join(options).replace("=", " ").split()
    if any(a == "--search" and b == "none" for a, b in zip(flat, flat[1:])):
        return options
    return ["--time-limit", str(time_limit), *options]


def as_written(options: list[str]) -> list[str]:
    """The options without those that limit the search (`SEARCH_ONLY`, as `--flag value` or `--flag=value`): for
    compiling a chosen program again as written."""
    out, skip = [], 0
    for option in options:
        flag = option.split("=", 1)[0]
        if skip:
            skip -= 1
        elif flag in SEARCH_ONLY:
            skip = SEARCH_ONLY[flag] if "=" not in option else 0
        else:
            out.append(option)
    return out

def products(out: Path, name: str) -> dict[str, bool]:
    """Per kernel of the program compiled into `out` (`NAME.prism`, its pre-defined kernels written out: the
    search's choice, or the program as written where that won), whether it computes a product."""
    program = lower(load(out / f"{name}.prism").program())
    return {k.name: any(OPS[n.op].kind is Kind.MATMUL or OPS[n.op].kind is Kind.ACCUMULATE
                        and ACCUMULATORS[n.op].like == "matmul" for n in k.body()) for k in kernels_of(program)}


def kernel_rows(out: Path, report: dict) -> list[tuple[str, dict]]:
    """Per kernel of the chosen program, its table row and what the targets are checked on."""
    rows, multiplies = [], products(out, report["program"])
    for k in report["kernels"]:
        cubin = out / (k["file"][:-3] + ".cubin")
        done = subprocess.run([nvcc_path(), "-cubin", "-arch=sm_90a", *NVCC_OPTIONS, "-o", str(cubin), k["file"]],
                              cwd=out, capture_output=True, text=True)
        listing = sass.disassemble(cubin) if done.returncode == 0 else ""
        loop = sass.hot_loop(listing) if listing else None
        counts, mark = (loop.counts if loop else None), ""
        # a copy warp's copies run in a loop of their own (UTMALDG), beside the products' loop paced by mbarrier waits
        ops = sass.instructions(listing)[0] if loop else []
        apart = any(l.counts["UTMALDG"] for l in sass.loops(listing) if l != loop) and any(
            op.startswith(sass.WAIT) for op in ops[loop.start: loop.end + 1])
        whole = sass.count(sass.instructions(listing)[0]) if listing else None
        if whole and whole["HMMA"] + whole["HGMMA"] and not (loop and loop.counts["HMMA"] + loop.counts["HGMMA"]):
            counts, mark = whole, " (whole kernel: nvcc unrolled its loops)"  # no backward branch holds the HMMA
        mix = " / ".join(str(counts[c]) for c in MIX) + mark if counts else "no loop"
        per = f"{counts['HMMA'] / counts['LDSM']:.1f}" if counts and counts["LDSM"] else "-"
        nv = k["nvcc"].get("sm_90", {})
        est = k["estimate"]
        serialized = " (ptxas serialized its wgmma)" if nv.get("wgmma_serialized") else ""
        got = nv.get("issued")  # what the model's issue floor took, per iteration (copying ahead or not)
        issued = f"{got['loop']:g} / {got.get('copying', got['loop']):g}" if got and got["loop"] else "-"
        also = f" + {est['combines']['kernel']}" if est.get("combines") else ""  # a combining kernel in its launch
        rows.append((f"{k['name']}{also} | {'x'.join(map(str, k['grid']))} x {k['block'][0]} | {mix} | {issued} | {per} | "
                     f"{nv.get('registers', '?')}{serialized} | {nv.get('spill_stores', '?')} | {k['smem_bytes'] // 1024} KiB | "
                     f"{est['occupancy']} | {est['time_us']:.1f} ({est['bound']})",
                     {"blocks": k["grid"][0] * k["grid"][1] * k["grid"][2], "counts": counts, "products": multiplies[k["name"]],
                      "spills": nv.get("spill_stores"), "copy_warp": apart, "main_loop": sass.main_loop_barriers((out / k["file"]).read_text()) is not None}))
    return rows


def wavefronts(out: Path) -> dict[str, str]:
    """Per kernel of the program compiled into `out`, its shared-memory wavefronts a block as the table gives them,
    with the time the model gives them (`cost.estimate`'s t_shared, as `prismc verify --banks` prices them)."""
    from prism_dsl.cli.verify import from_directory, priced_with
    from prism_dsl.pipeline import emulation
    from prism_dsl.pipeline.build import check_inputs, plan_of

    built, header, on_disk, _, _ = from_directory(out)
    counted = emulation.wavefronts(built, plan_of(built), check_inputs(built, 0), seed=0, header=header)
    shared_us = {e.kernel: e.shared_us for e in priced_with(built, out, on_disk, counted).estimates}
    text = {}
    for name, w in counted.items():
        worst = w.conflicted[0] if w.conflicted else None
        text[name] = (f"{w.per_block:,.0f} ({w.over_ideal:.2f}x, {shared_us[name]:.1f} us" +
                      (f"; {worst.where} {worst.wavefronts / worst.ideal:.1f}x)" if worst else ")"))
    return text


def targets(name: str, report: dict, kernels: list[dict], sms: int) -> str:
    """The static targets for one workload, as a table row. At decode: a block per SM (the program's largest
    launch), and a global load (async or not) per 16 FFMA in the hot loop of a kernel whose products run off
    the tensor cores, where it loads in its loop (its FFMA include the softmax's: a stricter test than the
    weight stream's own; a loop whose tiles were all copied before it, as a short combine's, loads nothing
    in it; on tensor cores a load feeds an mma, not FMAs). At prefill: every product on tensor cores (wgmma,
    or 4 HMMA per LDSM), and async copies (cp.async, or TMA's) in the hot loop of every kernel with a main loop
    (one without has only its threads' passes over a tile), or in its copy warp's loop beside it. Everywhere: 0 spills, and the model within 1.5x of
    the floor."""
    ratio = report["estimated_us"] / report["roofline"]["floor_us"]
    checks = {"model / floor <= 1.5": ratio <= 1.5, "0 spills": all(k["spills"] == 0 for k in kernels)}
    loops = [k["counts"] for k in kernels if k["counts"] and k["main_loop"] and not k["copy_warp"]]  # not a kernel's
    # per-thread passes, nor a loop whose tiles a copy warp's own loop copies
    if "decode" in name:
        most = max(k["blocks"] for k in kernels)
        checks[f"a block per SM ({most} of {sms})"] = most >= sms
        checks["a load per 16 FFMA"] = all(16 * (c["LDGSTS"] + c["LDG"]) >= c["FFMA"] for c in loops
                                           if not c["HMMA"] + c["HGMMA"] and c["LDGSTS"] + c["LDG"])
    else:
        checks["products on tensor cores"] = all(
            k["counts"] and (k["counts"]["HGMMA"] or k["counts"]["LDSM"] and k["counts"]["HMMA"] >= 4 * k["counts"]["LDSM"])
            for k in kernels if k["products"])
        checks["async copies in every loop"] = all(c["LDGSTS"] + c["UTMALDG"] for c in loops)
    missed = [c for c, ok in checks.items() if not ok]
    return f"| {name} | {ratio:.2f} | " + ("all met" if not missed else "missed: " + "; ".join(missed)) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="workloads whose name contains this")
    parser.add_argument("--time-limit", type=float, default=30.0, help="search time per workload (seconds)")
    parser.add_argument("--banks", action="store_true", help="count shared-memory wavefronts in the emulation too")
    parser.add_argument("--options", default="", help="more options for prismc compile (e.g. --options=--tma)")
    args = parser.parse_args()
    chosen = [w for w in WORKLOADS if not args.only or args.only in w[0]]
    if not chosen:
        parser.error(f"--only {args.only!r} names no workload (they are: {', '.join(w[0] for w in WORKLOADS)})")
    try:
        shlex.split(args.options)
    except ValueError as e:  # before the table's header, as gpu_fused.py refuses it
        parser.error(f"--options {args.options!r}: {e}")
    if nvcc_path() is None or not sass.available():
        print("needs nvcc on the PATH and cuobjdump (pip install -e '.[sass]')", file=sys.stderr)
        return 2
    nvcc = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, errors="replace").stdout
    release = next((line.split("release")[-1].split(",")[0].strip() for line in nvcc.splitlines() if "release" in line), "?")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, nvcc {release}; "
          f"SASS for sm_90a by {Path(sass.tool()).name}; model: H100 (no GPU ran)"
          + (f"; prismc compile {args.options}" if args.options else ""))
    print("| workload | launches | kernel | grid x threads | hot loop HMMA / HGMMA / LDSM / LDGSTS / UTMALDG / FFMA / LDS / BAR / all | "
          "issued per iteration / copying ahead | HMMA per LDSM | registers | spills | shared | blocks/SM | model us | "
          "program model us | floor us |" + (" shared wavefronts a block (x conflict-free, us; worst place) |" if args.banks
                                             else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.banks else ""))
    summary, sms, failed = [], load_hardware("h100").sms, 0
    for name, program, dims in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "o"
            done = subprocess.run([sys.executable, "-m", "prism_dsl", "compile", str(ROOT / "programs" / f"{program}.prism"),
                                   "--dims", dims, "-o", str(out), "--json", "--no-emulate", "--arch", "sm_90",
                                   *searched(shlex.split(args.options), args.time_limit)],
                                  capture_output=True, text=True)
            if not done.stdout.strip().startswith("{"):  # prismc's message whole, on one line of the table
                failed += 1
                print(f"| {name} | error: {' / '.join(done.stderr.strip().splitlines()) or f'exit {done.returncode}'} |")
                continue
            report = json.loads(done.stdout)
            head = f"| {name} ({dims}) | {len(report['kernels'])} launch(es) | "
            rows = kernel_rows(out, report)
            counted = wavefronts(out) if args.banks else {}
            for i, (row, _) in enumerate(rows):
                tail = f" | {report['estimated_us']:.1f} | {report['roofline']['floor_us']:.1f} |" if i == 0 else " | | |"
                if args.banks:
                    tail += f" {counted.get(report['kernels'][i]['name'], '-')} |"
                print((head if i == 0 else "| | | ") + row + tail)
            summary.append(targets(name, report, [facts for _, facts in rows], sms))
    print("\n| workload | model / floor | static targets |\n|---|---|---|")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
