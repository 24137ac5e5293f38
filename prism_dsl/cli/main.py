"""The `prismc` command line. `main(argv)` is what tests call in-process.

Exit codes: 0 success, 1 an error in the user's input (files, programs, rules, parameters) or a failed check, 2
a usage error, 3 not proved (`prove`), 130 interrupted. User errors are printed as located diagnostics; no traceback
reaches a user for bad input. Outputs are written atomically, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from .. import __version__
from ..prove.egglog_runner import Limits
from ..base.files import check_apart, check_writable, write_bytes
from ..base.errors import PrismError
from .texts import clashing, count, print_rules, summary
from .values import (TIME_LIMIT, Merged, archs, emulate_blocks, hardware_name, ignored, jobs, parse_dims, parse_loop,
                     positive_int, seconds, threads, whole)

EXIT_OK, EXIT_INPUT, EXIT_USAGE, EXIT_NOT_PROVED = 0, 1, 2, 3


class UsageError(Exception):
    """A bad command line: exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and exit; keep control in main()
        raise UsageError(f"{self.prog}: {message}\n(see '{self.prog} --help')")  # a command's own page


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="prismc", description="A symbolic superoptimizer for tensor programs.")
    p.add_argument("--version", action="version", version=f"prismc {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("check", help="check .prism programs, or .rules axioms (syntax, shapes, soundness)")
    c.add_argument("files", nargs="+", metavar="FILE", help="a .prism file (programs) or a .rules file (axioms)")
    c.add_argument("--no-default-rules", action="store_true", help="check .rules files on their own, not beside the default library")
    c.set_defaults(run=cmd_check)

    pv = sub.add_parser("prove", help="prove two programs equal with the axioms (exit 0 proved, 3 not proved)",
                        description="Prove two programs equal: the programs of two files, or the two programs of one file.")
    pv.add_argument("first", metavar="A.prism")
    pv.add_argument("second", metavar="B.prism", nargs="?", help="omit it to compare the two programs of A.prism")
    pv.add_argument("--program", action="append", default=[], metavar="NAME",
                    help="the program to compare: once for the same name in both files, twice for "
                         "the first and the second (also to pick two programs of one file)")
    _rule_options(pv)
    pv.add_argument("--explain", action="store_true", help="list the rules (name, file:line) the proof needs")
    pv.add_argument("--iterations", type=positive_int, default=Limits.iterations, help="saturation iterations (default %(default)s)")
    pv.add_argument("--nodes", type=positive_int, default=Limits.nodes, help="e-graph size limit (default %(default)s)")
    pv.add_argument("--timeout", type=seconds, default=Limits.seconds, help="wall-clock limit in seconds (default %(default)s)")
    pv.set_defaults(run=cmd_prove)

    ru = sub.add_parser("rules", help="show the axiom library, or the egglog program it compiles to")
    _rule_options(ru)
    ru.add_argument("--emit-egglog", action="store_true", help="print the generated egglog program")
    ru.set_defaults(run=cmd_rules)

    r = sub.add_parser("run", help="evaluate a program with the float64 reference interpreter")
    _program_options(r)
    source = r.add_mutually_exclusive_group()
    source.add_argument("--inputs", metavar="IN.npz", help="input arrays by input name (default: random)")
    source.add_argument("--seed", type=whole, default=0, help="seed for random inputs (default 0)")
    r.add_argument("--out", required=True, metavar="OUT.npz", help="where to write the outputs")
    r.add_argument("--save-inputs", metavar="FILE.npz", help="also write the inputs used")
    _kernel_options(r)
    r.set_defaults(run=cmd_run)

    sh = sub.add_parser("show", help="show a program's kernels: grid, loop, maps, tile shapes, shared memory, checks",
                        description="Show a program's custom kernels instantiated (text), or draw its kernel graph "
                                    "(--format dot|svg|png; svg and png need Graphviz's 'dot').")
    _program_options(sh)
    _kernel_options(sh)
    sh.add_argument("--format", choices=("text", "dot", "svg", "png"), default="text", help="default: text")
    sh.add_argument("-o", "--output", metavar="FILE", help="write the picture (or text) here instead of stdout ('-')")
    sh.set_defaults(run=cmd_show)

    co = sub.add_parser("compile", help="superoptimize a program: search fused kernels, prove, tune, render CUDA C",
                        description="Compile a program to CUDA. By default the search looks for equivalent programs of "
                                    "fused custom kernels, proves each equal to the input with the axioms, tunes the "
                                    "parameters of every proved one (cost model, or timing with --rank measure) and keeps "
                                    "the fastest, the program as written included. The result is rendered, compiled with "
                                    "nvcc, run as C++ on the CPU and checked against the float64 reference of the input program.")
    _program_options(co)
    co.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write the results into")
    co.add_argument("--search", choices=("full", "none"), default="full",
                    help="'full': search fused programs (default); 'none': compile the program as written")
    co.add_argument("--time-limit", type=seconds, default=TIME_LIMIT, metavar="SECONDS",
                    help="stop the search after this long and use the best proved program so far (default 60)")
    co.add_argument("--jobs", type=jobs, default=None, help="processes checking rules, proving, tuning (default, most: the cores)")
    co.add_argument("--max-kernels", type=positive_int, default=None, help="custom kernels a program may use (default 1)")
    co.add_argument("--no-split", action="store_true", help="do not offer loop kernels split in two (FlashDecoding)")
    co.add_argument("--no-cache", action="store_true", help="neither read nor write the search checkpoint and tuning database")
    co.add_argument("--unsteady", action="store_true", help="also offer programs that lose accuracy on inputs far from 0")
    co.add_argument("--grid", type=parse_dims, action=Merged, default={}, metavar="AXIS=N", help="grid sizes to use (x=96 or gx=96)")
    co.add_argument("--loop", type=parse_loop, action=Merged, default={}, metavar="N", help="loop ranges to use (64 or F=64)")
    co.add_argument("--rank", choices=("model", "measure"), default="model",
                    help="how launch parameters and programs are ranked: 'model', by the cost model (default); "
                         "'measure', run, checked and timed on the GPU")
    _hardware(co)
    _gone(co, "--target", "use --rank model|measure to choose how programs are ranked, --hardware NAME for the hardware")
    co.add_argument("--arch", type=archs, default="sm_90,sm_80", help="architectures nvcc checks, comma-separated "
                    "(default %(default)s); 'none' to skip")
    co.add_argument("--no-emulate", action="store_true", help="skip the CPU run of the generated code")
    _emulation_options(co)
    co.add_argument("--threads", type=threads, default=128,
                    help="threads per block, at least (default 128; a kernel on tensor cores takes the warps its "
                    "tiles need where that is more, and the tuner takes twice this where the model finds it faster)")
    co.add_argument("--stages", type=positive_int, default=3,
                    help="pipeline depth: copies run STAGES - 1 iterations ahead (default 3; 1: none); loops of "
                    "small tiles go deeper (up to 16), loops on wgmma hold the stages their batches read besides")
    co.add_argument("--no-tensor-cores", action="store_true", help="plain matrix products only")
    co.add_argument("--no-wgmma", action="store_true", help="products on mma.sync (sm_80 and later), not wgmma (sm_90a)")
    co.add_argument("--no-pingpong", action="store_true", help="online softmax on two warpgroups in step, each "
                    "iteration behind a block-wide barrier, not taking turns on the tensor cores")
    co.add_argument("--tma", action=argparse.BooleanOptionalAction, default=False, help="loop tiles of wgmma kernels "
                    "copied by TMA, not cp.async (off until a GPU runs them: on an H200 they faulted, since fixed)")
    co.add_argument("--no-copy-warp", action="store_true", help="with --tma, the copies issued by thread 0 behind a "
                    "block-wide barrier each iteration, not by a warp of their own")
    co.add_argument("--two-launches", action="store_true", help="a split's combining kernel in a launch of its own")
    co.add_argument("--padded-inputs", action="store_true", help="where dims are rounded up for tiles, the caller passes "
                    "the inputs at the sizes built, zeros past its own (a cache allocated that large): their copies are not counted")
    co.add_argument("--seed", type=whole, default=0, help="seed for the random inputs of the checks (default 0)")
    co.add_argument("--json", action="store_true", help="print report.json to stdout instead of the summary")
    co.set_defaults(run=cmd_compile)

    ve = sub.add_parser("verify", help="check a compiled output directory again, its .cu files as they are on disk",
                        description="Build the kernels of a directory `prismc compile -o` wrote, as they are on disk, in the "
                        "thread-faithful CPU emulation; run them on random inputs (or --inputs) and compare the outputs "
                        "with the float64 reference of the program in the directory: every element of the blocks run "
                        "(--emulate-blocks: all of them where that is quick, else a sample, which the summary says). "
                        "Exit 0 when all agree, 1 otherwise.")
    ve.add_argument("directory", metavar="DIR")
    ve.add_argument("--dims", type=parse_dims, action=Merged, default={},
                    help="other sizes (the kernels are then generated again from the directory's program)")
    ve.add_argument("--grid", type=parse_dims, action=Merged, default={}, metavar="AXIS=N", help="grid sizes, with --dims")
    ve.add_argument("--loop", type=parse_loop, action=Merged, default={}, metavar="N", help="loop ranges, with --dims")
    _emulation_options(ve)
    ve.add_argument("--seed", type=whole, default=0, help="seed for the random inputs and sampled blocks (default 0)")
    ve.add_argument("--inputs", metavar="IN.npz", help="input arrays by input name, of the sizes the caller gives")
    ve.set_defaults(run=cmd_verify)

    be = sub.add_parser("bench", help="time a program's kernels against PyTorch eager and torch.compile (needs a GPU)")
    _program_options(be)
    be.add_argument("--baseline", metavar="FILE",
                    help="the program PyTorch runs (default: FILE itself; needed when FILE has custom kernels)")
    _hardware(be)
    be.add_argument("--repeat", type=positive_int, default=200, help="timed repetitions (default 200)")
    be.add_argument("--json", metavar="FILE", dest="json_out", help="also write the table as JSON here")
    be.set_defaults(run=cmd_bench)
    return p


def _emulation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sanitize", choices=("thread", "address"), default=None,
                   help="emulate under ThreadSanitizer (races) or AddressSanitizer with UBSan (bad accesses)")
    p.add_argument("--emulate-blocks", dest="blocks", type=emulate_blocks, default="auto", metavar="all|auto|N", help="blocks "
                   "to emulate: 'all'; N, the first and last along every grid axis and N more at random per kernel; "
                   "'auto' (default), all where that is quick, else a sample (--banks: the first and last)")
    p.add_argument("--banks", action="store_true", help="also count the shared-memory wavefronts (bank conflicts) and price them")


