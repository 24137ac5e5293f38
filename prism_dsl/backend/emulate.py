"""The thread-faithful CPU emulation of generated CUDA: the rendered kernels, compiled as C++, run as a GPU
would run them, without a GPU.

Where it sits: after codegen, beside the nvcc compile check; the pipeline's emulate pass and `prismc verify`
call it. The same `.cu` text the GPU would run is compiled by the host C++ compiler with `PRISM_CPU`
defined (templates/prism.cuh, templates/prism_emu.h; the runtime, templates/prism_emu.cc, compiled once per
set of flags and kept in the cache: `runtime_object`) into a standalone program: every CUDA thread of a
block is a fiber, the blocks of a wave run interleaved, `__syncthreads()` is a real barrier, warp
shuffles and tensor-core fragments are exchanges between the 32 lanes, `cp.async` data appears only at its
wait, atomics round as the GPU's do, shared memory and outputs start as NaN. It runs in a child process, so
a hang is a timeout and a crash a finding, never the caller's.

The same program builds under ThreadSanitizer (`sanitizer="thread"`: data races between threads of a
block and between blocks) or AddressSanitizer with UndefinedBehaviorSanitizer (`"address"`: out-of-bounds
and misaligned accesses, each shared buffer a separate allocation). What either finds, and what the
emulation itself finds (a divergent barrier or warp collective, a misaligned tensor-core or async-copy
address, copies never waited for), comes back as a `Finding` with the kernel, the generated `.cu` lines and
the threads involved. A fourth build, `"banks"`, counts the kernels' shared-memory wavefronts (`banks`).

At large dims, emulating every block is too slow on a CPU: `sample_blocks` picks the first and last block
along every grid axis and some at random (all blocks along axes whose results are summed), and `written`
says which output elements those blocks write, so that exactly those are compared.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..base import cache, files
from ..base.errors import PrismError
from ..base.resources import data_dir
from ..ir.nodes import DType
from ..kernels.constraints import Concrete
from .codegen import CTYPE, HEADER, RenderedKernel
from .copies import SWIZZLE_BYTES
from .cuda_runtime import STORAGE, from_bf16_bits, to_bf16_bits
from .nvcc import write_sources
from .sums import summed_axes

RUNTIME = "prism_emu.h"  # the emulation's runtime, beside prism.cuh in templates/: what kernels see of it
RUNTIME_DEFINITIONS = "prism_emu.cc"  # the rest of it, compiled once per set of flags (`runtime_object`)
RUNTIME_BANKS = "prism_banks.cc"  # with it, in the "banks" build: the count of shared-memory wavefronts (`banks`)
RUNTIME_OBJECTS_KEPT = 8  # in the cache: each set of flags (4) for this version of the runtime and the one before
MAX_OBJECT_BYTES = 64 * files.MiB  # the runtime's object: 1-5 MB
SANITIZERS = ("thread", "address")
THREADS_PER_WAVE = 1024  # threads live at once (whole blocks): what an SM holds is 2048
TIMEOUT = 600.0  # seconds one emulation may run
# The plain build is optimized (-O1): with the runtime compiled apart (`runtime_object`) g++ optimizes only the
# kernels and their harness, which costs no more than it saves even at the tests' dims (1.0-1.6 s a check either
# way), and saves a fifth at larger ones (fused rmsnorm_mlp, d=4096: 13.7 s against 17.6 s; 2 cores).
# ThreadSanitizer's build: -O1 (the two measured about even: a faster build, a slower run).
# AddressSanitizer with UBSan builds at -O0: g++ takes 2-3 times as long to compile UBSan's checks with the
# optimizer on (15 s against 5 s for fused attention, 2 cores), more than the slower run costs at the dims
# sanitizers run at, and nothing the sanitizers look for is optimized away.
_FLAGS = {
    None: ["-O1"],
    "thread": ["-O1", "-fsanitize=thread"],
    "address": ["-O0", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"],
    "banks": ["-O1", "-DPRISM_BANKS"],
}
# The runtime's own fiber switch on x86-64 returns where no call came from (prism_emu.cc, `switch_context`): an
# executable marked as fit for CET shadow stacks (g++'s default where -fcf-protection is on) would stop at its first
# switch on a kernel and C library that turn them on, so the emulation is built unmarked.
_NO_SHADOW_STACK = ["-fcf-protection=none"] if platform.machine().lower() in ("x86_64", "amd64") else []
# The "banks" build's kernels (not its runtime): every load and store an outlined call, which prism_banks.cc takes.
_INSTRUMENT = {
    "g++": ["-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0", "--param",
            "asan-stack=0", "--param", "asan-globals=0"],
    "clang++": ["-fsanitize=kernel-address", "-mllvm", "-asan-instrumentation-with-call-threshold=0", "-mllvm",
                "-asan-stack=0", "-mllvm", "-asan-globals=0"],
}
_ENV = {  # each sanitizer stops at its first report, with an exit status of its own
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:history_size=4:report_signal_unsafe=0",
    "ASAN_OPTIONS": "halt_on_error=1:exitcode=67:detect_leaks=0:detect_stack_use_after_return=0",
    "UBSAN_OPTIONS": "halt_on_error=1:exitcode=68:print_stacktrace=1",
}
EXIT_FINDING = 3  # prism_emu.h: a finding of the emulation itself


def compiler() -> str | None:
    """The host C++ compiler, or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def runtime_source(name: str = RUNTIME) -> str:
    return (data_dir("templates", "templates") / name).read_text()


