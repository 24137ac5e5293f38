"""`prismc verify DIR`: a compiled output directory checked again as it is on disk.

At the dims it was compiled for, the kernels are the `.cu` files in DIR and the header is DIR's prism.cuh,
as a person may have edited them: they are built in the thread-faithful emulation (`backend.emulate`), run
on random inputs, and every output element is compared with the float64 reference of the program in DIR
(`PROGRAM.prism`, the program as compiled; its custom kernels run in the block interpreter). With `--dims`
(or `--grid`/`--loop`), the `.cu` files cannot be used (every size is a constant in them): the kernels are
generated again from the program in DIR at those sizes, and the summary says so. `--sanitize thread` or
`--sanitize address` runs the sanitizer build. `--banks` then counts each kernel's shared-memory wavefronts in the
emulation (`backend.banks`: bank conflicts, and where they are), over the first and last block along every grid
axis unless `--emulate-blocks` says otherwise. The report's launches and code generator's options, the launcher
and runtime files, and the search's `best.prism` must be what prismc writes for the program in DIR. Exit 0 when
everything agrees, 1 otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from ..backend import emulate as emulator
from ..backend.codegen import HEADER, CodegenConfig
from ..backend.cost import for_hardware
from ..backend import cuda_plan
from ..base import files
from ..base.errors import PrismError
from ..kernels.hardware import load_hardware
from ..kernels.kernel import free_symbols, kernels_of
from ..kernels.lower import lowered_for
from ..kernels.masking import refusal
from ..lang.check import load
from ..lang.printer import print_program
from ..pipeline import emulation
from ..pipeline import padding
from ..pipeline.build import (BuildOptions, build, callers_part, check_inputs, dims_of, padded_inputs,
                              plan_of, price, reference_outputs, tolerance_of, tune)
from ..pipeline.report import EmulationCheck, overflowed, widened
from ..semantics.reference import bind_dims, check_sizes, require_floats
from .values import ARCH, whole_warps

def _well_formed(report) -> list[str]:
    """What of a report.json verify needs is missing or malformed (names of keys)."""
    if not isinstance(report, dict):
        return ["the whole file"]
    def positive(d):
        return isinstance(d, dict) and all(isinstance(k, str) and type(v) is int and v >= 1 for k, v in d.items())
    def launch(k):  # a block of three positive sizes, and bytes of shared memory
        return (isinstance(k, dict) and isinstance(k.get("file"), str) and isinstance(k.get("block"), list)
                and len(k["block"]) == 3 and all(type(b) is int and b >= 1 for b in k["block"])
                and type(k.get("smem_bytes")) is int and k["smem_bytes"] >= 0)
    kernels = report.get("kernels")
    checks = {
        "program": isinstance(report.get("program"), str),
        "hardware": isinstance(report.get("hardware"), dict) and isinstance(report["hardware"].get("name"), str),
        "dims": positive(report.get("dims")),
        "parameters": positive(report.get("parameters")),
        "codegen": isinstance(report.get("codegen"), dict),
        "kernels": isinstance(kernels, list) and all(launch(k) for k in kernels),
        "padded": report.get("padded") is None or positive(report["padded"]),
        "files": report.get("files") is None or isinstance(report["files"], list) and all(
            isinstance(f, str) for f in report["files"]),
    }
    return [key for key, ok in checks.items() if not ok]


def read_report(directory: Path) -> dict:
    shown = str(directory)
    if not directory.is_dir():
        raise PrismError(f"'{shown}' is not a directory (verify takes the directory `prismc compile -o` wrote)")
    path = directory / "report.json"
    try:
        report = json.loads(files.read_regular(path, files.MAX_TEXT_BYTES))
    except FileNotFoundError:
        raise PrismError(f"'{shown}' has no report.json: it is not an output directory of prismc compile") from None
    except OSError as e:
        raise PrismError(f"cannot read '{path}': {files.describe(e)}") from None
    except (ValueError, RecursionError) as e:
        raise PrismError(f"'{path}' is not valid JSON: {e}") from None
    bad = _well_formed(report)
    if bad:
        raise PrismError(f"'{path}' is not a report of prismc compile (missing or malformed: {', '.join(bad)})")
    for name in report.get("files") or []:  # what prismc wrote, each in the directory
        if Path(name).name != name:
            raise PrismError(f"'{path}' lists '{name}' among the files prismc wrote, which is not a name in the "
                             "directory: it was changed after it was compiled")
        if not (directory / name).is_file():
            raise PrismError(f"'{directory / name}' is missing: report.json lists it among the files prismc wrote")
    return report


def _text(path: Path) -> str:
    try:
        return files.read_regular(path, files.MAX_TEXT_BYTES).decode()
    except FileNotFoundError:
        raise PrismError(f"'{path}' is missing: the report lists it") from None
    except OSError as e:
        raise PrismError(f"cannot read '{path}': {files.describe(e)}") from None
    except UnicodeDecodeError:
        raise PrismError(f"'{path}' is not text") from None


def verify(args) -> int:
    directory = Path(args.directory)
    built, header, on_disk, source, edited = from_directory(directory, args.dims, args.grid, args.loop)
    check_sizes(built.source, built.binding)  # the float64 reference must fit in memory
    inputs = _given(args.inputs, built) if args.inputs else check_inputs(built, args.seed)
    try:
        check = emulation.check(built, plan_of(built), inputs, reference_outputs(built, inputs), seed=args.seed,
                                rtol=tolerance_of(built, inputs), checked_against=f"program in {source}",
                                sanitizer=args.sanitize, extra=args.blocks, header=header, callers=callers_part(built))
    except PrismError as e:  # (a .cu cut short fails in the harness that includes it: the file named first)
        if not edited:
            raise
        raise PrismError("".join(f"{directory / f}: edited since it was compiled ({where})\n"
                                 for f, where in edited.items()) + str(e)) from None
    print(_summary(check, directory, built, on_disk, args.inputs, "kernel parameters" if args.grid or args.loop
                   else "sizes", edited))
    if args.banks and check.passed:
        counted = emulation.wavefronts(built, plan_of(built), inputs, seed=args.seed, header=header,
                                       extra=0 if args.blocks == "auto" else args.blocks)
        print(_banks(counted, priced_with(built, directory, on_disk, counted)))
    return 0 if check.passed else 1


def _given(path: str, built) -> dict:
    """The inputs of an .npz archive (rounded to their types, as `run --inputs` takes them), each of the shape the
    caller gives at the dims verified (checked from its header before any data is read), as the kernels take it.
    Built past the sizes given, each input as the launcher takes it: at the caller's shape, or at the size built
    (zeros past the caller's part, which the kernels count on: zeroed here) where the launcher pads it, not where the
    kernels read it in place (the launcher refuses that shape then)."""
    from .npz import read_npz

    if not built.padded:
        return read_npz(path, built.source, lambda headers: bind_dims(built.source, dims_of(built), headers))
    plan, part = plan_of(built)["tensors"], callers_part(built)

    def vet(headers):  # each shape as the launcher takes it (`cuda_plan.padded`), or its message
        for name, a in headers.items():
            try:
                require_floats(name, a)  # as where nothing is padded (`reference.check_input`)
            except PrismError as e:
                raise PrismError(f"{path}: {e}") from None
            try:
                cuda_plan.padded(plan[name], name, a.shape, PrismError)
            except PrismError as e:
                raise PrismError(f"{path}: {e}") from None
    arrays = read_npz(path, built.source, vet)
    return padded_inputs(built, {name: a[part.get(name, ())] for name, a in arrays.items()})


def priced_with(built, directory: Path, on_disk: bool, counted: dict):
    """`built` priced again with the wavefronts `counted`, and with the compile check's figures report.json holds
    for the kernels on disk (ptxas's registers, the SASS's instructions), as `prismc compile --banks` prices them."""
    report = read_report(directory)
    figures = {k.get("name"): k.get("nvcc") for k in report["kernels"]} if on_disk else {}
    figures = {name: per for name, per in figures.items() if isinstance(per, dict)}
    return price(built, figures, codegen_of(report), counted)


def _banks(counted: dict, built) -> str:
    """The kernels' shared-memory wavefronts (`backend.banks`) and their worst places, in words, and what the cost
    model makes of them (`cost.estimate`: one wavefront a clock per SM, a floor beside the others)."""
    lines = ["  shared memory, counted in the emulation (wavefronts: 128 bytes a clock per SM):"]
    estimates = {e.kernel: e for e in built.estimates}
    for k in built.kernels:
        w = counted.get(k.name)
        if w is None:
            continue
        e = estimates[k.name]
        lines.append(f"    {k.name}: {w.per_block:,.0f} wavefronts a block ({w.blocks} emulated), "
                     f"{w.over_ideal:.2f}x conflict-free; {e.shared_us} us of the busy SMs' shared memory, against "
                     f"an estimate of {e.time_us} us ({e.bound}, priced from {e.priced})")
        lines += [f"      {p.where}: {p.wavefronts / p.ideal:.1f}x, {p.wavefronts:,} wavefronts where "
                  f"{p.ideal:,} would do" for p in w.conflicted[:3]]
    return "\n".join(lines)


def from_directory(directory: Path, dims: dict | None = None, grid: dict | None = None, loop: dict | None = None):
    """The build of the program an output directory holds: (build, its prism.cuh or None, whether the kernels
    are the .cu files on disk, the program's file, the .cu files edited since they were compiled: each with the
    first line where it differs from what prismc generates at the report's parameters and options). At other
    `dims` (or with `grid`/`loop`) the kernels are generated again from its program."""
    dims, grid, loop = dims or {}, grid or {}, loop or {}
    report = read_report(directory)
    name = report["program"]
    source = directory / f"{name}.prism"
    program = load(source).program(name)
    _same_as_best(directory, report, program)
    try:
        hardware = load_hardware(report["hardware"]["name"])
    except PrismError as e:
        raise PrismError(f"'{directory}/report.json': {e}") from None
    codegen = codegen_of(report)
    ours = for_hardware(codegen, hardware)  # what a compile for that hardware sets
    if wrong := [f"{f}={getattr(codegen, f)!r} (the {hardware.name}'s: {getattr(ours, f)!r})" for f in vars(codegen)
                 if getattr(codegen, f) != getattr(ours, f)]:
        raise PrismError(f"the codegen options in '{directory}/report.json' are not those of its hardware: "
                         f"{', '.join(wrong)}: the directory was changed after it was compiled")
    compiled_dims = report["dims"]
    padded = report.get("padded") or {}  # dims the compile rounded up for its tiles: the sizes given
    given = {**compiled_dims, **padded} if isinstance(padded, dict) else compiled_dims  # the caller's sizes
    on_disk = (not dims or {**compiled_dims, **dims} in (compiled_dims, given)) and not grid and not loop
    dims = {} if on_disk else dims  # the sizes given by the caller name the build on disk too
    names = ({s.name for s in free_symbols(program)}, {d.symbol.name for d in program.dims})
    if unknown := sorted(set(report["parameters"]) - names[0]) + sorted(set(compiled_dims) - names[1]):
        raise PrismError(f"'{directory}/report.json' names what its program does not have ({', '.join(unknown)}): "
                         "the directory was changed after it was compiled")
    if missing := sorted(names[0] - set(report["parameters"])):
        raise PrismError(f"'{directory}/report.json' does not give its program's kernel parameters "
                         f"{', '.join(missing)}: the directory was changed after it was compiled")
    options = BuildOptions(dims={**compiled_dims, **dims}, grid=grid, loop=loop,
                           params=report["parameters"] if on_disk else {}, archs=(), codegen=codegen,
                           padded=padded if on_disk and isinstance(padded, dict) else {})
    if not on_disk and not grid and not loop:
        options = _rounded_as_compile_rounds(program, hardware, options)
    built = build(program, hardware, options)
    header, edited = None, {}
    if on_disk:
        built, header, edited = _as_on_disk(built, directory, report, hardware)
    return built, header, on_disk, source, edited


def _same_as_best(directory: Path, report: dict, program) -> None:
    """The search's choice, which the report names (`best.prism`, for `prismc prove`), must be the program in
    `directory` once lowered at the report's parameters: an edit to either is refused, as is its absence."""
    best = report.get("best")
    if best is None:
        return
    path = directory / str(best)
    if not isinstance(best, str) or Path(best).name != best or best not in (report.get("files") or [best]):
        raise PrismError(f"'{directory}/report.json' names a best program that is not a file of the directory: {best!r}")
    _text(path)  # missing, unreadable or not text: said as for every file the report lists
    chosen = load(path).program()
    try:
        lowered = print_program(lowered_for(chosen, report["parameters"]), with_dims=False)
    except PrismError as e:
        lowered = str(e)
    if lowered != print_program(program, with_dims=False):
        raise PrismError(f"'{path}' is not the program in '{directory}' ({program.name}.prism) lowered at the "
                         "report's parameters: one of them was changed after it was compiled")


def _rounded_as_compile_rounds(program, hardware, options: BuildOptions) -> BuildOptions:
    """At sizes no tile divides, the sizes `prismc compile` would build the program for (`pipeline.padding`): each
    rounded size of `padding.candidates` the program is tuned at, kept where the model, with the copies that pad the
    inputs, is faster by padding.MARGIN (as compile does, without a search). Built at a prime size as given, every
    tile would be one row, and the reference's block interpreter would run for hours."""
    binding = bind_dims(program, dict(options.dims))
    given = {d.name: int(binding[d.symbol]) for d in program.dims}
    tries = padding.candidates(program, given)
    if not tries:
        return options

    def sized(rounded: dict[str, int]) -> BuildOptions:
        return replace(options, dims={**options.dims, **rounded}, padded={name: given[name] for name in rounded})

    def estimate(rounded: dict[str, int], masking: dict[str, int]) -> tuple[float, None]:
        if why := refusal(program, masking, {**given, **rounded}):
            raise PrismError(why)
        at = sized(rounded)
        return sum(e.time_us for e in tune(lowered_for(program, {}), program, hardware, at).estimates), None
    try:
        at_given = estimate({}, {})[0]
    except PrismError:
        at_given = math.inf
    rounded, _ = padding.fastest(program, given, tries, hardware, at_given, estimate, True, options.codegen)
    return sized(rounded) if rounded else options


def codegen_of(report: dict) -> CodegenConfig:
    """The code generator's options the directory was compiled with (a report from before they were recorded:
    the defaults with its block's threads), so kernels generated again at other dims are the same code."""
    fields = {f: type(v) for f, v in vars(CodegenConfig()).items()}
    given = report.get("codegen")
    if isinstance(given, dict) and isinstance(ends := given.get("ends", ()), list):  # JSON's lists: pairs of a tuple
        given = {**given, "ends": tuple(tuple(e) if isinstance(e, list) else e for e in ends)}
    if isinstance(given, dict) and "in_place" not in given:  # compiled before inputs were read in place
        given = {**given, "in_place": False}
    if isinstance(given, dict) and "copy_warp" not in given:  # compiled before TMA copies had a warp of their own
        given = {**given, "copy_warp": False}
    if isinstance(given, dict) and all(k in fields and type(v) is fields[k] for k, v in given.items()):
        config = CodegenConfig(**given)
        if bad := _unbuildable(config):
            raise PrismError(f"the codegen options in report.json are not what prismc compiles with: {', '.join(bad)}")
        return config
    if given is not None:
        raise PrismError(f"the codegen options in report.json are not prismc's: {json.dumps(given)[:200]}")
    return CodegenConfig(threads=report["kernels"][0]["block"][0] if report["kernels"] else 128)


def _unbuildable(config: CodegenConfig) -> list[str]:
    """The options of `config` that no compile gives (as `prismc compile` bounds --threads and --stages)."""
    bad = {"threads": not whole_warps(config.threads),
           "stages": config.stages < 1,
           "arch": ARCH.fullmatch(config.arch) is None,
           **{name: getattr(config, name) < 1 for name in ("smem_limit", "sms", "flight", "smem_per_sm")},
           "ends": not all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int
                           and e[1] >= 1 for e in config.ends)}
    return [f"{name}={getattr(config, name)!r}" for name, wrong in bad.items() if wrong]


def _as_on_disk(built, directory: Path, report: dict, hardware):
    """The build with each kernel's source, and the header, as DIR holds them, and the kernels edited since they were
    compiled (file: the first line that differs); launched as report.json says, which must be launchable on `hardware`
    and what DIR's launcher launches (`_runs_as_built`). Each .cu file's first lines say what it was compiled for (its
    grid, loop iterations, threads and shared memory, its loads and stores): those must be what the report's
    parameters and options give, or the report would say of the kernels what they are not."""
    listed = [k["file"] for k in report["kernels"]]
    mine = [k.file for k in built.kernels]
    if listed != mine:
        raise PrismError(f"the kernels of '{directory}/report.json' ({', '.join(listed)}) are not those of "
                         f"its program ({', '.join(mine)}): the directory was changed after it was compiled")
    for r, k in zip(report["kernels"], built.kernels):  # what the report says of each launch, besides the block
        said = {"name": k.name, "function": k.function, "grid": list(k.grid)}
        if wrong := [f"{key} {r.get(key)!r} (the program's: {value!r})" for key, value in said.items() if r.get(key) != value]:
            raise PrismError(f"'{directory}/report.json' says of {k.file}: {'; '.join(wrong)}: the directory was "
                             "changed after it was compiled")
    header = _text(directory / HEADER)
    if emulator.RUNTIME not in header:
        raise PrismError(f"'{directory / HEADER}' predates the thread-faithful emulation: compile the program again")
    if why := emulator.interface_problem(header):
        raise PrismError(f"'{directory / HEADER}' is from another version of prismc ({why}): compile the program again")
    # launched as compiled: the options the directory was written with (--threads, --no-wgmma, ...) decide
    # the block and its shared memory, which a build with the defaults may not share
    for r in report["kernels"]:
        threads, smem = r["block"][0] * r["block"][1] * r["block"][2], r["smem_bytes"]
        if threads > hardware.max_threads_per_block or smem > hardware.smem_per_block:
            raise PrismError(f"'{directory}/report.json' launches {r['file']} with {threads} threads and {smem} bytes "
                             f"of shared memory, more than the {hardware.name} takes ({hardware.max_threads_per_block}; "
                             f"{hardware.smem_per_block}): the directory was changed after it was compiled")
    sources = [_text(directory / k.file) for k in built.kernels]
    for k, text in zip(built.kernels, sources):
        if not (said := built_for(text)):
            raise PrismError(f"'{directory / k.file}' does not begin with the lines prismc writes to say what a kernel "
                             "was compiled for: compile the program again")
        if said != (ours := built_for(k.source)):
            line, theirs, mine = next((i, a, b) for i, (a, b) in enumerate(zip(said + [""], ours + [""]), 1) if a != b)
            raise PrismError(f"'{directory / k.file}' says at line {line} that it was compiled for "
                             f"{theirs.removeprefix('//').strip()!r}, where report.json's parameters and options give "
                             f"{mine.removeprefix('//').strip()!r}: the directory was changed after it was compiled")
    edited = {k.file: _first_difference(text, k.source) for k, text in zip(built.kernels, sources) if text != k.source}
    kernels = tuple(replace(k, source=text, block=tuple(r["block"]), smem=r["smem_bytes"])
                    for k, r, text in zip(built.kernels, report["kernels"], sources))
    built = replace(built, kernels=kernels)
    _runs_as_built(built, directory)
    return built, header, edited


def _first_difference(text: str, generated: str) -> str:
    """Where `text` first differs from `generated`: 'from line N', or how, where their lines are the same."""
    ours, theirs = generated.splitlines(), text.splitlines()
    line = next((i for i, (a, b) in enumerate(zip(theirs + [None], ours + [None]), 1) if a != b), None)
    return f"from line {line}" if line else "in its line endings or whitespace at the end only"


def built_for(source: str) -> list[str]:
    """The comment lines a generated kernel begins with (`templates/kernel.cu.j2`): what it was compiled for."""
    lines = source.splitlines()
    return lines[:next((i for i, line in enumerate(lines) if not line.startswith("//")), len(lines))]


def _runs_as_built(built, directory: Path) -> None:
    """DIR's launcher and runtime are those this prismc writes for these kernels (the launcher's plan holds each
    kernel's grid, block and shared memory, what the GPU is given): the emulation checks the kernels as the
    launcher launches them, or says that it cannot."""
    from ..pipeline.output import contents

    written = contents(built, {})
    for name in ("launcher.py", "prism_runtime.py", "cuda_plan.py"):
        if _text(directory / name) != written[name]:
            raise PrismError(f"'{directory / name}' is not what prismc writes for the kernels of '{directory}' as its "
                             "report.json launches them (one of the two edited, or from another version of prismc): "
                             "its launches are not checked; compile the program again")


def _too_far(output: dict) -> bool:
    """Whether an output failed by its errors' size (not NaN, an infinity or a shape): then its tolerance is said."""
    return not output["passed"] and not output.get("nan") and math.isfinite(output["max_rel_err"])


def _summary(check: EmulationCheck, directory: Path, built, on_disk: bool, given: str | None = None,
             other: str = "sizes", edited: dict | None = None) -> str:
    dims = ", ".join(f"{k}={v}" for k, v in check.emulation["dims"].items())
    how = ("the .cu files on disk" if on_disk else
           f"kernels generated again from the program in the directory (the .cu files on disk hold other {other})")
    past = ", ".join(f"{k}={v}" for k, v in built.padded.items())  # `pipeline.padding`: the caller's part compared
    lines = [f"{built.program.name} in {directory}/ at {dims or 'no dims'}"
             + (f" (given {past}: that part of each tensor is what is compared)" if past else "")
             + f": {how}" + (f", on the inputs of {given}" if given else ""),
             *[f"  {file}: edited since it was compiled ({where}); checked as it is on disk"
               for file, where in (edited or {}).items()],
             f"  emulated: {check.describe()}"]
    if check.finding:
        lines.append("  FAILED: " + emulator.Finding.from_dict(check.finding).text().replace("\n", "\n  "))
        return "\n".join(lines)
    writer = {s.name: k.name for k in kernels_of(built.program) for s in k.stores}
    for tensor, o in check.outputs.items():
        against = o.get("against", "reference")
        state = "agrees" if o["passed"] else "NOT VERIFIED" if o.get("undefined") else "DIFFERS"
        line = f"  {tensor} ({o['elements']} elements, kernel {writer.get(tensor, '?')}): {state} with the {against}, " \
               f"max rel err {o['max_rel_err']:.2e}" + (widened(o, check.rtol) or (
                   f" (tolerance {o.get('rtol', check.rtol):.2e})" if _too_far(o) else "")) + overflowed(o)
        if o.get("undefined"):  # `compare.check`: where it is defined, first wrong element and all, in its words
            line += f"; {o['undefined']}"
        elif not o["passed"] and o.get("first_wrong"):
            w = o["first_wrong"]
            line += f"; first wrong element {tensor}{w['index']} = {w['got']:.6g}, expected {w['expected']:.6g}"
        elif not o["passed"] and o.get("reason"):
            line += f"; {o['reason']}"
        lines.append(line)
    lines.append("  verified: " + ("yes" if check.passed else "NO"))
    return "\n".join(lines)