def _program_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("--program", help="which program of the file (needed when it has several)")
    p.add_argument("--dims", type=parse_dims, action=Merged, default={}, help="sizes, e.g. n=16,d=1024")


def _kernel_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", type=parse_dims, action=Merged, default={}, metavar="AXIS=N",
                   help="grid sizes of custom kernels: by axis (x=96) or by symbol (gx=96); the rest are chosen")
    p.add_argument("--loop", type=parse_loop, action=Merged, default={}, metavar="N",
                   help="loop range of every custom kernel (64), or by symbol (F=64)")
    _hardware(p)
    _gone(p, "--target", "use --hardware NAME")


def _hardware(p: argparse.ArgumentParser) -> None:
    from ..kernels.hardware import hardware_names  # a directory listing: the files in kernels/gpus
    p.add_argument("--hardware", type=hardware_name, default="h100", metavar="NAME", help="the hardware, for the limits and the cost "
                   f"model ({', '.join(hardware_names())}; default h100)")


def _gone(p: argparse.ArgumentParser, flag: str, instead: str) -> None:
    """A flag that was renamed: refused (exit 2) with what to use instead; not listed by --help."""
    class Gone(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{flag} is no longer an option: {instead}")

    p.add_argument(flag, action=Gone, nargs="?", help=argparse.SUPPRESS)


def _rule_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rules", action="append", default=[], metavar="FILE.rules",
                   help="more axioms, added to the default library (repeatable)")
    p.add_argument("--no-default-rules", action="store_true", help="do not load the default library in rules/")


