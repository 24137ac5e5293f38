"""The values of the command line, read strictly: a value that is not what its flag takes is a usage
error (exit 2) that says what was expected, never a traceback or a silently different number."""

from __future__ import annotations

import argparse
import re

from ..backend.launch import WGMMA_ARCHS
from ..lang.syntax import MAX_INT, clip

MAX_SECONDS = 1e6  # a time limit beyond this is a mistake, and overflows the platform's clocks
TIME_LIMIT = 60.0  # `compile --time-limit`'s default, seconds


def ignored(args, written: bool, arch: str) -> str | None:
    """What `prismc compile` was given that would do nothing with the rest, said (a usage error): an option of the
    emulation with --no-emulate, a limit of the search with --search none or for a program that has custom kernels
    already (`written`: compiled as written), --no-wgmma, --tma or --no-pingpong without the wgmma products they are
    about (for a hardware `arch` without them, or with --no-tensor-cores), --tma and --no-pingpong with --no-wgmma or an
    --arch list that builds no wgmma, --no-copy-warp without --tma."""
    if args.no_emulate and (args.sanitize or args.blocks != "auto" or args.banks):
        flag = (f"--sanitize {args.sanitize} runs" if args.sanitize else "--banks counts in"
                if args.banks else f"--emulate-blocks {args.blocks} runs")
        return f"{flag} the emulation, which --no-emulate leaves out: give one of them"
    limits = [flag for flag, given in (("--time-limit", args.time_limit != TIME_LIMIT), ("--no-split", args.no_split),
                                       ("--max-kernels", args.max_kernels is not None), ("--unsteady", args.unsteady))
              if given]
    verb = "limits" if len(limits) == 1 else "limit"
    if args.search == "none" and limits:
        return f"{', '.join(limits)} {verb} the search, which --search none leaves out: give one of them"
    if written and args.search == "full" and limits:
        return f"{', '.join(limits)} {verb} the search, which a program with custom kernels of its own leaves out " \
               "(it is compiled as written): drop the option, or give the program without its kernels"
    without = (f"the hardware's {arch} does not have (sm_90)" if arch not in WGMMA_ARCHS else
               "--no-tensor-cores leaves out" if args.no_tensor_cores else None)
    if args.no_wgmma and without:  # (not for an --arch list without sm_90: the kernels are the hardware's, so
        return f"--no-wgmma puts the products on mma.sync, not wgmma, which {without}: drop --no-wgmma"  # it may need it)
    without = without or ("--no-wgmma leaves out" if args.no_wgmma else None) or (
        f"--arch {','.join(args.arch)} does not build (sm_90)" if args.arch and not set(args.arch) & set(WGMMA_ARCHS)
        else None)  # (--arch none builds nothing, and the kernels are written as for the hardware)
    if args.tma and without:
        return f"--tma copies the loop tiles of wgmma products, which {without}: drop --tma" + (
            ", or give --hardware h100 or h200" if arch not in WGMMA_ARCHS else "")
    if args.no_pingpong and without:
        return f"--no-pingpong sets how online softmax takes turns on wgmma, which {without}: drop --no-pingpong"
    if args.no_copy_warp and not args.tma:
        return "--no-copy-warp says who issues the TMA copies, which only --tma asks for: give both or neither"
    return None