def interface_problem(header: str) -> str | None:
    """Why a prism.cuh (an output directory's, say) cannot be built with this runtime, or None: its emulated
    forms are written against the runtime's interface (`PRISM_EMU_INTERFACE` in prism_emu.h), which it names."""
    want = re.search(r"#define PRISM_EMU_INTERFACE (\d+)", runtime_source())
    have = re.search(r"PRISM_EMU_INTERFACE == (\d+)", header)
    if want is None or (have is not None and have.group(1) == want.group(1)):
        return None
    of = f"interface {have.group(1)}" if have else "an interface from before version 2"
    return f"its emulated forms are written for {of} of the emulation's runtime, which is at {want.group(1)} now"


@dataclass(frozen=True)
class Finding:
    """What the emulation or a sanitizer reported about the generated code."""

    kind: str  # "emulation", "data race", "memory error", "undefined behaviour", "crash", "timeout"
    kernel: str | None  # the kernel's name in the program, where known
    message: str
    where: tuple[str, ...] = ()  # generated-code lines, "FILE.cu:LINE"
    threads: tuple[str, ...] = ()  # the emulated threads involved

    def text(self) -> str:
        head = f"{self.kind} in kernel '{self.kernel}'" if self.kernel else self.kind
        return "\n".join([f"{head}: {self.message}", *(f"  at {w}" for w in self.where),
                          *(f"  thread: {t}" for t in self.threads)])

    def as_dict(self) -> dict:
        return {**asdict(self), "where": list(self.where), "threads": list(self.threads)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Finding":
        return cls(d["kind"], d["kernel"], d["message"], tuple(d["where"]), tuple(d["threads"]))


@dataclass(frozen=True)
class Result:
    outputs: dict[str, np.ndarray]  # every tensor a kernel wrote, float64; empty when there is a finding
    finding: Finding | None
    seconds: float  # compiling and running
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # per kernel: (blocks emulated, grid's blocks)
    log: str = ""  # what the emulation printed on stdout (the "banks" build's counts)


# -- building ------------------------------------------------------------------------------------------------------


def _written_by(k: RenderedKernel) -> tuple[str, ...]:
    return k.args[len(k.args) - k.stores:]


def _tensors(kernels: Sequence[RenderedKernel]) -> list[str]:
    return list(dict.fromkeys(a for k in kernels for a in k.args))


def _harness(kernels: Sequence[RenderedKernel], dtypes: Mapping[str, DType], shapes: Mapping[str, tuple[int, ...]]) -> str:
    names = _tensors(kernels)
    lines = ["// The emulation's main program, generated by prismc: the tensors and kernels of one build.",
             "#define PRISM_CPU 1"]
    lines += [f'#include "{k.file}"' for k in kernels]
    for k in kernels:
        n_inputs = len(k.args) - k.stores
        # the tensor maps of its TMA copies first, as the CUDA driver would encode them for these tensors
        casts = [f"prism::emu::tensor_map(a[{k.args.index(m.tensor)}], {STORAGE[m.dtype.value].itemsize}, "
                 f"{{{', '.join(map(str, shapes[m.tensor]))}}}, {{{', '.join(map(str, m.box))}}}, {SWIZZLE_BYTES}, {int(m.fill)})"
                  for m in k.maps]
        casts += [f"({'const ' if i < n_inputs else ''}{CTYPE[dtypes[a]]}*)a[{i}]" for i, a in enumerate(k.args)]
        # its tiles' counters (a combining kernel in its launch, or sums across blocks: `sums`) and its sums' f32
        # workspaces, zero before it runs (its tiles' last blocks zero them again)
        for what, ctype, n in (("tickets", "unsigned", k.tickets), ("sums", "float", k.sums)):
            if n:
                lines.append(f"alignas(16) static {ctype} {what}_{k.function}[{n}];")
                casts.append(f"{what}_{k.function}")
        lines += [f"static void launch_{k.function}(void* const* a) {{ {k.function}({', '.join(casts)}); }}"]
    lines += ["int main(int argc, char** argv) {", "    const std::vector<prism::emu::TensorEntry> tensors = {"]
    lines += [f'        {{"{n}", {int(np.prod(shapes[n], dtype=np.int64)) * STORAGE[dtypes[n].value].itemsize}u}},'
              for n in names]
    lines += ["    };", "    const std::vector<prism::emu::KernelEntry> kernels = {"]
    for k in kernels:
        args = ", ".join(str(names.index(a)) for a in k.args)
        lines.append(f'        {{"{k.name}", launch_{k.function}, {{{args}}}, {{{k.grid[0]}u, {k.grid[1]}u, {k.grid[2]}u}}, '
                     f"{{{k.block[0]}u, {k.block[1]}u, {k.block[2]}u}}, {k.smem}u}},")
    lines += ["    };", "    return prism::emu::harness(argc, argv, tensors, kernels);", "}"]
    return "\n".join(lines) + "\n"


def write_build(kernels: Sequence[RenderedKernel], directory: Path, header: str | None = None) -> None:
    """The kernels' sources (`nvcc.write_sources`; prism.cuh replaced by `header` when given) and the runtime."""
    write_sources(kernels, directory)
    if header is not None:
        (directory / HEADER).write_text(header)
    (directory / RUNTIME).write_text(runtime_source())


def build(kernels: Sequence[RenderedKernel], dtypes: Mapping[str, DType], shapes: Mapping[str, tuple[int, ...]],
          workdir: Path, sanitizer: str | None = None, header: str | None = None) -> Path:
    """Compile the kernels and their harness into an executable in `workdir` (under `sanitizer`), linked with
    the runtime (`runtime_object`)."""
    cxx = compiler()
    if cxx is None:
        raise PrismError("no C++ compiler (g++ or clang++) for the CPU emulation; set CXX")
    if shutil.which(cxx) is None:  # "ccache g++", "g++ -fPIC": one program is run, with the emulation's own flags
        raise PrismError(f"CXX is '{cxx}', which is not a program that can be run: set it to the C++ compiler alone "
                         "(g++ or clang++, a name on PATH or a path; the emulation passes its own flags)")
    if sanitizer not in _FLAGS:
        raise PrismError(f"unknown sanitizer '{sanitizer}': one of {', '.join(SANITIZERS)}")
    write_build(kernels, workdir, header)
    (workdir / "harness.cpp").write_text(_harness(kernels, dtypes, shapes))
    exe = workdir / f"emulate-{sanitizer or 'plain'}"
    # -g1: line tables (what a sanitizer's report needs to name the generated .cu line), no variables' debug
    # information, which -g adds: the plain build of attention at the tests' dims took 2.1-2.4 s with -g and 2.0 s
    # with -g1, its ThreadSanitizer build 3.3 s and 2.3 s (g++, 2 cores)
    flags = ["-std=c++17", "-g1", *_FLAGS[sanitizer], *_NO_SHADOW_STACK]
    runtime = runtime_object(cxx, flags, workdir)
    extra = _INSTRUMENT["clang++" if "clang" in _compiler_identity(cxx)[1] else "g++"] if sanitizer == "banks" else []
    cmd = [cxx, *flags, *extra, "-x", "c++", "harness.cpp", "-x", "none", runtime.name, "-o", exe.name]
    done = files.run_in(cmd, workdir)
    if done.returncode != 0:
        raise PrismError("the generated kernels do not compile for the CPU emulation:\n" + _compiler_errors(done))
    return exe


def runtime_object(cxx: str, flags: Sequence[str], workdir: Path) -> Path:
    """prism_emu.cc compiled with `flags` (those of the kernels it is linked with: the sanitizers instrument the
    runtime's own copies of the kernels' data, cp.async's and TMA's, as they do the kernels' accesses), as
    `workdir`/prism_emu.o. Compiling it takes longer than a build's kernels (2.4 s against 0.9 s for fused
    attention, g++ -O1, 2 cores; 3.0 s under ThreadSanitizer, 4.6 s under AddressSanitizer), so the object is
    kept in the user cache: a record keyed by the runtime's two sources, the compiler and the flags names the
    object by its SHA-256, and the object is used only if its bytes have that digest. The object is stored
    before its record, under a name of its own, so processes that compile it at once never pair one's record
    with another's object. A cache that cannot keep it costs the compile, nothing else."""
    text = runtime_source(RUNTIME_DEFINITIONS)
    banks = "-DPRISM_BANKS" in flags  # prism_banks.cc, which includes prism_emu.cc
    unit = RUNTIME_BANKS if banks else RUNTIME_DEFINITIONS
    key = cache.digest("emulation runtime", runtime_source(), text, *([runtime_source(unit)] if banks else []),
                       *_compiler_identity(cxx), *flags)
    obj, folder = workdir / "prism_emu.o", cache.cache_dir() / "emulation"
    record = cache.read("emulation", key, valid=lambda v: isinstance(v, dict) and isinstance(v.get("sha256"), str)
                        and re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) is not None)
    if record is not None:
        stored = folder / _object_name(key, record["sha256"])
        with contextlib.suppress(OSError, ValueError):
            data = files.read_regular(stored, MAX_OBJECT_BYTES)
            if hashlib.sha256(data).hexdigest() == record["sha256"]:
                obj.write_bytes(data)
                return obj
        cache.warn(stored, "missing, or not the object its record names; compiling the emulation's runtime again")
    (workdir / RUNTIME_DEFINITIONS).write_text(text)
    if banks:
        (workdir / unit).write_text(runtime_source(unit))
    done = files.run_in([cxx, *flags, "-c", "-x", "c++", unit, "-o", obj.name], workdir)
    if done.returncode != 0:
        raise PrismError("the emulation's runtime does not compile:\n" + _compiler_errors(done))
    data = obj.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        files.write_atomic(str(folder / _object_name(key, digest)), lambda f: f.write(data))
    except (OSError, PrismError) as e:
        cache.unusable("write", str(e))
    else:
        cache.write("emulation", key, {"sha256": digest})
        _prune(folder)
    return obj