def _cwd_exists() -> bool:
    try:
        return bool(os.getcwd())
    except OSError:
        return False


def _from_interrupt(e: BaseException) -> bool:
    while e is not None and not isinstance(e, KeyboardInterrupt):
        e = e.__cause__ or e.__context__
    return e is not None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))  # headroom for lark and sympy on big programs
    replaced = _exit_on_signals()
    try:
        return args.run(args)
    except PrismError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_INPUT
    except UsageError as e:
        print(f"prismc: {e}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        print("prismc: not enough memory at these sizes; choose smaller dims with --dims", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("prismc: interrupted", file=sys.stderr)
        return 130
    except SystemError as e:  # a Ctrl-C inside Python code that C called (SymPy's __hash__ under np.matmul) comes so
        if not _from_interrupt(e):
            raise
        print("prismc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `prismc rules | head`: the reader has gone; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:  # a file system refusal not foreseen where it happened: still the user's setup, in words
        where = f"cannot use '{e.filename}'" if e.filename else "a file system call failed"
        print(f"prismc: {where}: {e.strerror or e}{'' if _cwd_exists() else ' (the current directory was removed)'}",
              file=sys.stderr)
        return EXIT_INPUT
    finally:
        sys.setrecursionlimit(limit)
        for signum, handler in replaced.items():
            signal.signal(signum, handler)


def _exit_on_signals() -> dict:
    """Turn SIGTERM (what `timeout` and CI runners send) and SIGHUP (a terminal closed) into an orderly exit
    that stops the workers and removes scratch; the handlers replaced (none where none can be set: a thread)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    try:
        return {s: signal.signal(s, stop) for s in (signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM))}
    except ValueError:
        return {}


def cmd_check(args) -> int:
    """Check every file given, reporting each file's errors; exit 1 if any file has one."""
    from ..lang.check import load

    failed = 0
    named: dict = {}  # rule name -> the rule, over the .rules files given: prove given them together refuses a clash
    for f in args.files:
        try:
            if f.endswith(".rules"):
                from ..prove.soundness import NUMERIC_ONLY, SYMBOLIC

                # Loaded beside the default library, as prove loads it, so that name clashes show now.
                library, statuses = load_rules([f], defaults=not args.no_default_rules)
                path = Path(f).resolve()
                mine = [r for r in library.rules if Path(r.loc.path).resolve() == path]
                clashing(mine, named)
                sets = ", ".join(dict.fromkeys(r.ruleset for r in mine)) or "none"
                proved = sum(statuses[r.name] == SYMBOLIC for r in mine)
                tested = sum(statuses[r.name] == NUMERIC_ONLY for r in mine)
                print(f"{f}: ok: {count(len(mine), 'rule')} (rulesets: {sets}), each sound on random tensors: "
                      f"{proved} proved symbolically, {tested} tested numerically only")
                print_rules(mine, statuses)
            else:
                from ..semantics.reference import bind_dims

                programs = load(f).programs.values()
                for program in programs:  # what only sizes can show (a causal mask over more rows than columns), at
                    bind_dims(program)    # the dims the file declares
                progs = "; ".join(summary(p) for p in programs) or "no programs"
                print(f"{f}: ok: {progs}")
        except PrismError as e:
            print(e.render(), file=sys.stderr)
            failed += 1
    if failed and len(args.files) > 1:
        print(f"{count(failed, 'file')} of {len(args.files)} failed", file=sys.stderr)
    return EXIT_INPUT if failed else EXIT_OK


def load_rules(files: list[str], *, defaults: bool):
    """Load and soundness-check rule files: every rule a command uses is checked (or known sound). The
    library, and each rule's status by name ("symbolic": proved by SymPy; "numeric": tested only)."""
    from ..prove.rules import load_library
    from ..prove.soundness import check_library

    library = load_library(files, defaults=defaults)
    return library, check_library(library)


def cmd_prove(args) -> int:
    from ..lang.check import load
    from ..prove.prover import SHAPES_DIFFER, prove
    from ..prove.soundness import NUMERIC_ONLY

    first, second = _pair(args, load)
    library, statuses = load_rules(args.rules, defaults=not args.no_default_rules)
    limits = Limits(iterations=args.iterations, nodes=args.nodes, seconds=args.timeout)
    proof = prove(first, second, library, limits, explain=args.explain)
    stats = f"[{proof.iterations} iterations, {proof.nodes:,} e-graph rows, {proof.seconds:.2f} s]"
    for pair in proof.pairs:
        label = pair.name if pair.name == pair.other else f"{pair.name} vs {pair.other}"
        print(f"{'proved' if pair.proved else 'not proved'}: {label}")
    if proof.numeric_gap is None and proof.numeric_why != SHAPES_DIFFER:
        why = proof.numeric_why or "none could be evaluated"
        print(f"note: no numeric cross-check at any of the sizes tried: {why}")
    if proof.proved:
        print(f"{first.name} == {second.name}: proved {stats}")
    else:
        print(f"{first.name} vs {second.name}: not proved: {proof.reason} {stats}")
        if proof.numeric_gap is not None and proof.numeric_gap > 1e-6:
            print(f"  (on random inputs they differ: largest relative difference {proof.numeric_gap:.3g} "
                  f"at {proof.numeric_at})")
    if proof.unexplained is not None:
        print(f"rules used: not narrowed down: {proof.unexplained}; a larger --timeout or --iterations may help")
    if proof.used is not None:
        print(f"rules used ({len(proof.used)}):")
        print_rules(proof.used, statuses, words=False)
        tested = sum(statuses.get(r.name) == NUMERIC_ONLY for r in proof.used)
        if tested:
            print(f"  * {count(tested, 'rule')} of these {'was' if tested == 1 else 'were'} tested numerically "
                  "only, not proved symbolically: the proof rests on random testing there")
    return EXIT_OK if proof.proved else EXIT_NOT_PROVED


def _pair(args, load):
    names = args.program
    if len(names) > 2:
        raise UsageError("--program is given at most twice: the first program and the second")
    if args.second is not None:
        first, second = (names * 2)[:2] if names else (None, None)
        return load(args.first).program(first), load(args.second).program(second)
    src = load(args.first)
    if len(names) == 2:
        return src.program(names[0]), src.program(names[1])
    if names:
        raise UsageError("with one file, give --program twice (the two programs to compare) or not at all")
    if len(src.programs) != 2:
        listed = ", ".join(src.programs) or "none"
        raise PrismError(f"{args.first} defines {count(len(src.programs), 'program')} ({listed}); "
                         "to prove with one file, it must hold exactly two, or name two with --program")
    return tuple(src.programs.values())


def cmd_rules(args) -> int:
    from ..prove.egraph import compile_library

    library, _ = load_rules(args.rules, defaults=not args.no_default_rules)
    if args.emit_egglog:
        print(compile_library(library)[0], end="")
        return EXIT_OK
    for ruleset in library.rulesets:
        rules = [r for r in library.rules if r.ruleset == ruleset]
        print(f"ruleset {ruleset} ({count(len(rules), 'rule')})")
        print_rules(rules)
    return EXIT_OK


def cmd_run(args) -> int:
    from ..lang.check import load
    from ..kernels.hardware import load_hardware
    from ..kernels.kernel import free_symbols
    from ..kernels.params import complete, resolve_params
    from .npz import read_npz, write_npz
    from ..semantics.blocks import evaluate
    from ..semantics.reference import bind_dims, check_sizes, random_inputs

    source = load(args.file)
    program = source.program(args.program)
    for target in filter(None, (args.out, args.save_inputs)):
        check_writable(target)
    check_apart({"--out": args.out, "--save-inputs": args.save_inputs},
                {"--inputs": args.inputs, **_sources(source)})

    def vet(headers: dict) -> None:  # the .npz's shapes (arrays without data), before its data is read
        check_sizes(program, bind_dims(program, args.dims, headers))

    given = read_npz(args.inputs, program, vet) if args.inputs else None
    binding = bind_dims(program, args.dims, given)
    check_sizes(program, binding)  # every tensor, before random inputs or any value is made
    inputs = given if given is not None else random_inputs(program, binding, args.seed)
    params = complete(program, binding, resolve_params(program, args.grid, args.loop), load_hardware(args.hardware))
    check_sizes(program, {**binding, **{s: params[s.name] for s in free_symbols(program)}})  # kernels' outputs
    outputs = evaluate(program, inputs, params, args.hardware)
    write_npz(args.out, outputs)
    if args.save_inputs:
        write_npz(args.save_inputs, inputs)
    sizes = ", ".join(f"{d.name}={binding[d.symbol]}" for d in program.dims)
    shown = ", ".join(f"{k}{list(v.shape)}" for k, v in outputs.items())
    kernels = ", ".join(f"{s.name}={params[s.name]}" for s in free_symbols(program))
    print(f"{program.name}: {shown} -> {args.out}" + (f" (dims {sizes})" if sizes else "")
          + (f" (kernel parameters {kernels})" if kernels else ""))
    return EXIT_OK


def cmd_compile(args) -> int:
    from ..backend.codegen import CodegenConfig
    from ..kernels.hardware import load_hardware
    from ..lang.check import load
    from ..pipeline.build import BuildOptions
    from ..pipeline.compile import Request, Searching, compile_program
    from ..pipeline.report import summary
    from ..search.config import SearchConfig

    hardware, program = load_hardware(args.hardware), load(args.file).program(args.program)
    if problem := ignored(args, written := any(n.op == "kernel" for n in program.nodes()), hardware.arch):
        raise UsageError(problem)
    searching = None
    if args.search == "full" and written:
        print(f"prismc: '{program.name}' already has custom kernels: compiling it as written (no search)",
              file=sys.stderr)
    elif args.search == "full":
        if args.grid or args.loop:
            raise UsageError("--grid and --loop set the parameters of kernels you wrote; with the search, use --search none")
        limits = {"steady": not args.unsteady} | ({} if args.max_kernels is None else {"max_kernels": args.max_kernels})
        searching = Searching(SearchConfig(**limits, split_reductions=not args.no_split), args.time_limit, args.jobs,
                              progress=not args.json)
    options = BuildOptions(dims=args.dims, grid=args.grid, loop=args.loop, rank=args.rank, archs=args.arch, banks=args.banks,
                           emulate=not args.no_emulate, sanitize=args.sanitize, emulate_blocks=args.blocks, seed=args.seed,
                           padded_inputs=args.padded_inputs,
                           codegen=CodegenConfig(threads=args.threads, tensor_cores=not args.no_tensor_cores,
                                                 stages=args.stages, wgmma=not args.no_wgmma, tma=args.tma,
                                                 copy_warp=not args.no_copy_warp, pingpong=not args.no_pingpong,
                                                 one_launch=not args.two_launches))
    report = compile_program(Request(program, Path(args.output), hardware, options, searching, not args.no_cache))
    print(report.to_json() if args.json else summary(report, Path(args.output)) + "\n", end="")  # (stdout may be closed)
    return EXIT_INPUT if report.checked.failed else EXIT_OK


def cmd_verify(args) -> int:
    from .verify import verify

    if (args.grid or args.loop) and not args.dims:
        raise UsageError("--grid and --loop choose kernel parameters at other dims: give --dims too")
    return verify(args)


def _sources(source) -> dict[str, str]:
    """The files a command read its program from, by what each is (for `check_apart`)."""
    root = str(Path(source.path).resolve())
    return {"the program's file" if f == root else f"a file it imports ({Path(f).name})": f for f in source.files}


def cmd_bench(args) -> int:
    from .bench import bench

    return bench(args)


def cmd_show(args) -> int:
    from ..lang.check import load
    from .show import render

    source = load(args.file)
    program = source.program(args.program)
    if args.output not in (None, "-"):
        check_writable(args.output)
        check_apart({"-o": args.output}, _sources(source))
    text, ok = render(program, args.dims, args.grid, args.loop, args.hardware, args.format)
    if args.output not in (None, "-"):
        write_bytes(args.output, text if isinstance(text, bytes) else text.encode())
        print(f"{program.name}: {args.format} -> {args.output}")
    elif isinstance(text, bytes):
        raise UsageError(f"--format {args.format} is binary; give -o FILE")
    else:
        print(text, end="")
    return EXIT_OK if ok else EXIT_INPUT