def parse_dims(text: str) -> dict[str, int]:
    """`n=16,d=1024` -> {"n": 16, "d": 1024}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name.isidentifier() or not _is_int(value.removeprefix("-")):
            raise argparse.ArgumentTypeError(f"expected NAME=INT[,NAME=INT...], got {clip(part)!r}")
        if name in out:
            raise argparse.ArgumentTypeError(f"dim {name!r} is given twice")
        out[name] = _size(value, f"{name} = ")
        if out[name] < 1:  # a size, whatever the program
            raise argparse.ArgumentTypeError(f"{name!r} must be at least 1, got {clip(value)}")
    return out


class Merged(argparse.Action):
    """`--grid x=4 --grid z=2` as `--grid x=4,z=2` (each flag's NAME=INT pairs merged; a name given twice is
    refused), where a repeated flag would otherwise keep only its last value."""

    def __call__(self, parser, namespace, values, option_string=None):
        had = dict(getattr(namespace, self.dest, None) or {})
        if twice := sorted(set(had) & set(values)):
            what = "every kernel's loop range" if twice == [""] else ", ".join(repr(t) for t in twice)
            raise argparse.ArgumentError(self, f"{what} given twice")
        setattr(namespace, self.dest, {**had, **values})


def parse_loop(text: str) -> dict[str, int]:
    """`64` (every kernel's loop) or `F=64[,G=8]` (named loop symbols)."""
    if _is_int(text.strip()):
        if (every := _size(text.strip(), "")) < 1:
            raise argparse.ArgumentTypeError(f"a loop range must be at least 1, got {clip(text.strip())}")
        return {"": every}
    return parse_dims(text)


def _is_int(text: str) -> bool:
    return text.isascii() and text.isdigit()  # not "²" or "٣": int() would take some, and no user means them


def _size(digits: str, what: str) -> int:
    """An integer of the command line that is a size: at most MAX_INT, which also keeps int() within the
    4,300 digits Python converts."""
    plain = digits.removeprefix("-").lstrip("0")
    if len(plain) > len(str(MAX_INT)) or int(plain or "0") > MAX_INT:
        raise argparse.ArgumentTypeError(f"{what}{clip(digits)} is too large: sizes are at most 2^63 - 1")
    return int(digits)


def positive_int(text: str) -> int:
    if not _is_int(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def jobs(text: str) -> int:
    """--jobs: a positive integer, taken as at most the machine's cores (`base.forked.cores`): each prover process
    holds about half a gigabyte, and more of them than cores only wait for one another."""
    from ..base.forked import cores

    return min(positive_int(text), cores())


ARCH = re.compile(r"sm_\d{2,3}a?")  # an architecture's name, as nvcc takes it (sm_90, sm_90a, sm_80...)


def whole_warps(n: int) -> bool:
    """Whether `n` threads make a block: whole warps, at most 1024 (CUDA's block limit)."""
    return 32 <= n <= 1024 and n % 32 == 0


def threads(text: str) -> int:
    """--threads: a block's threads (`whole_warps`)."""
    if not _is_int(text) or not whole_warps(int(text)):
        raise argparse.ArgumentTypeError(f"expected a multiple of 32 up to 1024, got {clip(text)!r}")
    return int(text)


def archs(text: str) -> tuple[str, ...]:
    """--arch: architecture names (`ARCH`), comma-separated, or none."""
    names = tuple(dict.fromkeys(a.strip() for a in text.split(",")))  # each once: `sm_90,sm_90` compiled twice
    bad = [a for a in names if a != "none" and not ARCH.fullmatch(a)]
    if bad or not text.strip():
        raise argparse.ArgumentTypeError(f"expected names like sm_90 or sm_80, or none, got {clip(', '.join(map(repr, bad or [''])))}")
    if "none" in names and len(names) > 1:
        raise argparse.ArgumentTypeError(f"'none' skips the compile check: give it alone, got {clip(text)!r}")
    return tuple(a for a in names if a != "none")


def hardware_name(text: str) -> str:
    """--hardware: the name of a file of `kernels/gpus` (case aside)."""
    from ..kernels.hardware import hardware_names

    if text.lower() not in hardware_names():
        raise argparse.ArgumentTypeError(f"unknown hardware {clip(text)!r} (known: {', '.join(hardware_names())})")
    return text.lower()


def whole(text: str) -> int:
    if not _is_int(text):
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0 and at most {MAX_SECONDS:g}, got {text!r}")
    return value


def emulate_blocks(text: str) -> str | int:
    """`all`, `auto`, or a count of blocks chosen at random per kernel."""
    if text in ("all", "auto"):
        return text
    if not _is_int(text):
        raise argparse.ArgumentTypeError(f"expected all, auto or a number of blocks, got {clip(text)!r}")
    return int(text)