def _object_name(key: str, digest: str) -> str:
    return f"{key[:32]}-{digest[:16]}.o"


@functools.lru_cache(maxsize=None)
def _compiler_identity(cxx: str) -> tuple[str, str]:
    """The compiler's path and what `--version` says: an object another compiler made is not linked."""
    path = shutil.which(cxx) or cxx
    done = subprocess.run([path, "--version"], capture_output=True, text=True, errors="replace")
    return os.path.realpath(path), done.stdout


def _prune(folder: Path) -> None:
    """The newest RUNTIME_OBJECTS_KEPT objects kept; the rest removed, with their records where no kept object
    has the same key (`_object_name`)."""
    with contextlib.suppress(OSError):
        objects = sorted(folder.glob("*.o"), key=lambda p: p.stat().st_mtime, reverse=True)
        kept = {o.name[:32] for o in objects[:RUNTIME_OBJECTS_KEPT]}
        for old in objects[RUNTIME_OBJECTS_KEPT:]:
            old.unlink(missing_ok=True)
            if old.name[:32] not in kept:
                (folder / f"{old.name[:32]}.json").unlink(missing_ok=True)


def _compiler_errors(done: subprocess.CompletedProcess) -> str:
    """The compiler's errors, those in a kernel's .cu first (what a person who edited one needs to see)."""
    errors = sorted((line for line in done.stderr.splitlines() if ": error:" in line), key=lambda e: ".cu:" not in e)
    return "\n".join(errors[:10]) or done.stderr[-4000:] or f"(it exited {done.returncode}, saying nothing)"


