"""`prismc bench`: a program's generated kernels against PyTorch eager and torch.compile, on a GPU.

All three run on the same random inputs in the same process; each is checked against the float64 reference
before its time counts. Times are CUDA-event medians after warm-up, inputs rotated across three sets, the
GPU's own: a spinning kernel queued ahead of each sample keeps the host's time to queue the calls out of it
(`cuda_runtime.Ahead`; a time marked "host-bound" could not leave it out). The table gives each time beside
the program's roofline floor (`roofline.roofline`). PyTorch runs the baseline program (the file itself, or
`--baseline` when the file's kernels are hand-written), translated op by op through `TORCH` below; torch is
imported only here.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import numpy as np

from ..backend import cuda_runtime, roofline
from ..base.files import check_apart, check_writable, write_bytes
from ..pipeline.build import BuildOptions, build, measure, reference_outputs, tolerance_of
from ..pipeline.compile import check_device
from ..pipeline.optimize import rank
from ..pipeline.report import json_finite
from ..lang.check import load
from ..base.errors import PrismError
from ..kernels.hardware import load_hardware
from ..kernels.kernel import kernels_of
from ..prove.prover import check_signatures, pair_outputs
from ..semantics.reference import bind_dims, check_sizes, check_inputs

# How each op of a program runs in PyTorch (x: tensors; attr: a reduction's dim).
TORCH = {
    "add": lambda t, x, a: x[0] + x[1], "sub": lambda t, x, a: x[0] - x[1], "mul": lambda t, x, a: x[0] * x[1],
    "div": lambda t, x, a: x[0] / x[1], "matmul": lambda t, x, a: x[0] @ x[1], "neg": lambda t, x, a: -x[0],
    "exp": lambda t, x, a: t.exp(x[0]), "sqrt": lambda t, x, a: t.sqrt(x[0]), "rsqrt": lambda t, x, a: t.rsqrt(x[0]),
    "square": lambda t, x, a: x[0] * x[0], "sigmoid": lambda t, x, a: t.sigmoid(x[0]),
    "silu": lambda t, x, a: t.nn.functional.silu(x[0]), "gelu": lambda t, x, a: t.nn.functional.gelu(x[0]),
    "tanh": lambda t, x, a: t.tanh(x[0]), "gelu_tanh": lambda t, x, a: t.nn.functional.gelu(x[0], approximate="tanh"),
    "relu": lambda t, x, a: t.relu(x[0]), "sum": lambda t, x, a: x[0].sum(a, keepdim=True),
    "max": lambda t, x, a: x[0].amax(a, keepdim=True), "mean": lambda t, x, a: x[0].mean(a, keepdim=True),
    "rms_norm": lambda t, x, a: x[0] / t.sqrt((x[0] * x[0]).mean(-1, keepdim=True)),
    "softmax": lambda t, x, a: t.softmax(x[0], -1),
    "rms_norm_eps": lambda t, x, a: x[0] / t.sqrt((x[0] * x[0]).mean(-1, keepdim=True) + x[1]),
    "layer_norm": lambda t, x, a: t.nn.functional.layer_norm(x[0], x[0].shape[-1:], eps=float(x[1])),
    "transpose": lambda t, x, a: x[0].transpose(*a),
    "rope": lambda t, x, a: x[0] * x[1] + _rotate_half(t, x[0]) * x[2],
    "causal": lambda t, x, a: _causal(t, x[0]),
}


def _rotate_half(t, x):
    half = x.shape[-1] // 2
    return t.cat([-x[..., half:], x[..., :half]], dim=-1)


def _causal(t, x):
    """-inf above the diagonal that ends at the last row's last column (`semantics.reference._causal`)."""
    rows, cols = x.shape[-2:]
    above = t.ones(rows, cols, dtype=t.bool, device=x.device).triu(cols - rows + 1)
    return x.masked_fill(above, float("-inf"))


def torch_function(program):
    """A Python function of the program's inputs (torch tensors) computing its outputs with torch ops."""
    import torch

    for n in program.nodes():
        if n.op not in TORCH and n.op not in ("input", "const"):
            raise PrismError(f"PyTorch cannot run '{n.op}' of program '{program.name}'; give --baseline with the "
                             f"program as written")

    def run(**inputs):
        values = {}
        for n in program.nodes():
            if n.op == "input":
                values[n] = inputs[n.attr]
            elif n.op == "const":
                values[n] = n.attr
            else:
                values[n] = TORCH[n.op](torch, [values[a] for a in n.args], n.attr)
        return tuple(values[node] for _, node in program.outputs)

    return run


