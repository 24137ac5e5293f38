"""The static report's workloads on a GPU: each program `prismc compile` chooses, checked against the float64
reference and timed beside PyTorch eager, torch.compile and, for attention, scaled_dot_product_attention
(FlashAttention); the table goes to benchmarks/RESULTS.md with the device named.

Two steps, so that the GPU machine needs neither the search nor its prover (egglog):

    python benchmarks/gpu_fused.py prepare [--dir out/gpu] [--only NAME[,NAME...]] [--time-limit S] [--hardware H]
                                           [--options="PRISMC OPTIONS"]                      # any machine
    python benchmarks/gpu_fused.py run [--dir out/gpu] [--only NAME[,NAME...]] [--again] [--results F]  # GPU, pycuda, torch
    python benchmarks/gpu_fused.py table [--dir out/gpu] [--results F]                        # any machine
    ncu ... python benchmarks/gpu_fused.py profile [--dir out/gpu] [--only NAME[,NAME...]]              # GPU, for a profiler

`prepare` compiles every workload of `static_report.WORKLOADS` into DIR/<workload>/ (`prismc compile`: its
kernels, launcher.py and report.json, tuned for the hardware file `--hardware` names, h100 by default, with
`--options` added to its command line) beside the program as written (`baseline.prism`). `run` takes each such
directory as a user would: the kernels through the plan and runtime of the directory's own launcher.py. Every
implementation runs on the same random inputs (each rounded to its dtype) and is checked against the float64
reference of the program as written before its time counts. Each is timed with CUDA events, the median of
`REPEAT` samples, rotating through enough input sets to defeat the L2 cache; each sample is `BATCH` calls back
to back over `BATCH`, the time per call once launches queue up as in a model's forward pass (the time of one
call alone is given too, for ours, and each of its kernels alone beside the model's estimate for that kernel).
Every sample is the GPU's own time: a kernel spinning ahead of its first event keeps the GPU waiting until the
host has queued every call (`cuda_runtime.Ahead`, torch's `_sleep` for the baselines), so neither pycuda's nor
torch's Python overhead per call is counted. A row's figures are written to DIR/<workload>/gpu.json as soon as
they are measured, so `run` can be split over several commands (`--only`) and takes up where it stopped;
`--again` measures again. The table (benchmarks/RESULTS.md, or `--results`) is written from every gpu.json in
DIR, by `run` and by `table` (which needs no GPU: for gpu.json files brought back from the GPU machine). A
second DIR prepared with other options (`--options="--no-wgmma"`: the products on mma.sync) and its own
`--results` measures the same workloads compiled another way; the table names the options beside each
workload.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import sympy

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from static_report import WORKLOADS, as_written, searched  # noqa: E402

from prism_dsl.backend.compare import RTOL, Tolerance  # noqa: E402
from prism_dsl.cli.values import whole  # noqa: E402
from prism_dsl.cli.verify import codegen_of  # noqa: E402
from prism_dsl.kernels.kernel import kernels_of  # noqa: E402
from prism_dsl.kernels.lower import lowered_for  # noqa: E402
from prism_dsl.pipeline.measuring import Ranked, parameter_choices  # noqa: E402
from prism_dsl.cli.bench import TORCH, time_torch, torch_function  # noqa: E402
from prism_dsl.kernels.hardware import for_device, hardware_names, load_hardware  # noqa: E402
from prism_dsl.lang.check import load  # noqa: E402
from prism_dsl.pipeline.build import rtol_of  # noqa: E402
from prism_dsl.semantics.blocks import evaluate  # noqa: E402
from prism_dsl.semantics.reference import bind_dims, check_inputs, concrete_shape  # noqa: E402

CHOICES = 4  # choices of each workload's kernel parameters prepared, the model's own among them
BATCH = 20  # calls between two events
REPEAT = 30
L2_SPAN = 3  # the rotating input sets span at least this many times the hardware's L2 cache


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("=", "")


def wanted(only: str | None, name: str) -> bool:
    """Whether `--only` takes the workload `name`: none given, or one of its comma-separated parts is in the name
    (a part `=NAME`: that name exactly)."""
    parts = [part.strip() for part in (only or "").split(",")]
    return not only or any(part == f"={name}" or part and part[0] != "=" and part in name for part in parts)


# -- prepare: any machine ----------------------------------------------------------------------------------

def prepare(args, workloads=WORKLOADS) -> int:
    directory = Path(args.dir)
    failed = 0
    for name, program, dims in workloads:
        if not wanted(args.only, name):
            continue
        out = directory / slug(name)
        new = out.with_name(out.name + ".new")  # (a failed compile keeps what `out` holds, a gpu.json brought back)
        shutil.rmtree(new, ignore_errors=True)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "prism_dsl", "compile", str(ROOT / "programs" / f"{program}.prism"),
                               "--dims", dims, "-o", str(new), "--no-emulate",
                               "--arch", load_hardware(args.hardware).arch,
                               "--hardware", args.hardware, *searched(shlex.split(args.options), args.time_limit)],
                              capture_output=True, text=True)
        if done.returncode:
            failed += 1
            print(f"{name}: prismc compile failed:\n{done.stderr.strip() or f'exit {done.returncode}'}", file=sys.stderr)
            shutil.rmtree(new, ignore_errors=True)
            continue
        if out.exists():
            shutil.rmtree(out)
        new.rename(out)
        shutil.copy(ROOT / "programs" / f"{program}.prism", out / "baseline.prism")
        case = {"workload": name, "program": program, "dims": dims, "hardware": args.hardware,
                "options": shlex.split(args.options)}
        (out / "case.json").write_text(json.dumps(case) + "\n")
        print(f"{name}: {out} ({time.monotonic() - started:.0f} s)")
        for problem in prepare_choices(out, case, getattr(args, "choices", CHOICES)):
            failed += 1
            print(f"{name}: {problem}", file=sys.stderr)
    return 1 if failed else 0


def prepare_choices(out: Path, case: dict, count: int) -> list[str]:
    """The program `out` holds compiled again (`--search none`) with the model's next best choices of its kernel
    parameters and with its own at twice the threads, `count` in all with its own (`measuring.parameter_choices`,
    as `--rank measure` times them on a GPU), each into out/choices/<k>/ with a case.json naming them: `run
    --choices` checks and times them beside it, and `calibrate.py` prices them. What failed, in words (a workload
    built past its sizes has no choices: its parameters hold only at the sizes it was built for, which its
    launcher pads to)."""
    shutil.rmtree(out / "choices", ignore_errors=True)
    if count < 2 or (report := json.loads((out / "report.json").read_text())).get("padded"):
        return []
    source = out / (report.get("best") or f"{report['program']}.prism")
    program = load(source).program()
    hardware = load_hardware(case["hardware"])
    binding = bind_dims(program, report["dims"])
    chosen = Ranked(program, report["parameters"], report["estimated_us"])
    lowered = lowered_for(program, report["parameters"])
    grid = {s.name for k in kernels_of(lowered) for _, g in k.grid for s in sympy.sympify(g).free_symbols}
    problems = []
    built_as = codegen_of(report)  # the threads the chosen program was built with, which its choices start from
    for k, choice in enumerate(parameter_choices(chosen, binding, hardware, built_as, count)[1:], 1):
        there = out / "choices" / str(k)
        threads = choice.codegen(built_as).threads
        given = [f"--grid={n}={v}" if n in grid else f"--loop={n}={v}" for n, v in choice.params.items()]
        done = subprocess.run([sys.executable, "-m", "prism_dsl", "compile", str(source), "--search", "none",
                               "--dims", case["dims"], "-o", str(there), "--no-emulate", "--arch", hardware.arch,
                               "--hardware", case["hardware"], *given, *as_written(case["options"]), "--threads", str(threads)],
                              capture_output=True, text=True)
        if done.returncode:
            problems.append(f"parameters {choice.params}, --threads {threads}: prismc compile failed:\n"
                            f"{done.stderr.strip() or f'exit {done.returncode}'}")
            shutil.rmtree(there, ignore_errors=True)
            continue
        shutil.copy(out / "baseline.prism", there / "baseline.prism")
        (there / "case.json").write_text(json.dumps({**case, "choice_of": case["workload"], "params": choice.params,
                                                     "threads": threads}) + "\n")
    return problems


# -- run: on the GPU ---------------------------------------------------------------------------------------

def _launcher_module(out: Path):
    spec = importlib.util.spec_from_file_location(f"launcher_{out.name}", out / "launcher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def input_sets(program, dims: dict, l2_bytes: int, count: int | None = None) -> list[dict]:
    """Random inputs of the program as written, each rounded to its dtype (float64 arrays), the weights scaled as
    `prismc compile` checks its kernels (`semantics.reference.check_inputs`), as many sets as span L2_SPAN times
    the L2 cache (or `count`)."""
    binding = bind_dims(program, dims)
    per_set = sum(math.prod(concrete_shape(n.shape, binding)) * n.dtype.bytes for n in program.inputs)
    count = count or max(3, min(16, math.ceil(L2_SPAN * l2_bytes / per_set)))
    return [check_inputs(program, binding, seed) for seed in range(count)]


def sdpa(torch, program: str, dims: dict):
    """(function, how its arguments are made from the program's inputs) running the workload's attention through
    scaled_dot_product_attention, or None. The arguments are laid out as FlashAttention takes them (keys
    [b, h, kv, dh]) before timing: a layout the program's caller could have chosen."""
    F = torch.nn.functional
    if program == "attention":
        return (lambda Q, K, V: F.scaled_dot_product_attention(Q, K, V, scale=1.0),
                lambda Q, K, V: (Q, K.transpose(-1, -2).contiguous(), V))
    if program == "qk_norm_attention":
        return (lambda Q, K, V: F.scaled_dot_product_attention(F.rms_norm(Q, Q.shape[-1:], eps=0.0), K, V, scale=1.0),
                lambda Q, K, V: (Q, K.transpose(-1, -2).contiguous(), V))
    scale = 1 / math.sqrt(128)  # the programs' own constant, whatever dh is
    if program == "gqa_decode":  # the group's queries are rows: attention with g queries per key/value head
        return (lambda Q, K, V: F.scaled_dot_product_attention(Q, K, V, scale=scale), lambda Q, K, V: (Q, K, V))
    if program == "causal_attention" and dims["q"] == dims["kv"]:  # is_causal aligns the corners only then
        def rope(x, c, s):
            return TORCH["rope"](torch, [x, c, s], None)
        return (lambda Q, K, V, CQ, SQ, CK, SK: F.scaled_dot_product_attention(rope(Q, CQ, SQ), rope(K, CK, SK), V,
                                                                              is_causal=True, scale=scale),
                lambda *xs: xs)
    return None


_LAST_ORACLE: dict = {}  # the last workload's input sets, reference and tolerance: the choices run after it share them


def oracle(out: Path, hardware_name: str, one_set: bool = False):
    """(the directory's launcher module, the program as written, the input sets, the float64 reference of the
    program as written on the first set, (our output, its output) name pairs, the checks' tolerance). Made once for
    consecutive directories of the same program as written, sizes and hardware (a workload's choices of parameters,
    the same workload compiled another way): the inputs and the reference of a long workload take 15-50 s of the
    GPU machine's time. `one_set`: the first set only (for a profiler, which runs one call), not kept."""
    launcher = _launcher_module(out)
    text = (out / "baseline.prism").read_text()
    baseline = load(out / "baseline.prism").program()
    report = json.loads((out / "report.json").read_text())
    dims = {**report["dims"], **(report.get("padded") or {})}  # the sizes the caller gives (`pipeline.padding`)
    key = (text, json.dumps(dims, sort_keys=True), hardware_name)
    if key not in _LAST_ORACLE:
        sets = input_sets(baseline, dims, load_hardware(hardware_name).l2_bytes, 1 if one_set else None)
        made = (sets, evaluate(baseline, sets[0], {}, hardware_name), tolerance(baseline, sets, hardware_name))
        if one_set:
            sets, reference, tol = made
        else:
            _LAST_ORACLE.clear()
            _LAST_ORACLE[key] = made
    if key in _LAST_ORACLE:
        sets, reference, tol = _LAST_ORACLE[key]
        sets = sets[:1] if one_set else sets
    pairs = list(zip(launcher.PLAN["outputs"], (name for name, _ in baseline.outputs)))  # paired by position
    return launcher, baseline, sets, reference, pairs, tol


def tolerance(baseline, sets: list, hardware_name: str) -> Tolerance:
    """The checks' tolerance (`compare.Tolerance`): 1e-2 for these f16 programs, widened for an output that the
    roundings of its products' operands alone move further, the same for every implementation."""
    return Tolerance(rtol_of(baseline), lambda: evaluate(baseline, sets[0], {}, hardware_name, rounded=True),
                     dtypes={name: n.dtype.value for name, n in baseline.outputs if n.dtype})


def verdict(outputs: dict, reference: dict, pairs, tol: Tolerance) -> dict:
    """Every output of one implementation against the oracle: {"passed", "max_rel_err", "rtol", "rounding"} over
    all of them ("rounding": the roundings' own error where it was needed)."""
    checks = [tol.judge(theirs, outputs[mine], reference[theirs]) for mine, theirs in pairs]
    return {"passed": all(c["passed"] for c in checks), "max_rel_err": max(c["max_rel_err"] for c in checks),
            "rtol": max(c["rtol"] for c in checks), "rounding": max(c.get("rounding", 0.0) for c in checks)}


def run_case(out: Path, baselines: bool = True) -> dict:
    """One prepared directory checked and timed: ours, and (`baselines`) PyTorch eager, torch.compile and SDPA."""
    import torch

    case = json.loads((out / "case.json").read_text())
    report = json.loads((out / "report.json").read_text())
    hardware_name = case["hardware"]  # what `prepare` compiled for
    launcher, baseline, sets, reference, pairs, tol = oracle(out, hardware_name)
    rt, plan = launcher.prism_runtime, launcher.PLAN
    rows = {}

    def checked(outputs) -> dict:
        return verdict(outputs, reference, pairs, tol)

    ours = rt.Launcher(plan, out, cast=True)  # the directory's runtime; the f16 (bf16) values pass exactly
    try:
        alone, batched = ours.time(sets, repeat=REPEAT * 3), ours.time(sets, repeat=REPEAT, batch=BATCH)
        if "host_bound" not in alone:
            raise RuntimeError(f"{out}/prism_runtime.py times the host's queueing too (it predates timing the GPU "
                               "alone): run `gpu_fused.py prepare` again")
        each = ours.time_kernels(sets, repeat=REPEAT * 3)
        rows["prism-dsl"] = checked(ours(**sets[0])) | {
            "alone_us": alone["median_ms"] * 1e3, "us": batched["median_ms"] * 1e3,
            "host_bound": alone["host_bound"] or batched["host_bound"]}
        per_kernel = [{"name": k["name"], "grid": k["grid"], "block": k["block"],
                       "model_us": k["estimate"]["time_us"], "bound": k["estimate"]["bound"],
                       "us": each[k["name"]]["median_ms"] * 1e3, "host_bound": each[k["name"]]["host_bound"]}
                      for k in report["kernels"]]
    finally:
        ours.close()
    dtypes = {n.attr: getattr(torch, rt.TORCH_DTYPE[n.dtype.value]) for n in baseline.inputs}
    names = [n.attr for n in baseline.inputs]
    device_sets = [[torch.tensor(s[n], dtype=dtypes[n], device="cuda") for n in names] for s in sets]
    eager = torch_function(baseline)
    call = lambda fn: lambda *xs: fn(**dict(zip(names, xs)))  # noqa: E731
    impls = [("torch eager", call(eager), device_sets),
             ("torch.compile", call(torch.compile(eager)), device_sets)] if baselines else []
    sized = {**report["dims"], **(report.get("padded") or {})}  # the sizes the caller gives
    if baselines and (attention := sdpa(torch, case["program"], sized)) is not None:
        attend, arrange = attention
        impls.append(("sdpa", lambda *xs: (attend(*xs),), [arrange(*xs) for xs in device_sets]))
    for impl, fn, arg_sets in impls:
        try:
            got = fn(*arg_sets[0])
            rows[impl] = (checked({mine: g.float().cpu().numpy() for (mine, _), g in zip(pairs, got)})
                          | time_torch(lambda xs: fn(*xs), arg_sets, REPEAT, BATCH, warmup=3))
        except Exception as err:  # a baseline that cannot run (torch.compile's backend, say) is a row, not the end
            rows[impl] = {"passed": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    del device_sets, impls
    torch.cuda.empty_cache()
    return {"workload": case["workload"], "dims": case["dims"], "options": case.get("options", []),
            "device": rt.gpu_status()[1],
            "hardware": hardware_name, "sets": len(sets),
            "floor_us": report["roofline"]["floor_us"], "model_us": report["estimated_us"],
            "kernels": len(plan["kernels"]), "per_kernel": per_kernel, "rows": rows, "params": report["parameters"]}


def gpu_usable() -> bool:
    """Whether the GPU still runs work after an error: a kernel's fault (an illegal address, pycuda's LogicError;
    a failed launch, its LaunchError) leaves the context unusable, and every later call fails too."""
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # the sticky error of the shared primary context
        return False


def table(results: list[dict], unmeasured: list[str] = (), choices: dict[str, list[dict]] | None = None) -> str:
    """The RESULTS.md text of measured `results`, naming the workloads `unmeasured` (no gpu.json) under the table;
    with `choices` (by workload, the measured results of its other kernel parameters), their table too."""
    devices = sorted({r["device"] for r in results})
    files = sorted({load_hardware(r["hardware"]).name for r in results})
    file_s = "file" if len(files) == 1 else "files"
    lines = [f"# GPU results ({', '.join(devices)})", "",
             "Written by `python benchmarks/gpu_fused.py run` (after `prepare`). Every implementation is checked "
             f"against the float64 reference (relative tolerance {RTOL} for these f16 programs, widened for a "
             "program where rounding its products' operands to f16 alone misses it: listed below the table); "
             "times are "
             "CUDA-event medians in microseconds, "
             f"each sample {BATCH} calls back to back over {BATCH}; \"alone\" is one call of ours between two events. "
             "A spinning kernel queued ahead of each sample keeps the host's time to queue the calls out of it: the "
             "times are the GPU's own (\"host-bound\" marks one where the host could not be kept out). "
             f"\"model\" is the cost model's estimate, \"floor\" the roofline floor (at the datasheet's peak bandwidth and "
             f"matrix rate), both for the hardware {file_s} "
             f"{', '.join(files)}, which the programs were tuned for.", "",
             "\"ours / best PyTorch\" sets ours beside the fastest of PyTorch's that agreed with the reference (eager, "
             "torch.compile or SDPA; a time marked wrong is never the one compared).", "",
             "| workload | kernels | ours | ours alone | torch eager | torch.compile | sdpa | model | floor | ours / floor "
             "| ours / torch.compile | ours / best PyTorch | max rel err (ours) | checks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows = r["rows"]
        ours = rows["prism-dsl"]

        def us(impl):
            if impl not in rows:
                return "-"
            if "us" not in rows[impl]:
                return "did not run"
            return (f"{rows[impl]['us']:.1f}" + ("" if rows[impl]["passed"] else " (wrong)")
                    + (" (host-bound)" if rows[impl].get("host_bound") else ""))
        failed = [impl for impl, row in rows.items() if not row["passed"]]
        versus = f"{ours['us'] / rows['torch.compile']['us']:.2f}" if "us" in rows.get("torch.compile", {}) else "-"
        if versus != "-" and not rows["torch.compile"]["passed"]:
            versus += " (wrong)"
        correct = [(row["us"], impl) for impl, row in rows.items() if impl != "prism-dsl" and row["passed"] and "us" in row]
        best = f"{ours['us'] / min(correct)[0]:.2f} ({min(correct)[1]})" if correct else "-"
        options = f" [{' '.join(r['options'])}]" if r.get("options") else ""
        lines.append(f"| {r['workload']} ({r['dims']}){options} | {r['kernels']} | {us('prism-dsl')} "
                     f"| {ours['alone_us']:.1f} "
                     f"| {us('torch eager')} | {us('torch.compile')} | {us('sdpa')} | {r['model_us']:.1f} "
                     f"| {r['floor_us']:.1f} | {ours['us'] / r['floor_us']:.2f} | {versus} | {best} | {ours['max_rel_err']:.1e} "
                     f"| {'ok' if not failed else 'FAILED: ' + ', '.join(failed)} |")
    widened = [f"- {r['workload']}: rounding its products' operands to f16, and nothing else, moves the output by "
               f"{max(row.get('rounding', 0.0) for row in r['rows'].values()):.1e}; every implementation judged at "
               f"{max(row.get('rtol', RTOL) for row in r['rows'].values()):.1e} (twice that; `compare.Tolerance`)"
               for r in results if max(row.get("rtol", RTOL) for row in r["rows"].values()) > RTOL]
    if unmeasured:
        lines += ["", f"Prepared but not measured (no gpu.json in the directory): "
                  f"{', '.join(unmeasured)}."]
    if widened:
        lines += ["", "Tolerances widened:", *widened]
    elsewhere = [f"- {r['workload']}: tuned and modelled for {load_hardware(r['hardware']).name}, measured on "
                 f"{r['device']}" for r in results if for_device(r["device"]) != r["hardware"]]
    if elsewhere:
        lines += ["", "Measured on another GPU than the hardware file's (`prepare --hardware NAME` tunes for it):",
                  *elsewhere]
    kernels = [f"| {r['workload']} | {k['name']} | {'x'.join(map(str, k['grid']))} x {k['block'][0]} "
               f"| {k['model_us']:.1f} ({k['bound']}) | {k['us']:.1f}{' (host-bound)' if k.get('host_bound') else ''} "
               f"| {k['us'] / k['model_us']:.2f} |"
               for r in results for k in r.get("per_kernel", [])]
    if kernels:
        lines += ["", "Each kernel of ours beside the model's estimate for it (events around each kernel of one call, "
                  "its zeroing included; the median of as many samples as \"alone\"), which is what the cost "
                  "model's constants answer to:", "",
                  "| workload | kernel | grid x threads | model us (bound) | measured us | measured / model |",
                  "|---|---|---|---|---|---|", *kernels]
    errors = [f"- {r['workload']}, {impl}: {row['error']}" for r in results for impl, row in r["rows"].items()
              if "error" in row]
    if errors:
        lines += ["", "Baselines that did not run:", *errors]
    lines += choices_table(results, choices or {})
    return "\n".join(lines) + "\n"


def choices_table(results: list[dict], choices: dict[str, list[dict]]) -> list[str]:
    """The lines of the table of each workload's kernel parameters timed (`run --choices`), the model's own first;
    none where no choice was measured."""
    rows, workloads, won, gains = [], 0, 0, []
    for r in results:
        if not (others := choices.get(r["workload"], [])):
            continue
        workloads += 1
        mine = r["rows"]["prism-dsl"]
        passed = [c for c in (r, *others) if c["rows"]["prism-dsl"]["passed"]]
        fastest = min(passed, key=lambda c: c["rows"]["prism-dsl"]["us"]) if passed else None
        won += fastest is r
        if fastest not in (None, r) and mine["passed"]:
            gains.append(mine["us"] / fastest["rows"]["prism-dsl"]["us"])
        for c in (r, *others):
            ours = c["rows"]["prism-dsl"]
            params = ", ".join(f"{n}={v}" for n, v in c.get("params", {}).items()) or "-"
            grids = "; ".join(f"{'x'.join(map(str, k['grid']))} x {k['block'][0]}" for k in c.get("per_kernel", []))
            name, whose = (r["workload"], " (the model's)") if c is r else ("", "")
            rows.append(f"| {name} | {params}{whose} | {grids} | {c['model_us']:.1f} "
                        f"| {ours['us']:.1f}{'' if ours['passed'] else ' (wrong)'} | {ours['alone_us']:.1f} "
                        f"| {ours['us'] / mine['us']:.2f} | {'fastest' if c is fastest else ''} |")
    if not rows:
        return []
    faster = f"; elsewhere the fastest was {min(gains):.2f}x to {max(gains):.2f}x faster than it" if gains else ""
    return ["", "Each workload's chosen program with the model's next best choices of its kernel parameters (`prepare "
            "--choices`, timed by `run --choices` as ours is above): what `prismc compile --rank measure` chooses "
            f"between. The model's own choice was the fastest in {won} of {workloads}{faster}.", "",
            "| workload | parameters | grid x threads | model us | ours | ours alone | / the model's choice | |",
            "|---|---|---|---|---|---|---|---|", *rows]


def run(args) -> int:
    from prism_dsl.backend.cuda_runtime import gpu_status

    ok, why = gpu_status()
    if not ok:
        print(f"gpu_fused.py run needs a usable CUDA GPU: {why}", file=sys.stderr)
        return 1
    directory = Path(args.dir)
    cases = [(name, directory / slug(name)) for name, _, _ in WORKLOADS
             if (directory / slug(name) / "case.json").exists()]
    if not cases:
        print(f"no prepared workloads in {directory}: run `python benchmarks/gpu_fused.py prepare` first",
              file=sys.stderr)
        return 1
    if getattr(args, "choices", False):  # each workload's other kernel parameters (`prepare_choices`), ours alone
        cases = [(f"{name}, choice {c.parent.name}", c.parent) for name, out in cases
                 for c in sorted((out / "choices").glob("*/case.json"))]
    failed = 0
    for name, out in cases:
        saved = out / "gpu.json"
        if not wanted(args.only, name) or (saved.exists() and not args.again):
            continue
        started = time.monotonic()
        try:
            alone = getattr(args, "choices", False) or getattr(args, "no_baselines", False)
            result = run_case(out, baselines=not alone)
        except Exception as err:  # pycuda's errors derive from Exception only; one workload's failure is its row's
            failed += 1
            print(f"{name}: {type(err).__name__}: {err}", file=sys.stderr)
            if not gpu_usable():  # a fault in a kernel (an illegal address, say) leaves the context unusable
                print("stopping: the CUDA context cannot run further kernels after that fault; rerun `run` "
                      "(workloads measured so far keep their gpu.json)", file=sys.stderr)
                break
            continue
        written = saved.with_name("gpu.json.new")  # whole or not at all: a step cut short mid-write leaves no gpu.json
        written.write_text(json.dumps(result, indent=2) + "\n")
        written.replace(saved)
        ours = result["rows"]["prism-dsl"]
        print(f"{name}: ours {ours['us']:.1f} us ({'ok' if ours['passed'] else 'WRONG'}); "
              f"{time.monotonic() - started:.0f} s", flush=True)
    return 1 if write_table(directory, Path(args.results)) or failed else 0


def profile(args) -> int:
    """Each prepared workload's kernels run once, ours alone (no timing, no spin, no PyTorch), checked against the
    reference: what a profiler wrapping this command sees is the generated kernels and nothing else."""
    from prism_dsl.backend.cuda_runtime import gpu_status

    ok, why = gpu_status()
    if not ok:
        print(f"gpu_fused.py profile needs a usable CUDA GPU: {why}", file=sys.stderr)
        return 1
    failed = 0
    for saved in sorted(Path(args.dir).glob("*/case.json")):
        out, case = saved.parent, json.loads(saved.read_text())
        name = case["workload"]
        if not wanted(args.only, name):
            continue
        try:  # one workload's failure is its line: the profiler still sees the others
            launcher, baseline, sets, reference, pairs, tol = oracle(out, case["hardware"], one_set=True)
            ours = launcher.prism_runtime.Launcher(launcher.PLAN, out, cast=True)
            try:
                got = ours(**sets[0])
            finally:
                ours.close()
        except Exception as err:  # pycuda's errors derive from Exception only
            failed += 1
            print(f"{name}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            if not gpu_usable():
                print("stopping: the CUDA context cannot run further kernels after that fault", file=sys.stderr)
                break
            continue
        found = verdict(got, reference, pairs, tol)
        failed += not found["passed"]
        print(f"{name}: {'ok' if found['passed'] else 'WRONG'} (max rel err {found['max_rel_err']:.1e})", flush=True)
    return 1 if failed else 0


def write_table(directory: Path, results_md: Path, only: str | None = None) -> int:
    """`results_md` from every gpu.json under `directory` (of the workloads `only` names: `wanted`), in the
    workloads' order; 1 if one of ours failed."""
    names = [name for name, _, _ in WORKLOADS if wanted(only, name)]
    saved = {name: directory / slug(name) / "gpu.json" for name in names}
    def read(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except ValueError as e:  # named: which file to measure again
            raise ValueError(f"{path}: {e}") from None

    try:
        results = [read(path) for path in saved.values() if path.exists()]
        if not results:
            print(f"no measured workloads (gpu.json) in {directory}", file=sys.stderr)
            return 1
        choices = {name: [read(c) for c in sorted(path.parent.glob("choices/*/gpu.json"))]
                   for name, path in saved.items() if path.exists()}
        text = table(results, [name for name, path in saved.items() if not path.exists() and path.parent.is_dir()],
                     choices)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # one damaged or from elsewhere
        print(f"a gpu.json under {directory} is not what `run` writes ({type(e).__name__}: {e}): measure that "
              "workload again (run --again --only NAME) or remove its gpu.json; nothing was written", file=sys.stderr)
        return 1
    results_md.write_text(text)
    print(text)
    return 1 if any(not r["rows"]["prism-dsl"]["passed"] for r in results) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    pre = sub.add_parser("prepare", help="compile every workload into DIR (any machine)")
    pre.add_argument("--time-limit", type=float, default=30.0, help="search time per workload (seconds)")
    pre.add_argument("--hardware", default="h100", choices=hardware_names(), help="the hardware file to tune for and "
                     "to take the model and the floor from: the GPU's")
    pre.add_argument("--choices", type=whole, default=CHOICES, help="choices of each workload's kernel parameters to "
                     "prepare, the model's own among them, for `run --choices` (0: none)")
    pre.add_argument("--options", default="", help="more options for prismc compile, as one quoted argument: "
                     "--options=\"--no-wgmma\" "
                     "(into a --dir of their own: the table names them beside each workload)")
    go = sub.add_parser("run", help="check and time the prepared workloads (a CUDA GPU)")
    go.add_argument("--again", action="store_true", help="measure workloads that already have a gpu.json")
    go.add_argument("--choices", action="store_true", help="check and time each workload's other choices of kernel "
                    "parameters (`prepare --choices`), ours alone, instead of the workloads")
    go.add_argument("--no-baselines", action="store_true", help="time ours alone, not PyTorch (a directory compiled "
                    "with other options: PyTorch's times are those of the default directory's run)")
    tab = sub.add_parser("table", help="write benchmarks/RESULTS.md from the gpu.json files in DIR (any machine)")
    prof = sub.add_parser("profile", help="run each prepared workload's kernels once, for a profiler (a CUDA GPU)")
    for p in (pre, go, tab, prof):
        p.add_argument("--dir", default=str(ROOT / "out" / "gpu"), help="where the compiled workloads are")
        p.add_argument("--only", help="workloads whose name contains this (or one of these, comma-separated; =NAME: that name exactly)")
    for p in (go, tab):
        p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"), help="the table's file")
    args = parser.parse_args()
    if args.only and not any(wanted(args.only, name) for name, _, _ in WORKLOADS):
        parser.error(f"--only {args.only!r} names no workload (they are: {', '.join(w[0] for w in WORKLOADS)})")
    try:
        shlex.split(getattr(args, "options", ""))
    except ValueError as e:
        parser.error(f"--options {args.options!r}: {e}")
    with contextlib.suppress(KeyboardInterrupt):
        return {"prepare": prepare, "run": run, "profile": profile,
                "table": lambda a: write_table(Path(a.dir), Path(a.results), a.only)}[args.step](args)
    return 130


if __name__ == "__main__":
    sys.exit(main())