# -- running --------------------------------------------------------------------------------------------------------


def run(kernels: Sequence[RenderedKernel], dtypes: Mapping[str, DType], shapes: Mapping[str, tuple[int, ...]],
        inputs: Mapping[str, np.ndarray], workdir: Path | None = None, *, sanitizer: str | None = None,
        blocks: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
        feed: Mapping[str, np.ndarray] | None = None, header: str | None = None,
        timeout: float = TIMEOUT) -> Result:
    """Every tensor the kernels write, from the given inputs (float64 arrays of the program's inputs).

    `blocks`: per kernel name, the blocks to emulate (all of the grid when a kernel is not named).
    `feed`: tensors some kernels write, given instead: loaded just before the first kernel that reads them
    (a kernel whose producer ran only some blocks reads the reference's values instead).
    Tensors a kernel writes start as NaN, so an element no block writes can never pass a check; those an f64 sum
    across blocks adds into start at zero (`RenderedKernel.zero`)."""
    blocks, feed = blocks or {}, feed or {}
    shapes = {**{n: np.shape(a) for n, a in inputs.items()}, **shapes}  # inputs' shapes from their arrays
    started = time.perf_counter()
    with files.temp_scratch("emulate") if workdir is None else contextlib.nullcontext(workdir) as workdir:
        exe = build(kernels, dtypes, shapes, workdir, sanitizer, header)
        names = _tensors(kernels)
        data = workdir / "data"
        data.mkdir(exist_ok=True)
        if missing := [a for a in names if a not in inputs and not any(a in _written_by(k) for k in kernels)]:
            raise PrismError(f"the kernels read {', '.join(missing)}, which nothing gives or writes")
        commands = []
        for name, arr in inputs.items():
            if name in names:
                to_storage(np.asarray(arr, dtype=np.float64), dtypes[name]).tofile(data / f"in-{name}")
                commands.append(f"load {names.index(name)} {data / f'in-{name}'}")
        fed: set[str] = set()
        for k in kernels:
            for name in k.args[: len(k.args) - k.stores]:
                if name in feed and name not in fed:
                    fed.add(name)
                    to_storage(np.asarray(feed[name], dtype=np.float64), dtypes[name]).tofile(data / f"feed-{name}")
                    commands.append(f"load {names.index(name)} {data / f'feed-{name}'}")
            for name in _written_by(k):
                commands.append(f"fill {names.index(name)} {'zero' if name in k.zero else 'nan'}")
            commands.append(f"wave {max(1, THREADS_PER_WAVE // int(np.prod(k.block)))}")
            chosen = blocks.get(k.name)
            where = "all" if chosen is None else " ".join([str(len(chosen))] + [f"{x} {y} {z}" for x, y, z in chosen])
            commands.append(f"launch {kernels.index(k)} {where}")
            for name in _written_by(k):
                commands.append(f"save {names.index(name)} {data / f'out-{name}'}")
        (workdir / "commands.txt").write_text("\n".join(commands) + "\n", errors="surrogateescape")  # (paths' bytes)
        finding, log = _execute(exe, workdir, kernels, timeout)
        counts = {k.name: (len(blocks[k.name]) if k.name in blocks else int(np.prod(k.grid)), int(np.prod(k.grid)))
                  for k in kernels}
        outputs = {} if finding else {
            name: from_storage(np.fromfile(data / f"out-{name}", dtype=STORAGE[dtypes[name].value]).reshape(shapes[name]),
                               dtypes[name])
            for k in kernels for name in _written_by(k)}
        return Result(outputs, finding, round(time.perf_counter() - started, 3), counts, log)


