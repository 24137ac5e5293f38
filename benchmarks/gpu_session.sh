#!/usr/bin/env bash
# One sitting on a GPU machine, in the order that matters most when its time may run out: one workload to see
# the chain work, two TMA copies made four ways (tma_probe.py), the decode workloads (checked and timed,
# gpu_fused.py run), their other choices of kernel parameters (run --choices), the model's memory and launch
# figures (gpu_probe.py), the prefill workloads and their choices, the prefill workloads compiled with TMA where
# `prepare --dir out/gpu-tma` made them (their copies a copy warp's; with thread 0's, `out/gpu-tma-thread0`), and
# the tests that need a GPU. Each step has a time limit and the whole a
# budget; a step cut short keeps what it measured (each workload's gpu.json is written as soon as it is measured).
#
#     python benchmarks/gpu_fused.py prepare --hardware h200                                  # here first
#     python benchmarks/gpu_fused.py prepare --hardware h200 --dir out/gpu-tma --only prefill --options="--tma"
#     python benchmarks/gpu_fused.py prepare --hardware h200 --dir out/gpu-tma-thread0 --only prefill \
#         --options="--tma --no-copy-warp"                                                    # for tma-thread0
#     python benchmarks/gpu_fused.py prepare --hardware h200 --dir out/gpu-two --only "attention decode,gqa" \
#         --options="--two-launches"                                                          # for two-launches
#     # copy the repository with out/ (and wheels of pycuda and lark in .whl/, if the GPU machine lacks them) there:
#     benchmarks/gpu_session.sh [BUDGET_SECONDS [STEP...]]     # on the GPU machine, from anywhere
#     # bring back $RESULTS/session.tar.gz; here: tar xzf it, then python benchmarks/gpu_fused.py table
#
# STEPs, in the order given (default: first decode choices probe profile prefill tma-first choices-prefill
# profile-prefill tma tests): first (one decode workload, to see that the whole chain works before the rest),
# tmacopy (not in the default: the probe's answer is in benchmarks/NOTES.md, 2026-11-30), decode, choices (the decode workloads' other kernel parameters, ours alone: `prepare --choices`), probe,
# profile (Nsight Compute on our decode kernels, each run once by `gpu_fused.py profile`: where their time goes),
# prefill, tma-first (one workload of the `--tma` directory under a short limit: a TMA fault or hang shows there
# rather than eating the tma step), choices-prefill, profile-prefill (the same on the prefill kernels: whether the
# tensor pipes or L2 bound them), tma, tma-thread0 (not in the default: TMA's copies by thread 0, to set beside the copy warp's),
# two-launches (not in the default: the decode splits' combining kernels in launches of their own, to set beside
# the combine by each tile's last block: whether that is the 9-16 us the model misses at decode), tests.
# The tma, tma-thread0 and two-launches steps time ours alone (`run --no-baselines`: PyTorch's times are the
# decode and prefill steps'). A workload measured by an earlier step or call (its gpu.json) is not measured again.
# RESULTS (default $OUT where the device tool sets it, else out/session) gets steps.txt (each step's exit status and
# time) and session.tar.gz (every gpu.json, probe.json and each step's log, under their paths in the repository),
# written again after every step, so that a call cut short brings back what it measured; a relative RESULTS is
# taken from the repository's root. Exits 1 where a step failed or was cut short (steps.txt says which), 2 on an argument it
# does not take.

set -u
cd "$(dirname "$0")/.."
budget=${1:-540}
if ! [[ $budget =~ ^[0-9]+$ ]]; then
    echo "the first argument is the budget in whole seconds (then the steps), got '$budget'" >&2
    exit 2
