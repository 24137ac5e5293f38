"""Runs a compiled program's CUDA kernels through PyCUDA and times them.

This is the last stage of the pipeline: the CUDA generator writes `.cu` files and a *plan* (a JSON-compatible
dict naming the program's tensors and the kernels to launch, in order); `Launcher` compiles those files with
nvcc, allocates every tensor, launches the kernels, hands the outputs back and times them as the GPU runs them
(`Ahead`). The module imports nothing from `prism_dsl`: it is also copied beside generated kernels as
`prism_runtime.py`, for users who run them without the compiler installed. PyCUDA and torch are imported only
inside the functions that need them, so everything but launching works without a GPU.

Inputs, decided once for every entry point:
- numpy arrays must already have the storage dtype (f16 -> float16, f32 -> float32, f64 -> float64); bf16
  tensors take float32 (numpy has no bfloat16), rounded to nearest even on the way in. Any other float dtype is
  a PlanError unless the launcher or `marshal` is given `cast=True`. Integer and bool arrays are always
  refused. Lists and scalars carry no dtype of their own and are converted as if cast=True.
- numpy inputs are copied to the device (any memory layout will do); outputs come back as numpy, bf16 as float32.
- where the compile rounded a dim up for its tiles, the caller passes and gets the plan's `used` shapes: inputs
  padded with zeros (a copy; none for one at the size built, zeros past the caller's part), outputs cut. An
  input the kernels read in place (`kernels.masking.read_in_place`) has the caller's shape as its plan shape.
- torch tensors on the CPU are treated as numpy arrays. torch CUDA tensors are passed by pointer, without a
  copy: they must be contiguous, 16-byte aligned, on the launcher's device and of the exact dtype (torch.bfloat16
  for bf16; with cast=True a wrong dtype is converted with one copy). Outputs are then torch CUDA tensors.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np

# Per plan dtype: the numpy dtype of its device storage (bf16 as raw bit patterns), and what a numpy caller
# passes without cast=True.
STORAGE = {k: np.dtype(v) for k, v in {"f16": "float16", "bf16": "uint16", "f32": "float32", "f64": "float64"}.items()}
HOST = {k: np.dtype(v) for k, v in {"f16": "float16", "bf16": "float32", "f32": "float32", "f64": "float64"}.items()}
TORCH_DTYPE = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}
ALIGNMENT = 16  # the generated kernels load 16 bytes at a time
DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
NVCC_OPTIONS = ["-O3", "-std=c++17"]
# Queued ahead of timed work, this kernel keeps the GPU busy while the host queues the work (see `Ahead`).
SPIN_CU = 'extern "C" __global__ void prism_spin(long long n) { for (long long t = clock64(); clock64() - t < n;) {} }'
SPIN_CYCLES = (1 << 16, 1 << 28)  # the first spin and the longest: 33 us and 134 ms at 2 GHz
EVENT_MS = 0.002  # a margin over the resolution of CUDA events' times (about half a microsecond)
host_seconds = time.perf_counter  # the host's clock (a stand-in in tests)


class PlanError(ValueError):
    """A malformed plan, or inputs that do not fit the program; the message says what was expected."""


class GpuUnavailable(RuntimeError):
    """A GPU operation was asked for and no CUDA GPU is usable; the message gives the reason."""


class KernelCompileError(RuntimeError):
    """nvcc rejected a kernel's source; `stderr` holds nvcc's own messages."""
    def __init__(self, kernel: str, path: Path, stderr: str):
        super().__init__(f"nvcc failed on kernel '{kernel}' ({path}):\n{stderr.strip()}")
        self.kernel, self.path, self.stderr = kernel, path, stderr


def device_target(capability: tuple[int, int]) -> dict[str, str]:
    """pycuda's `arch` and `code` for a device: the virtual and the real architecture named apart (nvcc's
    `-arch compute_90a -code sm_90a`), the feature set `a` on sm_90 for wgmma. The shorthand `-arch sm_90a`
    compiles the kernels alike, but pycuda also preprocesses each source with its options to key its cache,
    and there nvcc 13 preprocesses for plain sm_90 too, where a wgmma kernel's `#error` stops it."""
    sm = "%d%d%s" % (*capability, "a" if tuple(capability) == (9, 0) else "")
    return {"arch": f"compute_{sm}", "code": f"sm_{sm}"}