def _execute(exe: Path, workdir: Path, kernels: Sequence[RenderedKernel], timeout: float) -> tuple[Finding | None, str]:
    """What the emulation found (None: nothing), and what it printed on stdout."""
    env = {**os.environ, **_ENV, "PRISM_PARENT": str(os.getpid())}  # the emulation dies with this process
    try:
        done = subprocess.run([str(exe), "commands.txt"], cwd=workdir, capture_output=True, text=True,
                              errors="replace", timeout=timeout, env=env)
    except PermissionError as e:  # (a scratch directory on a file system mounted noexec)
        raise PrismError(f"cannot run the emulation's program {exe} ({files.describe(e)}): is its file system mounted "
                         "noexec? Set TMPDIR to a directory programs may run from") from None
    except subprocess.TimeoutExpired:
        return Finding("timeout", None, f"the emulation did not finish in {timeout:g} s"), ""
    if done.returncode == 0:
        return None, done.stdout
    if done.returncode == 2 and "prism-emulation: harness:" in done.stderr:
        raise PrismError("the emulation harness failed: " + done.stderr.strip().splitlines()[-1])
    return parse_finding(done.stderr, done.returncode, kernels), done.stdout


# -- what went wrong, from the child's stderr -----------------------------------------------------------------------

_CU_LINE = re.compile(r"([\w.-]+\.cu):(\d+)")
_THREAD_NAME = re.compile(r"Thread (T\d+) '([^']*)'")
_ACCESS = re.compile(r"^\s*(?:Previous )?((?:[Aa]tomic )?(?:[Rr]ead|[Ww]rite)) of size (\d+) at (0x[0-9a-f]+) by (thread T\d+|main thread)")