def time_torch(call, arg_sets: list, repeat: int, batch: int = 1, warmup: int = 10) -> dict:
    """Microseconds per call of `call(arg_set)` on the GPU, as the runtime times ours (`cuda_runtime.Ahead`): the
    median over `repeat` samples, each `batch` calls between two CUDA events over `batch`, rotating through
    `arg_sets` (warm-up calls first), with torch's spinning kernel queued ahead of the first event so that the
    host's time to queue the calls (Python, and torch.compile's guards) is not counted. {"us", "host_bound"}."""
    import torch

    torch.cuda._sleep(0)  # its kernel loaded now, not in the first sample
    for i in range(warmup):
        call(arg_sets[i % len(arg_sets)])
    torch.cuda.synchronize()
    lead, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    ahead, times = cuda_runtime.Ahead(), []

    def queue(cycles: int, r: int) -> None:
        lead.record()
        torch.cuda._sleep(cycles)
        start.record()
        for j in range(batch):
            call(arg_sets[(r * batch + j) % len(arg_sets)])
        end.record()

    def lead_ms() -> float:
        end.synchronize()
        return lead.elapsed_time(start)

    for r in range(repeat):
        ahead.sample(functools.partial(queue, r=r), lead_ms)
        times.append(start.elapsed_time(end) / batch)
    return {"us": float(np.median(times)) * 1000.0, "host_bound": ahead.behind}


def bench(args) -> int:
    hardware = load_hardware(args.hardware)  # the user's files and flags first: they need no GPU to be wrong
    program = load(args.file).program(args.program)
    baseline = load(args.baseline).program() if args.baseline else program
    if kernels_of(baseline) and args.baseline:
        raise PrismError(f"the baseline '{baseline.name}' ({args.baseline}) has custom kernels: PyTorch runs the "
                         "program as written, in plain operators")
    if kernels_of(baseline):
        raise PrismError(f"'{program.name}' has custom kernels; give --baseline with the program as written")
    check_signatures(program, baseline)  # the same inputs and outputs as the baseline, said before the GPU is asked for
    pair_outputs(program, baseline)
    check_sizes(baseline, bind_dims(baseline, dict(args.dims)))
    if args.json_out:  # said now, not after the timing
        check_writable(args.json_out)
        check_apart({"--json": args.json_out}, {"the program's file": args.file, "--baseline": args.baseline})
    ok, why = cuda_runtime.gpu_status()
    if not ok:
        raise PrismError(f"prismc bench needs a usable CUDA GPU: {why}")
    import torch

    check_device(hardware, "prismc bench")  # a GPU the kernels made for `hardware` can run on
    options = BuildOptions(dims=args.dims, rank="measure", emulate=False, archs=())
    if (chosen := rank(program, bind_dims(program, dict(args.dims)), hardware, options.codegen)) is not None:
        # the parameters and threads `prismc compile --search none` builds it with (`optimize.rank`)
        options = replace(options, params=chosen.params, codegen=chosen.codegen(options.codegen))
    built = build(program, hardware, options, baseline)  # checked against the program as written
    binding = bind_dims(baseline, dict(args.dims))
    inputs = [check_inputs(baseline, binding, seed) for seed in range(3)]  # as `measure` checks ours
    ref = reference_outputs(built, inputs[0])
    tolerance = tolerance_of(built, inputs[0])  # PyTorch's outputs judged as ours are
    gpu = measure(built, options.seed, args.repeat)  # timed as many times as PyTorch's
    rows = [{"impl": "prism-dsl", "us": round(gpu.timing_ms["median_ms"] * 1000, 3), "passed": gpu.passed,
             "max_rel_err": max(o["max_rel_err"] for o in gpu.outputs.values()),
             "host_bound": gpu.timing_ms["host_bound"]}]
    dtypes = {n.attr: getattr(torch, cuda_runtime.TORCH_DTYPE[n.dtype.value]) for n in baseline.inputs}
    dev = [{k: torch.tensor(v, dtype=dtypes[k], device="cuda") for k, v in s.items()} for s in inputs]
    eager = torch_function(baseline)
    for name, fn in (("torch eager", eager), ("torch.compile", torch.compile(eager))):
        got = fn(**dev[0])
        checks = [tolerance.judge(o, g.float().cpu().numpy(), ref[o]) for g, (o, _) in zip(got, baseline.outputs)]
        timed = time_torch(lambda s: fn(**s), dev, args.repeat)
        rows.append({"impl": name, "us": round(timed["us"], 3), "passed": all(c["passed"] for c in checks),
                     "max_rel_err": max(c["max_rel_err"] for c in checks), "host_bound": timed["host_bound"]})
    roof = roofline.roofline(baseline, binding, hardware)
    table = {"program": program.name, "device": why, "dims": {d.name: int(binding[d.symbol]) for d in baseline.dims},
             "roofline_us": roof["floor_us"], "rows": rows}
    print(f"{program.name} on {why} (dims {', '.join(f'{k}={v}' for k, v in table['dims'].items())}); "
          f"roofline floor {roof['floor_us']} us")
    print(f"  {'implementation':<16}{'time (us)':>12}{'x floor':>10}{'max rel err':>14}  check")
    for r in rows:
        print(f"  {r['impl']:<16}{r['us']:>12.2f}{r['us'] / roof['floor_us']:>10.2f}{r['max_rel_err']:>14.2e}  "
              f"{'ok' if r['passed'] else 'FAILED'}{'  (host-bound)' if r['host_bound'] else ''}")
    if args.json_out:
        write_bytes(args.json_out, (json.dumps(json_finite(table), indent=2, allow_nan=False) + "\n").encode())
    return 0 if all(r["passed"] for r in rows) else 1