@functools.cache
def gpu_status() -> tuple[bool, str]:
    """(True, device name) when a CUDA GPU can be driven through pycuda, else (False, why not)."""
    if os.environ.get("PRISM_NO_GPU"):
        return False, "disabled by PRISM_NO_GPU"
    if importlib.util.find_spec("pycuda") is None:
        return False, "pycuda is not installed (pip install pycuda)"
    try:
        drv = _import_driver()
        return (True, drv.Device(0).name()) if drv.Device.count() else (False, "no CUDA device found")
    except ImportError as err:  # libcuda.so.1 missing: pycuda installed on a machine without a driver
        return False, f"the CUDA driver library cannot be loaded: {err}"
    except Exception as err:  # pycuda.driver.Error and friends: no device, driver too old, ...
        return False, f"CUDA driver error: {type(err).__name__}: {err}"


def device_identity() -> str:
    """What a measured time depends on besides the code: the GPU's name, compute capability and driver
    version (the tuning database's key). Only meaningful when `gpu_status` says a GPU is usable."""
    drv = _import_driver()
    major, minor = (dev := drv.Device(0)).compute_capability()
    return f"{dev.name()}, sm_{major}{minor}, driver {drv.get_driver_version()}"


def _import_driver():
    # pycuda blames a header/driver mismatch for any failed symbol lookup; the ImportError that follows says why.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pycuda.driver as drv
    drv.init()  # every caller needs it; once done, cuInit again is cheap
    return drv


@functools.cache
def _primary(drv, device: int):
    """The device's primary context, retained once for the process and never released: releasing the last
    reference resets it while pycuda leaves it current, where PyTorch or CuPy would then find it destroyed."""
    return drv.Device(device).retain_primary_context()


