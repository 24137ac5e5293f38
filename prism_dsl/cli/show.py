"""`prismc show`: a program's custom kernels, instantiated, as text or as a picture.

The text says, per kernel: the grid and loop with their values, each load's map and tile shape
(symbolic = concrete), the block ops with their tile shapes, the stores, the shared memory a block
needs against the hardware's limit, and every constraint the values violate. The picture is a Graphviz
graph of the kernel-level program with each custom kernel's block graph nested in it as a cluster
(grid, loop, maps and tile shapes as labels); `dot` renders it to SVG or PNG when it is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Mapping

import sympy

from ..base.errors import PrismError
from ..ir.nodes import Node, Program
from ..backend.cost import for_hardware
from ..backend.tuning import fits
from ..backend.launch import CodegenConfig, layout
from ..kernels.constraints import constraints, shared_memory
from ..kernels.hardware import load_hardware
from ..kernels.lower import lower
from ..kernels.kernel import Kernel, free_symbols, kernels_of, output_shape, storage, stored_dtype
from ..kernels.params import choose, resolve_params
from ..kernels.sizes import bind
from ..ir.ops import OPS, Kind
from ..lang.printer import node_text
from ..pipeline import optimize
from ..pipeline.build import BuildOptions, tune
from ..semantics.reference import bind_dims
from ..ir.shapes import fmt_shape


def _binding(program: Program, dims: Mapping[str, int], grid, loop, hardware) -> tuple[dict, list[str], int | None]:
    """Dims, the given kernel parameters and choices for the rest, as `prismc compile --search none` makes them: tuned
    by the cost model (`_tuned`), or, where the model finds none that fit, the constraint solver's first valid choice
    or the reasons it has none; and the threads per block the model chose, where not the default."""
    binding = dict(bind_dims(program, dims))
    symbols = {s.name: s for s in free_symbols(program)}
    fixed = {symbols[n]: v for n, v in resolve_params(program, grid, loop).items()}
    binding.update(fixed)
    notes = []
    if all(s in binding for s in symbols.values()):
        return binding, notes, None
    tuned = _tuned(program, dict(binding), dims, grid, loop, hardware)
    if tuned is not None and all(n in tuned[0] for n in symbols if symbols[n] not in binding):
        params, threads, us = tuned
        chosen = {symbols[n]: params[n] for n in symbols if symbols[n] not in binding}
        binding.update(chosen)
        notes.append("tuned by the cost model, as `prismc compile --search none` tunes them: "
                     + ", ".join(f"{s} = {v}" for s, v in chosen.items())
                     + (f"; {threads} threads a block" if threads else "") + f" (the model's estimate, by the code's structure: {us:.3f} us)")
        return binding, notes, threads
    try:
        chosen = choose(program, binding, fixed, hardware)  # not empty: some parameter is not given
        binding.update(chosen)
        notes.append("chosen: " + ", ".join(f"{s} = {v}" for s, v in chosen.items()))
    except PrismError as e:  # what the last choice tried breaks: the reasons, not only the heading
        notes += [line for d in e.diagnostics for line in (f"{d.loc}: {d.message}" if d.loc else d.message).splitlines()]
    return binding, notes, None


def _rounded(program: Program, dims: Mapping[str, int], grid, loop, hardware) -> tuple[Mapping[str, int], list[str]]:
    """The dims `prismc compile --search none` builds for (dims no tile divides rounded up where the model finds that
    faster, the launcher's copies included: `compile.sized_request`), and a note where they are not those given."""
    if grid or loop:  # (parameters given are for the dims given, which are then kept)
        return dims, []
    from pathlib import Path

    from ..pipeline.compile import Request, sized_request

    request = sized_request(Request(program, Path(), hardware, BuildOptions(dims=dims), search=None))[0]
    padded = request.options.padded
    if not padded:
        return dims, []
    return request.options.dims, ["built for " + ", ".join(f"{k}={request.options.dims[k]} (given {v})" for k, v in
                                                          padded.items())
                                  + ", as `prismc compile --search none` rounds them up (tiles divide that; the "
                                  "outputs come back cut to the sizes given)"]


def _tuned(program: Program, binding: dict, dims, grid, loop, hardware) -> tuple[dict, int | None, float] | None:
    """The model's parameters for the program at these dims (by name), its threads per block where not the default,
    and its estimate; None where none fit. As `compile` does it: with no parameter given, `optimize.rank` (which
    may take twice the threads); with some given (`--grid`, `--loop`), `build.tune`, those kept and the rest tuned
    at the default threads."""
    if not grid and not loop:
        ranked = optimize.rank(program, binding, hardware, CodegenConfig())
        return None if ranked is None else (ranked.params, ranked.threads, ranked.estimated_us)
    try:
        tuned = tune(lower(program), program, hardware, BuildOptions(dims=dims, grid=grid, loop=loop))
    except PrismError:  # none fit: the chooser says why
        return None
    return tuned.params, None, sum(e.time_us for e in tuned.estimates)


def _value(expr, binding) -> str:
    v = bind(expr, binding)
    if v.is_Integer:
        return str(int(v))
    if v.is_number:
        return f"{float(v):.4g} (not whole)"
    return str(v)


def _shape(shape, binding) -> str:
    sym = fmt_shape(shape)
    conc = "[" + ", ".join(_value(s, binding) for s in shape) + "]"
    return sym if sym == conc else f"{sym} = {conc}"


def kernel_text(program: Program, k: Kernel, binding, hardware, threads: int | None = None) -> tuple[list[str], list[str]]:
    """The lines describing kernel `k`, and the constraints it violates (in words)."""
    grid = ", ".join(f"{a} = {g}{_bound(g, binding, ' = ')}" for a, g in k.grid)
    loop = "" if k.loop is None else f" loop({k.loop}{_bound(k.loop, binding, ' = ')})"
    blocks = _value(sympy.Mul(*[g for _, g in k.grid]), binding)
    lines = [f"kernel {k.name} grid({grid}){loop}: {blocks} blocks, {_value(k.loop_range, binding)} iterations each"]
    names = {n: program.names[n] for n in k.body() if n in program.names and n.op != "tile"}
    for load in k.loads:
        src = k.inputs[load.source]
        tile = k.tile_node(load.tile)
        src_name = program.names.get(src, src.attr if src.op == "input" else "?")
        shape = _shape(tile.shape, binding) if tile is not None else "(unused)"
        lines.append(f"  load  {load.tile} = {src_name}{load.map}   tile {shape} {storage(src)}")
    for n in k.body():
        if n in names:
            lines.append(f"  {'acc ' if OPS[n.op].kind is Kind.ACCUMULATE else 'op  '}  {names[n]} = "
                         f"{node_text(n, {m: v for m, v in names.items() if m is not n})}   tile {_shape(n.shape, binding)}")
    for i, s in enumerate(k.stores):
        full = output_shape(s.value.shape, s.map, k)
        lines.append(f"  store {s.name}{s.map} {'+=' if s.add else '='} {node_text(s.value, names)}   "
                     f"tile {_shape(s.value.shape, binding)} -> {s.name} {_shape(full, binding)} {stored_dtype(k, i)}")
    smem = shared_memory(k)
    lines.append(f"  shared memory per block, at most: {smem} = {_value(smem, binding)} bytes "
                 f"(limit {hardware.smem_per_block} on {hardware.name})")
    problems = [v for c in constraints(k, hardware) if (v := c.violation(binding))]
    config = for_hardware(CodegenConfig() if threads is None else CodegenConfig(threads=threads), hardware)
    c = fits(k, binding, hardware, config) if all(not bind(g, binding).free_symbols for _, g in k.grid) \
        and not bind(k.loop_range, binding).free_symbols else None
    if c is not None:
        if problems:  # the bound only: what is generated fits
            lines.append("    over the limit as bounded; the code generated for it keeps less (below)")
        problems = []
        laid = layout(c, config)
        pipeline = (f"a {laid.stages}-stage {'TMA' if laid.tma else 'cp.async'} pipeline" if laid.stages > 1
                    else "no pipeline")
        pipeline += ", paced by mbarriers, the two warpgroups taking turns on the tensor cores" if laid.pingpong else ""
        pipeline += ", filled by a copy warp (32 threads more), paced by mbarriers" if laid.copy_warp else ""
        flash = "".join(f", online softmax over {names.get(s, 's')} in registers ({f.warps} warps of {16 * f.tm} rows"
                        f"{', on wgmma' if f.wg else ''})"
                        for s, f in laid.flash.items())
        lines.append(f"  as generated: {laid.threads} threads, {pipeline}{flash}, {laid.smem} bytes of shared memory "
                     "(row padding and pipeline stages included)")
        if laid.registers:
            lines.append("  register-tiled products: " + ", ".join(
                f"{names.get(acc, acc.op)} on {'wgmma (sm_90a)' if t.orient == 'wg' else 'mma.sync'} ({t.warps} warps)"
                for acc, t in laid.registers.items()))
    return lines, problems


def text_report(program: Program, binding, notes: list[str], hardware, threads: int | None = None) -> tuple[str, bool]:
    sizes = ", ".join(f"{d.name}={binding[d.symbol]}" for d in program.dims)
    lines = [f"program {program.name} (dims {sizes or 'none'}; hardware {hardware.name})"]
    lines += [f"  {n}" for n in notes]
    kernels = kernels_of(program)
    if not kernels:
        lines.append("  no custom kernels: every op is a pre-defined kernel")
    ok = True
    for k in kernels:
        body, problems = kernel_text(program, k, binding, hardware, threads)
        lines += body
        if problems:
            ok = False
            lines.append("  NOT VALID:")
            lines += [f"    - {p}" for p in problems]
        else:
            lines.append("  checks: every division exact, shared memory and grid within the limits")
    return "\n".join(lines) + "\n", ok


# -- pictures ----------------------------------------------------------------------------------------


NL = "\n"  # a line break inside a label


def _q(text: str) -> str:
    """A DOT string: quotes and backslashes escaped, line breaks as DOT's \\n."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace(NL, "\\n") + '"'


def dot_graph(program: Program, binding) -> str:
    """The kernel graph as DOT: tensors in device memory as boxes, each custom kernel a cluster."""
    out = [f"digraph {_q(program.name)} {{", "  rankdir=TB; node [fontname=Helvetica, fontsize=10];",
           "  edge [fontname=Helvetica, fontsize=9];"]
    ids: dict[int, str] = {}

    def nid(n: Node, prefix: str = "t") -> str:
        return ids.setdefault(id(n), f"{prefix}{len(ids)}")

    outputs = {id(n): name for name, n in program.outputs}
    done_kernels: set[int] = set()
    for n in program.nodes():
        if n.op in ("input", "kernel"):  # a tensor in device memory
            name = n.attr if n.op == "input" else program.names.get(n, n.attr[0].stores[n.attr[1]].name)
            out.append(f"  {nid(n)} [shape=box, style=filled, fillcolor=lightgrey, "
                       f"label={_q(f'{name}: {n.dtype}{fmt_shape(n.shape)}')}];")
            if n.op == "kernel" and id(n.attr[0]) not in done_kernels:
                done_kernels.add(id(n.attr[0]))
                out += _cluster(program, n.attr[0], binding, nid)
        elif n.op == "const":
            continue
        else:
            label = f"{program.names.get(n, n.op)} = {n.op}" + (NL + fmt_shape(n.shape) if n.shape else "")
            out.append(f"  {nid(n)} [shape=ellipse, label={_q(label)}];")
            out += [f"  {nid(a)} -> {nid(n)};" for a in n.args if a.op != "const"]
        if id(n) in outputs:
            out.append(f"  out_{nid(n)} [shape=plaintext, label={_q('return ' + outputs[id(n)])}];")
            out.append(f"  {nid(n)} -> out_{nid(n)};")
    out.append("}")
    return "\n".join(out) + "\n"


def _cluster(program: Program, k: Kernel, binding, nid) -> list[str]:
    grid = ", ".join(f"{a}={g}{_bound(g, binding)}" for a, g in k.grid)
    loop = "" if k.loop is None else f"  loop({k.loop}{_bound(k.loop, binding)})"
    c = f"cluster_{nid(k, 'k')}"
    lines = [f"  subgraph {c} {{", f"    label={_q(f'kernel {k.name}  grid({grid}){loop}')};",
             "    style=rounded; color=steelblue;"]
    for load in k.loads:
        tile = k.tile_node(load.tile)
        shape = fmt_shape(tile.shape) if tile is not None else "unused"
        label = f"load {load.tile}{load.map}" + NL + f"tile {shape}"
        lines.append(f"    {nid(tile or load, 'b')} [shape=box, color=steelblue, label={_q(label)}];")
        lines.append(f"    {nid(k.inputs[load.source])} -> {nid(tile or load, 'b')};")
    for n in k.body():
        if n.op in ("tile", "const"):
            continue
        acc = OPS[n.op].kind is Kind.ACCUMULATE
        name = program.names.get(n)
        label = (f"{name} = " if name else "") + n.op + NL + fmt_shape(n.shape)
        style = "shape=box, style=\"rounded,filled\", fillcolor=lightyellow" if acc else "shape=ellipse"
        lines.append(f"    {nid(n, 'b')} [{style}, label={_q(label)}];")
        lines += [f"    {nid(a, 'b')} -> {nid(n, 'b')};" for a in n.args if a.op != "const"]
    lines.append("  }")
    for i, s in enumerate(k.stores):
        op = "+=" if s.add else "="
        lines.append(f"  {nid(s.value, 'b')} -> {_store_target(program, k, i, nid)} [label={_q(f'store {s.name}{s.map} {op}')}];")
    return lines


def _store_target(program: Program, k: Kernel, index: int, nid) -> str:
    for n in program.nodes():
        if n.op == "kernel" and n.attr[0] is k and n.attr[1] == index:
            return nid(n)
    return nid(k.stores[index])


def _bound(expr, binding, eq: str = "=") -> str:
    """`expr`'s value after `eq`, when the binding gives it one (nothing when it stays as it is)."""
    return "" if bind(expr, binding) == expr else f"{eq}{_value(expr, binding)}"


def render(program: Program, dims, grid, loop, hardware_name: str, fmt: str) -> tuple[str | bytes, bool]:
    """(text or image bytes, whether every kernel is valid)."""
    hardware = load_hardware(hardware_name)
    dims, rounded = _rounded(program, dims, grid, loop, hardware)
    binding, notes, threads = _binding(program, dims, grid, loop, hardware)
    notes = rounded + notes
    text, ok = text_report(program, binding, notes, hardware, threads)
    if fmt == "text":
        return text, ok
    dot = dot_graph(program, binding)
    if fmt == "dot":
        return dot, ok
    exe = shutil.which("dot")
    if exe is None:  # (DOT text in a file named .png would be no picture, and nothing would say so but a note)
        raise PrismError(f"--format {fmt} needs Graphviz's 'dot', which is not on PATH: install Graphviz, or write the "
                         "graph as DOT text with --format dot")
    try:
        done = subprocess.run([exe, f"-T{fmt}"], input=dot.encode(), capture_output=True, timeout=60, check=True)
    except (subprocess.SubprocessError, OSError) as e:
        raise PrismError(f"Graphviz's dot failed to draw the graph: {e}") from None
    return done.stdout, ok