def _cu_lines(text: str) -> list[str]:
    """The generated-code lines in a stack or report text, innermost first, without repeats."""
    return list(dict.fromkeys(f"{m.group(1)}:{m.group(2)}" for m in _CU_LINE.finditer(text)))


def _kernel_of(text: str, kernels: Sequence[RenderedKernel]) -> str | None:
    by_file = {k.file: k.name for k in kernels}
    by_function = {k.function: k.name for k in kernels}
    for m in _CU_LINE.finditer(text):
        if m.group(1) in by_file:
            return by_file[m.group(1)]
    return next((name for fn, name in by_function.items() if re.search(rf"\b{fn}\b", text)), None)


def parse_finding(stderr: str, status: int, kernels: Sequence[RenderedKernel]) -> Finding:
    """A child's report, as a `Finding`."""
    if status == EXIT_FINDING and (m := re.search(r"^prism-emulation: kernel (.*?): (.*)$", stderr, re.M)):
        at = re.findall(r"^prism-emulation-at: (.*)$", stderr, re.M)
        kernel = next((k.name for k in kernels if k.name == m.group(1)), m.group(1))
        return Finding("emulation", kernel, m.group(2), tuple(dict.fromkeys(_short(a) for a in at)))
    running = re.findall(r"^prism-emulation-thread: kernel (.*?), (.*)$", stderr, re.M)
    if "ThreadSanitizer: data race" in stderr:
        return _race(stderr, kernels)
    if m := re.search(r"ERROR: AddressSanitizer: ([\w-]+)", stderr):
        access = re.search(r"^(READ|WRITE) of size (\d+)", stderr, re.M)
        region = re.search(r"^(0x[0-9a-f]+ is located .*)$", stderr, re.M)
        what = f"{access.group(1).lower()} of {access.group(2)} bytes" if access else "an access"
        text = f"{m.group(1)}: {what}" + (f"; {region.group(1)[region.group(1).index(' ') + 1:]}" if region else "")
        if region and "prism::emu::shared" in stderr[region.end():]:
            text += " (a shared-memory buffer)"
        return Finding("memory error", running[0][0] if running else _kernel_of(stderr, kernels), text,
                       tuple(_cu_lines(stderr[: region.start()] if region else stderr)[:3]),
                       tuple(t for _, t in running))
    if m := re.search(r"^(.*?):(\d+):\d+: runtime error: (.*)$", stderr, re.M):
        return Finding("undefined behaviour", running[0][0] if running else _kernel_of(stderr, kernels), m.group(3),
                       (f"{Path(m.group(1)).name}:{m.group(2)}",), tuple(t for _, t in running))
    tail = "\n".join(stderr.strip().splitlines()[-8:])
    how = f"signal {-status}" if status < 0 else f"exit status {status}"
    return Finding("crash", _kernel_of(stderr, kernels), f"the emulation stopped with {how}" + (f":\n{tail}" if tail else ""),
                   tuple(_cu_lines(stderr)[:3]))