fi
shift $(( $# ? 1 : 0 ))
steps=("$@")
(( ${#steps[@]} )) || steps=(first decode choices probe profile prefill tma-first choices-prefill profile-prefill tma tests)
for name in "${steps[@]}"; do
    case $name in first | tmacopy | decode | choices | probe | profile | prefill | tma-first | choices-prefill \
                  | profile-prefill | tma | tma-thread0 | two-launches | tests) ;;
        *) echo "unknown step '$name' (first, tmacopy, decode, choices, probe, profile, prefill, tma-first," \
                "choices-prefill, profile-prefill, tma, tma-thread0, two-launches, tests)" >&2
           exit 2 ;;
    esac
done
results=${RESULTS:-${OUT:-out/session}}
rm -rf out/logs "$results/steps.txt"
mkdir -p "$results" out/logs
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
begun=$SECONDS
failures=0

pack() {  # what the session has measured so far, into $results/session.tar.gz (written whole, then renamed)
    tar czf "$results/session.tar.gz.new" out/logs $(ls out/probe.json out/RESULTS-*.md out/gpu*/*/gpu.json \
        out/gpu*/*/choices/*/gpu.json 2>/dev/null) && mv "$results/session.tar.gz.new" "$results/session.tar.gz"
}

step() {  # step NAME SECONDS COMMAND...: runs COMMAND for at most SECONDS, or what is left of the budget
    local name=$1 limit=$2 left=$((budget - (SECONDS - begun))) at=$SECONDS rc
    shift 2
    (( limit > left )) && limit=$left
    if (( limit < 15 )); then
        echo "$name: skipped, the budget is spent" | tee -a "$results/steps.txt"
        return
    fi
    timeout --kill-after=5 "$limit" "$@" >"out/logs/$name.log" 2>&1
    rc=$?
    (( rc == 0 )) || failures=$((failures + 1))
    echo "$name: exit $rc in $((SECONDS - at)) s (limit $limit s)$( ((rc == 124 || rc == 137)) && echo ', cut short')" \
        | tee -a "$results/steps.txt"
    tail -n 4 "out/logs/$name.log"
    pack
}

prepared() {  # prepared DIR STEP: whether DIR was prepared; if not, steps.txt says that STEP was skipped
    [ -d "$1" ] && return 0
    echo "$2: skipped, $1 was not prepared" | tee -a "$results/steps.txt"
    return 1
}

if [ -d .whl ] && ! python3 -c "import pycuda, lark" 2>/dev/null; then
    step wheels 60 python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target out/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$PWD/out/site"
fi
# Each prepared workload runs the runtime copied beside its kernels when it was prepared; a fix to the runtime made
# since (2026-11-30: its parameters' struct format) reaches them only if they are prepared again, so the copies
# are brought up to date here, and the log says which were stale.
for copy in $(find out -path 'out/gpu*' \( -name prism_runtime.py -o -name cuda_plan.py \) 2>/dev/null); do
    case $copy in */prism_runtime.py) src=prism_dsl/backend/cuda_runtime.py ;; *) src=prism_dsl/backend/cuda_plan.py ;; esac
    cmp -s "$src" "$copy" || { cp "$src" "$copy" && echo "brought up to date: $copy" | tee -a "$results/steps.txt"; }
done
step machine 30 sh -c 'nvidia-smi; nvcc --version; python3 -c "import sys, torch, numpy, pycuda; \
print(sys.version); print(torch.__version__, numpy.__version__, pycuda.VERSION_TEXT)"'
# Nsight Compute on the kernels of the workloads whose name holds $1, each run once (`gpu_fused.py profile`), one
# workload a process: ncu prints a process's report when it ends, so a step cut short keeps the workloads done
profiled='ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    [ -n "$ncu" ] || { echo "skipped: no ncu (Nsight Compute) on this machine"; exit 0; }
    python3 -c "import json, sys, glob; [print(json.load(open(f))[\"workload\"]) for f in sorted(glob.glob(\"out/gpu/*/case.json\"))]" \
        | grep -F -- "$0" | while IFS= read -r name; do
        "$ncu" --clock-control none --kernel-name regex:^prism_ --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
            python3 benchmarks/gpu_fused.py profile --only "=$name"
    done'
for name in "${steps[@]}"; do
    case $name in
        tests) step tests 60 python3 -m pytest -q -p no:cacheprovider -m "gpu or nvcc" tests/test_runtime.py ;;
        first) step first 90 python3 benchmarks/gpu_fused.py run --only "rmsnorm_linear decode" ;;
        tmacopy) step tmacopy 90 python3 benchmarks/tma_probe.py ;;
        decode) step decode 200 python3 benchmarks/gpu_fused.py run --only decode ;;
        choices) step choices 200 python3 benchmarks/gpu_fused.py run --choices --only decode ;;
        choices-prefill) step choices-prefill 150 python3 benchmarks/gpu_fused.py run --choices --only prefill ;;
        probe) step probe 120 python3 benchmarks/gpu_probe.py --json out/probe.json ;;
        profile) step profile 150 sh -c "$profiled" decode ;;
        prefill) step prefill 240 python3 benchmarks/gpu_fused.py run --only prefill ;;
        profile-prefill) step profile-prefill 150 sh -c "$profiled" prefill ;;
        tma-first) prepared out/gpu-tma tma-first && step tma-first 60 python3 benchmarks/gpu_fused.py run \
                       --dir out/gpu-tma --only "rmsnorm_linear prefill" --no-baselines --results out/RESULTS-tma.md ;;
        tma) prepared out/gpu-tma tma && step tma 200 python3 benchmarks/gpu_fused.py run --dir out/gpu-tma \
                 --no-baselines --results out/RESULTS-tma.md ;;
        tma-thread0) prepared out/gpu-tma-thread0 tma-thread0 && step tma-thread0 200 python3 \
                         benchmarks/gpu_fused.py run --dir out/gpu-tma-thread0 --no-baselines \
                         --results out/RESULTS-tma-thread0.md ;;
        two-launches) prepared out/gpu-two two-launches && step two-launches 120 python3 benchmarks/gpu_fused.py \
                          run --dir out/gpu-two --no-baselines --results out/RESULTS-two.md ;;
    esac
done

pack
echo "session: $((SECONDS - begun)) s; $(tar tzf "$results/session.tar.gz" | grep -c gpu.json) workloads measured;" \
    "$failures step(s) failed"
exit $(( failures ? 1 : 0 ))