# ---------------------------------------------------------------------------------------------------- plans
def _beside(name: str):
    """The module `name`.py beside this file (in the package, and beside generated kernels, where the compiler
    copies both), loaded by its path: standalone modules, whatever package holds them."""
    spec = importlib.util.spec_from_file_location(f"prism_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_plan = _beside("cuda_plan")  # what a well-formed plan holds; the tensor maps of TMA copies


def validate_plan(plan) -> None:
    """Raise one PlanError listing every problem of a malformed plan (`cuda_plan.problems`)."""
    if (text := _plan.problems(plan)) is not None:
        raise PlanError(text)


def random_inputs(plan: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal inputs in the dtypes a numpy caller passes without cast=True."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(_plan.used(plan["tensors"][name])).astype(HOST[plan["tensors"][name]["dtype"]])
            for name in plan["inputs"]}


def _shape(plan: dict, name: str) -> tuple[int, ...]:
    return tuple(plan["tensors"][name]["shape"])


def _first(plan: dict, name: str) -> tuple[slice, ...]:  # the caller's rows of the kernels' tensor (`cuda_plan.used`)
    return tuple(slice(0, n) for n in _plan.used(plan["tensors"][name]))


def _nbytes(plan: dict, name: str) -> int:
    return int(np.prod(_shape(plan, name))) * STORAGE[plan["tensors"][name]["dtype"]].itemsize


# ---------------------------------------------------------------------------------------------- host data
to_bf16_bits, from_bf16_bits = _plan.to_bf16_bits, _plan.from_bf16_bits  # (kept in cuda_plan, with the ranges)


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _check_names(plan: dict, given) -> None:
    expected = plan["inputs"]
    folded = {n.lower(): n for n in expected}  # so that 'w' suggests 'W'
    problems = [f"missing input '{n}'" for n in expected if n not in given]
    for name in (n for n in given if n not in expected):
        close = [folded[c] for c in difflib.get_close_matches(name.lower(), list(folded), n=1)]
        problems.append(f"unknown input '{name}'" + (f" (did you mean '{close[0]}'?)" if close else "")
                        + f"; '{plan['program']}' takes {', '.join(expected)}")
    if problems:
        raise PlanError("\n".join(problems))


def _check_shape(plan: dict, name: str, shape) -> bool:  # whether to pad it (`cuda_plan.padded`)
    return _plan.padded(plan["tensors"][name], name, shape, PlanError)


def marshal(plan: dict, inputs: dict, cast: bool = False) -> dict[str, np.ndarray]:
    """Check host inputs against the plan and convert them to their device storage form (see the module doc)."""
    _check_names(plan, inputs)
    return {name: _host_input(plan, name, inputs[name], cast) for name in plan["inputs"]}


def _host_input(plan: dict, name: str, value, cast: bool) -> np.ndarray:
    dtype = plan["tensors"][name]["dtype"]
    if _is_torch(value):  # on the CPU: as numpy (bf16 widened to float32, exactly)
        value = value.detach().cpu()
        value = (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()
    elif not isinstance(value, np.ndarray):
        try:
            value, cast = np.asarray(value, dtype=np.float64), True
        except (TypeError, ValueError):
            raise PlanError(f"input '{name}' is a {type(value).__name__}, not an array of numbers") from None
    pad = _check_shape(plan, name, value.shape)
    if value.dtype.kind != "f" and value.dtype.name != "bfloat16":
        raise PlanError(f"input '{name}' is {value.dtype}; the program expects real floating-point data ({dtype})")
    if value.dtype.name == "bfloat16" and dtype == "bf16":  # an ml_dtypes array already holds the bits
        value = np.ascontiguousarray(value).view(np.uint16)
    elif value.dtype != HOST[dtype] and not cast:
        wanted = "float32 (rounded to bf16 on the way in)" if dtype == "bf16" else str(HOST[dtype])
        raise PlanError(f"input '{name}' is {value.dtype}; the program stores it as {dtype}: "
                        f"pass {wanted}, or any float array with cast=True (a launcher's get_launcher(cast=True))")
    else:
        with np.errstate(over="ignore"):  # said below, in words
            stored = to_bf16_bits(value) if dtype == "bf16" else np.ascontiguousarray(value, dtype=STORAGE[dtype])
        if lost := _plan.past_range(name, dtype, value, stored):  # cast=True rounds; it does not make infinities
            raise PlanError(lost)
        value = stored
    if not pad:
        return value
    full = np.zeros(_shape(plan, name), value.dtype)  # dims rounded up for tiles: zeros past the caller's rows
    full[_first(plan, name)] = value
    return full


def _torch_input(plan: dict, name: str, t, device: int, cast: bool):
    import torch

    dtype = plan["tensors"][name]["dtype"]
    want = getattr(torch, TORCH_DTYPE[dtype])
    pad = _check_shape(plan, name, t.shape)
    if t.device.index != device:
        raise PlanError(f"input '{name}' is on {t.device}; the launcher runs on cuda:{device}")
    if t.dtype != want:
        if not cast or not t.is_floating_point():
            raise PlanError(f"input '{name}' is {t.dtype}; the program stores it as {dtype}: pass {want}, "
                            "or any float tensor with cast=True (a launcher's get_launcher(cast=True); one copy)")
        t, given = t.to(want), t
        if bool((t.isinf() & given.isfinite()).any()):
            raise PlanError(_plan.past_range(name, dtype, given.cpu().double().numpy(), t.cpu().double().numpy()))
    if pad:  # dims rounded up for tiles: the caller's part, zeros past it (torch's constant pad: one copy)
        ends = [x for n, m in zip(reversed(t.shape), reversed(_shape(plan, name))) for x in (0, m - n)]
        return torch.nn.functional.pad(t, ends)
    if not t.is_contiguous():
        raise PlanError(f"tensor '{name}' is not contiguous; pass {name}.contiguous()")
    if t.data_ptr() % ALIGNMENT:
        raise PlanError(f"tensor '{name}' is not {ALIGNMENT}-byte aligned (it is a view at an odd offset); "
                        f"pass {name}.clone()")
    return t


# ------------------------------------------------------------------------------------------------- launching
class Launcher:
    """Compiles a plan's kernels once and runs the whole program on the GPU.

    `directory` holds each kernel's `.cu` file and the headers it includes. `cast=True` lets inputs of another
    float dtype be converted (see the module doc). Nothing touches the GPU until the first compile or call."""

    def __init__(self, plan: dict, directory, *, cast: bool = False, device: int = 0):
        validate_plan(plan)
        # Absolute, because nvcc runs in a temporary directory and finds the headers through this path.
        self.plan, self.directory, self.cast, self.device = plan, Path(directory).resolve(), cast, device
        self._functions, self._modules = None, []  # compiled on first use
        self._buffers: dict = {}  # name -> DeviceAllocation, reused by every numpy-fed call
        self._tickets: dict = {}  # kernel name -> its tiles' counters and sums (plan's "tickets", "sums"): `compile`
        self._maps: dict = {}  # (kernel name, tensor pointers) -> its tensor maps' bytes (plan's "maps")

    @contextlib.contextmanager
    def _active(self):
        """The device's primary context made current, so PyTorch or CuPy in the same process share it."""
        ok, reason = gpu_status()
        if not ok:
            raise GpuUnavailable(f"cannot run '{self.plan['program']}' without a usable CUDA GPU: {reason}")
        _primary(drv := _import_driver(), self.device).push()
        try:
            yield drv
        finally:
            drv.Context.pop()

    def compile(self) -> None:
        """Compile every kernel with nvcc for the current device (done by the first call if not before)."""
        if self._functions is not None:
            return
        with self._active() as drv:
            from pycuda.compiler import SourceModule, compile as nvcc

            dev = drv.Device(self.device)
            target = device_target(dev.compute_capability())
            optin = dev.get_attribute(drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            cubins: dict[Path, bytes] = {}
            modules: dict[Path, object] = {}
            functions = []
            for kernel in self.plan["kernels"]:
                path = self.directory / kernel["file"]
                if path not in modules:
                    cubins[path] = self._compile_file(nvcc, drv, kernel["name"], path, target)
                    modules[path] = drv.module_from_buffer(cubins[path])
                functions.append(self._function(drv, modules[path], cubins[path], kernel, optin))
            spin = SourceModule(SPIN_CU, no_extern_c=True, options=NVCC_OPTIONS, **target)
            self._modules, self._functions = [*modules.values(), spin], functions
            self._spin = spin.get_function("prism_spin")
            self._spin.prepare("q")

    def _compile_file(self, nvcc, drv, kernel: str, path: Path, target: dict) -> bytes:  # pycuda's compile: a cubin
        try:
            source = path.read_text()
        except OSError as err:
            raise PlanError(f"kernel '{kernel}': cannot read {path}: {err.strerror}") from None
        try:
            return nvcc(source, no_extern_c=True, options=NVCC_OPTIONS, include_dirs=[str(path.parent)], **target)
        except drv.CompileError as err:
            raise KernelCompileError(kernel, path, err.stderr or str(err)) from None

    def _function(self, drv, module, cubin: bytes, kernel: dict, optin: int):
        try:
            fn = module.get_function(kernel["function"])
        except drv.LogicError:
            raise PlanError(f"kernel '{kernel['name']}': {kernel['file']} defines no extern \"C\" __global__ "
                            f"function '{kernel['function']}'") from None
        smem = kernel.get("smem", 0)
        if smem > optin:
            raise PlanError(f"kernel '{kernel['name']}' needs {smem} bytes of shared memory; this device "
                            f"allows {optin} per block")
        if smem > DEFAULT_SMEM_LIMIT:
            fn.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        # a counter per tile whose pieces it combines or sums, and the sums' f32 workspaces (`sums`): zero between
        # launches (the tile's last block puts them back), so zeroed once
        self._tickets[kernel["name"]] = []
        for words in (kernel.get("tickets", 0), kernel.get("sums", 0)):
            if words:
                self._tickets[kernel["name"]].append(drv.mem_alloc(4 * words))
                drv.memset_d32(self._tickets[kernel["name"]][-1], 0, words)
        form, problem = _plan.kernel_arguments(cubin, kernel)  # each parameter where the compiled code reads it
        if problem:
            raise PlanError(problem)
        fn.prepare(form)
        return fn

    def __call__(self, /, **inputs) -> dict:  # an input may be named `self`
        """Run the program once; numpy in -> numpy out, torch CUDA tensors in -> torch CUDA tensors out."""
        torch_mode, data = self._bind_inputs(inputs)
        self.compile()
        with self._active() as drv:
            if torch_mode:
                import torch

                data |= {name: torch.empty(_shape(self.plan, name), device=f"cuda:{self.device}",
                                           dtype=getattr(torch, TORCH_DTYPE[self.plan["tensors"][name]["dtype"]]))
                         for name in self.plan["outputs"]}
            ptrs = self._pointers(drv, torch_mode, data, self._buffers)
            # 0xFF bytes are a NaN in every float format, so an element no kernel wrote can never pass `check`.
            for name in self.plan["tensors"]:
                if name not in self.plan["inputs"]:
                    drv.memset_d8(ptrs[name], 0xFF, _nbytes(self.plan, name))
            self._launch(drv, ptrs)
            if torch_mode:
                drv.Context.synchronize()  # so torch work on any stream sees finished outputs
                return {name: data[name][_first(self.plan, name)].contiguous() for name in self.plan["outputs"]}
            return {name: np.ascontiguousarray(self._download(drv, name, ptrs[name])[_first(self.plan, name)])
                    for name in self.plan["outputs"]}

    def _bind_inputs(self, inputs: dict):
        """(True, checked torch CUDA tensors) or (False, marshalled numpy arrays); mixing the two is refused."""
        on_gpu = {n for n, v in inputs.items() if _is_torch(v) and getattr(v, "is_cuda", False)}
        if not on_gpu:
            return False, marshal(self.plan, inputs, self.cast)
        if len(on_gpu) < len(inputs):
            raise PlanError(f"inputs {', '.join(sorted(on_gpu))} are torch CUDA tensors but "
                            f"{', '.join(sorted(set(inputs) - on_gpu))} are not; pass all of them one way")
        _check_names(self.plan, inputs)
        tensors = {n: _torch_input(self.plan, n, inputs[n], self.device, self.cast) for n in self.plan["inputs"]}
        import torch

        torch.cuda.synchronize(self.device)  # we launch on the default stream: pending torch work comes first
        return True, tensors

    def _pointers(self, drv, torch_mode: bool, data: dict, input_buffers: dict) -> dict[str, int]:
        """A device pointer for every tensor. torch tensors in `data` are used in place; numpy arrays are copied
        into `input_buffers`; every other tensor lives in the launcher's own buffers, allocated on first use."""
        ptrs = {}
        for name in self.plan["tensors"]:
            if torch_mode and name in data:
                ptrs[name] = data[name].data_ptr()
                continue
            buffers = input_buffers if name in data else self._buffers
            if name not in buffers:
                buffers[name] = drv.mem_alloc(_nbytes(self.plan, name))
            ptrs[name] = int(buffers[name])
            if name in data:
                drv.memcpy_htod(buffers[name], data[name])
        return ptrs

    def _download(self, drv, name: str, ptr: int) -> np.ndarray:
        dtype = self.plan["tensors"][name]["dtype"]
        host = np.empty(_shape(self.plan, name), STORAGE[dtype])
        drv.memcpy_dtoh(host, ptr)
        return from_bf16_bits(host) if dtype == "bf16" else host

    def _launch(self, drv, ptrs: dict[str, int], events: list | None = None, first=True, last=True) -> None:
        """Launch every kernel in order, zeroing its `zero` tensors first. events[i] (where not None) is recorded
        before kernel i's zeroing (kernel 0's if `first`), events[-1] after the last kernel (if `last`)."""
        for i, (kernel, fn) in enumerate(zip(self.plan["kernels"], self._functions)):
            if events is not None and events[i] is not None and (first or i):
                events[i].record()
            for name in kernel.get("zero", []):
                drv.memset_d8_async(ptrs[name], 0, _nbytes(self.plan, name))
            tickets = tuple(int(buf) for buf in self._tickets[kernel["name"]])
            fn.prepared_call(tuple(kernel["grid"]), tuple(kernel["block"]), *self._maps_of(kernel, ptrs),
                             *(ptrs[n] for n in kernel["args"]), *tickets, shared_size=kernel.get("smem", 0))
        if events is not None and last:
            events[-1].record()

    def _maps_of(self, kernel: dict, ptrs: dict[str, int]) -> tuple[bytes, ...]:
        """The kernel's tensor maps (its first parameters) for the tensors at these addresses, encoded once each."""
        if not kernel.get("maps"):
            return ()
        key = (kernel["name"], *(ptrs[m["tensor"]] for m in kernel["maps"]))
        if key not in self._maps:
            spec, self._maps = self.plan["tensors"], self._maps if len(self._maps) < 64 else {}  # torch tensors come and go
            try:
                self._maps[key] = tuple(_plan.encode_map(ptrs[m["tensor"]], spec[m["tensor"]]["dtype"],
                                                         spec[m["tensor"]]["shape"], m["box"]) for m in kernel["maps"])
            except RuntimeError as err:
                raise PlanError(f"kernel '{kernel['name']}': {err}") from None
        return self._maps[key]

    def time(self, input_sets: list[dict], warmup: int = 10, repeat: int = 100, batch: int = 1) -> dict:
        """Milliseconds of the whole launch sequence on the GPU, rotating input sets: two events around one
        sequence, or around `batch` sequences queued back to back (as a model's forward pass queues them) over
        `batch`. The host's time to queue them is not counted (`Ahead`); `host_bound` says where it had to be."""
        samples, behind = self._timed(input_sets, warmup, repeat, per_kernel=False, batch=batch)
        return _stats([s[0] for s in samples], behind)

    def time_kernels(self, input_sets: list[dict], warmup: int = 10, repeat: int = 100) -> dict[str, dict]:
        """Per kernel name, milliseconds between events around that kernel (with the zeroing it needs)."""
        samples, behind = self._timed(input_sets, warmup, repeat, per_kernel=True)
        return {k["name"]: _stats([s[i] for s in samples], behind) for i, k in enumerate(self.plan["kernels"])}

    def _timed(self, input_sets: list[dict], warmup: int, repeat: int, per_kernel: bool, batch: int = 1):
        if not input_sets or repeat < 1 or warmup < 0 or batch < 1:
            raise PlanError(f"timing needs at least one input set, repeat >= 1, warmup >= 0 and batch >= 1; got "
                            f"{len(input_sets)} sets, repeat={repeat}, warmup={warmup}, batch={batch}")
        bound = [self._bind_inputs(inputs) for inputs in input_sets]
        self.compile()
        with self._active() as drv, contextlib.ExitStack() as cleanup:
            # Each set keeps its own input buffers so that rotating through them defeats the L2 cache.
            own = [{} for _ in bound]
            cleanup.callback(lambda: [buf.free() for buffers in own for buf in buffers.values()])
            sets = [self._pointers(drv, mode, data, buffers) for (mode, data), buffers in zip(bound, own)]
            n = len(self.plan["kernels"])
            events = [drv.Event() if per_kernel or i in (0, n) else None for i in range(n + 1)]
            lead, ahead, samples = drv.Event(), Ahead(), []
            self._spin.prepared_call((1, 1, 1), (1, 1, 1), 0)  # loaded now, not in the first sample
            for i in range(warmup):
                self._launch(drv, sets[i % len(sets)])
            def queue(cycles: int, i: int) -> None:
                lead.record()
                self._spin.prepared_call((1, 1, 1), (1, 1, 1), cycles)
                for j in range(batch):  # the first sequence records the first event, the last one the last
                    self._launch(drv, sets[(i * batch + j) % len(sets)], events, first=j == 0, last=j == batch - 1)

            def lead_ms() -> float:
                events[-1].synchronize()
                return lead.time_till(events[0])

            for i in range(repeat):
                ahead.sample(functools.partial(queue, i=i), lead_ms)
                samples.append([events[j].time_till(events[j + 1]) for j in range(n)] if per_kernel
                               else [events[0].time_till(events[-1]) / batch])
            return samples, ahead.behind

    def close(self) -> None:
        """Free the device memory this launcher holds (the primary context stays retained: `_primary`)."""
        if held := [*self._buffers.values(), *(buf for bufs in self._tickets.values() for buf in bufs)]:
            with self._active():
                for buf in held:
                    buf.free()
        self._buffers, self._tickets, self._maps, self._modules, self._functions = {}, {}, {}, [], None


class Ahead:
    """Times GPU work as the GPU runs it, without the host's time to queue it (on Linux, where a queued call has
    reached the GPU when it returns). `sample(queue, lead_ms)` calls `queue(cycles)`, which records a lead event,
    queues `prism_spin` for `cycles` clocks, then the work between its own events; `lead_ms()` waits for the work
    and gives the milliseconds from the lead event to the work's first event. Where the host took less than that
    to queue it all, the GPU (which reached the lead event no sooner than the host recorded it) found all of the
    work queued: the sample stands. Otherwise the spin doubles and the sample is taken again, up to
    SPIN_CYCLES[1], where it stands with `behind` set: its time includes the host's."""

    def __init__(self):
        self.cycles, self.behind = SPIN_CYCLES[0], False

    def sample(self, queue, lead_ms) -> None:
        while True:
            start = host_seconds()
            queue(self.cycles)
            ahead = (host_seconds() - start) * 1e3 + EVENT_MS < lead_ms()  # lead_ms waits for the work
            if ahead or self.cycles >= SPIN_CYCLES[1]:
                self.behind |= not ahead
                return
            self.cycles *= 2


def _stats(times_ms: list[float], host_bound: bool) -> dict:
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "mean_ms": statistics.fmean(times_ms),
            "repeat": len(times_ms), "host_bound": host_bound}