def _race(stderr: str, kernels: Sequence[RenderedKernel]) -> Finding:
    names = dict(_THREAD_NAME.findall(stderr))
    accesses, threads, where = [], [], []
    chunks = [c for c in re.split(r"\n(?=[ \t]*(?:Previous )?(?:[Aa]tomic )?(?:[Rr]ead|[Ww]rite) of size)", stderr)
              if c.strip()]
    for chunk in chunks[1:3]:
        m = _ACCESS.search(chunk)
        if not m:
            continue
        tid = m.group(4).split()[-1]
        name = names.get(tid, m.group(4))
        lines = _cu_lines(chunk.split("\n\n")[0])
        accesses.append(f"{m.group(1).lower()} of {m.group(2)} bytes" + (f" at {lines[0]}" if lines else ""))
        threads.append(name.split(": ", 1)[-1])
        where += lines[:1]
    kernel = next((n.split(": ", 1)[0] for n in names.values() if ": block" in n), None) or _kernel_of(stderr, kernels)
    location = re.search(r"^\s*Location is heap block of size (\d+)", stderr, re.M)
    text = " races with ".join(accesses) or "two threads touch the same address, one writing, with no barrier between"
    if location:
        after = stderr[location.end():]
        owner = ("a shared-memory buffer" if "prism::emu::shared" in after.split("\n\n")[0]
                 else "a tensor in global memory")
        text += f" (in {owner} of {location.group(1)} bytes)"
    return Finding("data race", kernel, text, tuple(dict.fromkeys(where)), tuple(threads))


def _short(site: str) -> str:
    path, _, line = site.rpartition(":")
    return f"{Path(path).name}:{line}"


# -- blocks to emulate at large dims --------------------------------------------------------------------------------


def sample_blocks(c: Concrete, extra: int, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """The first and last block along every grid axis whose blocks write different elements, `extra` more at random,
    each with every block along the axes some store is summed over (`sums.summed_axes`: the last of them stores it)."""
    grid, summed = dict(c.grid), sorted({a for i in range(len(c.kernel.stores)) for a in summed_axes(c, i)})
    spread = [a for a in ("x", "y", "z") if grid.get(a, 1) > 1 and a not in summed]
    picks = {tuple(0 for _ in spread), tuple(grid[a] - 1 for a in spread)}
    for i, a in enumerate(spread):
        picks.add(tuple(grid[b] - 1 if b == a else 0 for b in spread))
        picks.add(tuple(grid[b] - 1 if j != i else 0 for j, b in enumerate(spread)))
    if extra >= np.prod([grid[a] for a in spread]):  # every block, not a loop of a count typed past them
        picks, extra = set(itertools.product(*(range(grid[a]) for a in spread))), 0
    for _ in range(extra):
        picks.add(tuple(int(rng.integers(grid[a])) for a in spread))
    out = []
    for pick in sorted(picks):
        for rest in itertools.product(*(range(grid[a]) for a in summed)):
            at = dict(zip(spread, pick)) | dict(zip(summed, rest))
            out.append((at.get("x", 0), at.get("y", 0), at.get("z", 0)))
    return out


def written(c: Concrete, blocks: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
    """Per store of `c`: which elements of its output the given blocks write (a boolean mask)."""
    grid, masks = dict(c.grid), []
    for i, store in enumerate(c.kernel.stores):
        mask = np.zeros(shape := c.output_shape(i), dtype=bool)
        for b in blocks:
            at = dict(zip(("x", "y", "z"), b))
            where = tuple(slice(at[dm.axis] * (size // grid[dm.axis]), (at[dm.axis] + 1) * (size // grid[dm.axis]))
                          if dm.axis else slice(None) for dm, size in zip(store.map.dims, shape))
            mask[where] = True
        masks.append(mask)
    return masks


# -- storage ----------------------------------------------------------------------------------------------------------


def to_storage(x: np.ndarray, dtype: DType) -> np.ndarray:
    """The bytes the kernels read, as the GPU runtime stores them: f16 as float16, bf16 as its 16-bit pattern
    (rounded to nearest even)."""
    return to_bf16_bits(x) if dtype is DType.BF16 else np.ascontiguousarray(x, dtype=STORAGE[dtype.value])


def from_storage(a: np.ndarray, dtype: DType) -> np.ndarray:
    return (from_bf16_bits(a) if dtype is DType.BF16 else a).astype(np.float64)
