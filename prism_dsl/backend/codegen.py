"""CUDA code generation: one concrete custom kernel becomes one CUDA C kernel, through Jinja2 templates.

Where it sits: after parameter instantiation (`kernels.constraints.instantiate`), before compiling
(`nvcc`, the GPU). The generated kernel does what docs/ARCHITECTURE.md says a custom kernel does, with
every size a compile-time constant:

    prologue:  accumulator state initialised (not a state held in registers through the loop); tiles the
               loop does not split loaded once, and the values made from them alone computed once
    loop:      tiles the loop splits loaded (16-byte copies where rows allow); the body's materialized
               values computed; each accumulator folds its operand(s); a barrier after each step
    epilogue:  tiles read only after the loop loaded; post-loop values; stores at the block's place
               (atomic adds for grid axes that write no dim, finished by the tile's last block: `stores`)

`fusion.plan` decides where each value lives (shared memory, registers, accumulator state). Element-wise
values fused into registers are evaluated where they are read, so a chain like `silu(gate) * up` costs
no buffer and no barrier. Matrix products whose operands are f16/bf16 tiles of suitable shape run on
tensor cores (`tensor_steps`: wmma tiles, register-tiled mma.sync, online softmax in registers), with the
plain path kept beside wmma tiles for other GPUs; register-tiled and online-softmax kernels need sm_80
(their state is written only after the loop, in bytes the loop's buffers use: `kernels.lifetimes`). How each
accumulator folds and finishes is format strings in its row of `ir.accumulators`; the kinds of fold
(per state element, per row, a matrix product, online softmax) are the code here.

Names in the generated code are derived from the program's (`ctext`), with a prefix (`g_` for tensors in
device memory, `s_` for shared buffers, `r_` and `f_` for registers).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache

import jinja2

from ..base.resources import data_dir
from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import DType, Node, Program
from ..ir.ops import OPS, Kind
from ..kernels.constraints import Concrete
from ..kernels.fusion import Buffer, Place, compute_dtype, plan
from ..kernels.kernel import after_loop, in_loop, loop_varying, storage, stored_dtype
from ..kernels.lifetimes import AFTER, in_use
from ..kernels.position import causal_loop, longest_first, loop_bounds, placed, whole
from ..kernels.sizes import bind
from ..lang.printer import format_number, node_text
from .ctext import (C_OPS, CTYPE, INT_MAX, block_names, comment, decompose, ident, needed, offset, reads,
                    reduction, tensor_name, xor_column)
from .copies import TensorMap, load_step, tma_copies
from .dots import dot_lanes, lane_groups, row_lanes, row_mma
from .launch import CodegenConfig, flash_values, layout, stage_elements
from . import sums
from .row_parts import RowParts, held_in_registers
from .stores import StoreSteps
from .tensor_steps import TensorCoreSteps, shared_operand

__all__ = ["CTYPE", "CodegenConfig", "Emitter", "RenderedKernel", "comment", "ident", "render_kernel"]

TEMPLATES = data_dir("templates", "templates")
HEADER = "prism.cuh"


@dataclass(frozen=True)
class RenderedKernel:
    name: str  # the kernel's name in the program
    function: str  # the C function
    file: str  # NAME.cu
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int  # dynamic shared memory, bytes
    args: tuple[str, ...]  # tensor names, one pointer each, in parameter order: inputs, then outputs
    stores: int  # how many of `args` (the last ones) the kernel writes
    zero: tuple[str, ...]  # outputs that blocks add into (f64: `sums`): zeroed before the launch
    tensor_cores: bool  # a wmma path is in the code
    wgmma: bool = False  # its products run on wgmma: it compiles for sm_90a only
    combines: str | None = None  # the combining kernel it also runs (`render_launch`), by name
    tickets: int = 0  # with `combines` or `sums`: its tiles, a counter each, zero before the first launch (after `args`)
    maps: tuple[TensorMap, ...] = ()  # the tensor maps of its TMA copies (`copies`), its first parameters
    sums: int = 0  # f32 elements of the workspaces its blocks add into (`sums`), zero before the first launch (last)


@cache
def template_env() -> jinja2.Environment:
    """The Jinja environment of `templates/`: kernels here, the launcher in `pipeline`."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.globals["xor_column"] = xor_column  # steps.j2's ldmatrix addresses permute a tile's rows as `offset` does
    env.globals.update(needed=needed, reads=reads)  # the index lines and variables a step reads
    return env


def header_source() -> str:
    return (TEMPLATES / HEADER).read_text()


# -- one kernel -----------------------------------------------------------------------------------------


class Emitter(TensorCoreSteps, RowParts, StoreSteps):
    """One concrete kernel's code: `context` what the template renders it from, `render` the kernel alone
    (`tails.render_launch` renders two kernels in one launch from their contexts)."""

    def __init__(self, c: Concrete, program: Program, config: CodegenConfig, blk: str | None = None):
        self.c, self.k, self.program, self.config = c, c.kernel, program, config
        self.plan = plan(self.k)
        self.real = CTYPE[compute_dtype(self.k)]
        self.names = program.names
        self.tensor_core_steps = 0
        self.layout = layout(c, config)
        self.registers, self.threads, self.pad = self.layout.registers, self.layout.threads, self.layout.pads
        # a barrier of the computing threads: with a copy warp, which leaves before the loop, their named barrier 3
        self.sync = "prism::named_sync(3, kThreads)" if self.layout.copy_warp else "__syncthreads()"
        self.cname = {b.name: f"s_{ident(b.name)}" for b in self.plan.buffers}
        self.held_in: dict[Node, str] = {}  # values a step holds in registers at the element it reads (`row_parts`)
        self.held_partner: dict[Node, str] = {}  # and at RoPE's partner element, half a row away (`row_parts.vectored`)
        # the block's place in the grid: blockIdx, or the block a causal kernel's launch order takes
        self.blk = blk or ("blk_" if longest_first(self.k, dict(c.grid), config.sms) else "blockIdx.")

    # shapes and buffers
    def shape(self, node_or_buffer) -> tuple[int, ...]:
        return tuple(int(bind(s, self.c.binding)) for s in node_or_buffer.shape)

    def lit(self, value: float) -> str:
        text = format_number(value)
        text += ".0" if "." not in text and "e" not in text and "inf" not in text else ""
        return f"real({text})" if self.real != "float" else text + "f"

    def offset(self, b: Buffer, idx: list[str], shape=None) -> str:
        """Where element `idx` of buffer b sits: row-major with its padding, or in wgmma's swizzle."""
        return offset(idx, shape or self.shape(b), self.pad[b.name], b.name in self.layout.swizzled,
                      b.name in self.layout.xor_rows)

    def at(self, b: Buffer, idx: list[str]) -> str:
        ref = f"{self.cname[b.name]}[{self.offset(b, idx)}]"
        return ref if b.dtype in (DType.F32, DType.F64) else f"prism::to_f({ref})"

    # reading a value at an index of the reader's index space (numpy broadcasting, right-aligned)
    def read(self, node: Node, idx: list[str]) -> str:
        if node in self.held_in:
            return self.held_in[node]
        place = self.plan.place[node]
        if place is Place.SMEM:
            return self.at(self.plan.buffer(node), idx)
        if place is Place.STATE:
            return self.finish(node, idx)
        if node.op == "const":
            return self.lit(node.attr)
        if place is Place.INLINE:
            return self.value(node, idx)
        raise AssertionError(f"{node.op} is fused into its accumulator and has no value of its own")

    def value(self, node: Node, idx: list[str]) -> str:
        """The element-wise op `node` applied to its operands read at `idx` (a transpose: its operand read
        with two indices swapped; causal: -inf above the diagonal, placed by `position`)."""
        if node.op == "transpose":
            (i, j), idx = (d - node.rank for d in node.attr), list(idx)
            idx[i], idx[j] = idx[j], idx[i]
            return self.read(node.args[0], idx)
        if node.op == "rope":  # x * c + rotate_half(x) * s, one element: its partner half a row away
            (x, c, s), j = node.args, idx[-1]
            half = self.shape(x)[-1] // 2
            low, high = (self.held_partner[x],) * 2 if x in self.held_partner else \
                (self.read(x, idx[:-1] + [f"({j} + {half})"]), self.read(x, idx[:-1] + [f"({j} - {half})"]))
            return f"({self.read(x, idx)} * {self.read(c, idx)} + ({j} < {half} ? -{low} : {high}) * {self.read(s, idx)})"
        if node.op == "causal":
            (row, rows), (col, cols) = self.place(node, -2), self.place(node, -1)
            above = f"({idx[-1]}{col} > {idx[-2]}{row} + {cols - rows})"
            return f"({above} ? -real(INFINITY) : {self.read(node.args[0], idx)})"
        if node.op == "div" and node.args[1].op == "const" and 1e-30 < abs(node.args[1].attr) < 1e30:
            return f"({self.read(node.args[0], idx)} * {self.lit(1 / node.args[1].attr)})"  # no division an element
        return C_OPS[node.op].format(*[self.read(a, idx) for a in node.args])

    def place(self, node: Node, dim: int) -> tuple[str, int]:
        """(" + where the block's dim starts" in C, or "", the whole dim's size) for dim `dim` of `node`."""
        o = placed(self.k, node, dim, node in after_loop(self.k.body()) and self.c.loop > 1)
        if o is None:
            return "", self.shape(node)[dim]
        full, dm = whole(self.shape, self.k, o), o.dm
        piece = full // dict(self.c.grid)[dm.axis] if dm.axis else full
        wide = "(long long)" if full - 1 > INT_MAX else ""  # signed, as the masks' offsets are; 64-bit past an int
        parts = (([f"{wide or '(int)'}{self.blk}{dm.axis} * {piece}"] if dm.axis else [])
                 + ([f"{wide}it * {piece // self.c.loop}"] if dm.loop else []))
        return "".join(f" + {p}" for p in parts), full

    def loop_end(self) -> str | None:
        """For a causal loop (`kernels.position`), the block's last iteration that holds a column its rows
        keep, as a C expression; None where the loop runs its whole range."""
        cl = causal_loop(self.k)
        if cl is None:
            return None
        last, step, piece = loop_bounds(self.shape, self.k, dict(self.c.grid), self.c.loop, cl)
        row0 = f"(int){self.blk}{cl.rows.dm.axis} * {piece} + " if piece else ""
        return f"prism::causal_end({row0}{last}, {step}, {self.c.loop})"

    def finish(self, acc: Node, idx: list[str]) -> str:
        """An accumulator's value after the loop: its `cuda_finish` over the state that holds it."""
        fmt = ACCUMULATORS[acc.op].cuda_finish
        count = self.shape(acc.args[0])[-1] * self.c.loop if "{count}" in fmt else 0
        return fmt.format(self.at(self.held(acc), idx), count=count)

    def held(self, acc: Node) -> Buffer:
        """The state buffer that holds an accumulator's value (the last of its `state` roles)."""
        return self.plan.state[acc][ACCUMULATORS[acc.op].state[-1]]

    def describe(self, node: Node) -> str:
        name = self.names.get(node)
        text = node_text(node, {k: v for k, v in self.names.items() if k is not node})
        shape = list(self.shape(node))
        return comment(f"{name} = {text}  {shape}" if name else f"{text}  {shape}")

    # steps --------------------------------------------------------------------------------------------
    def elements(self, shape, body_of, text: str) -> dict:
        lines, idx = decompose("e", shape, "i")
        return {"kind": "elements", "comment": text, "n": math.prod(shape), "idx": lines, "body": body_of(idx)}

    def compute_step(self, node: Node) -> dict:
        if self.plan.place[node] is Place.STORED:  # written straight to the output that stores it
            return self.rowwise(node, None, self.plan.writes[node])
        b = self.plan.buffer(node)
        shape, dst, kind = self.shape(node), self.cname[b.name], OPS[node.op].kind
        if kind in (Kind.UNARY, Kind.BINARY, Kind.MASK) or OPS[node.op].per_element:
            if (vector := self.vector_elements(node, shape, dst, b)) is not None:
                return vector
            if b.dtype in (DType.F32, DType.F64):
                return self.elements(shape, lambda idx: [f"{dst}[e] = {self.value(node, idx)};"], self.describe(node))
            # kept in 16 bits, rows padded, for the tensor-core products that read it (`fusion.plan`)
            return self.elements(shape, lambda idx: [f"{dst}[{self.offset(b, idx, shape)}] = "
                                                     f"prism::from_f<{CTYPE[b.dtype]}>({self.value(node, idx)});"],
                                 self.describe(node))
        if kind is Kind.MATMUL:
            return self.matmul(node.args[0], node.args[1], node, dst, accumulate=False, text=self.describe(node))
        if kind is Kind.REDUCE:
            return self.reduce(node, dst)
        if kind is Kind.ROWWISE:
            return self.rowwise(node, dst)
        raise AssertionError(node.op)

    def matmul(self, a: Node, b: Node, out_node: Node, dst: str, accumulate: bool, text: str) -> dict:
        """out = a @ b (or out += a @ b) over the output's elements; on tensor cores where shapes allow."""
        shape = self.shape(out_node)
        if out_node in self.registers:  # an acc_sum whose product runs register-tiled (sm_80 or later)
            return self.warp_mma(out_node, dst, text)
        plain = self.product(lambda ix: self.read(a, ix), lambda ix: self.read(b, ix), self.shape(a)[-1], shape, dst,
                             lambda idx: f"{dst}[e]" if accumulate else "real(0)", text, b, a)
        mma = self._mma(a, b, shape, dst, accumulate, text)
        return mma | {"plain": plain} if mma else plain

    def product(self, read_a, read_b, length: int, shape, dst: str, start, text: str, b: Node | None = None,
                a: Node | None = None, rounded: bool = False) -> dict:
        """dst = start + a @ b over dst's elements, where read_a(idx), read_b(idx), start(idx) are C expressions;
        8 outputs at a time from 16-byte loads of `b` where `dots.dot_lanes` allows ("dot8"); where `b` is a
        tile read transposed, one output at a time from 16-byte loads of its rows (`dots.row_lanes`: "dotrows");
        on tensor cores where a has few rows (`dots.row_mma`: "mmarows"), a being the node `read_a` reads, or with
        `rounded` values that may be rounded to b's type (online softmax's p)."""
        lanes = dot_lanes(self.c, b, tuple(shape), length, self.threads, self.config) if b is not None else 0
        lines, idx = decompose("e", shape, "i")
        mma = (b is not None and (a is not None or rounded) and self.real == "float"
               and row_mma(self.c, a, b, tuple(shape), length, self.threads, self.config))
        # dot8 computes the index of the first of its 8 outputs only: a start that reads the column keeps the scalar form
        if lanes and not re.search(rf"\b{idx[-1]}\b", start(idx)):
            buf = self.plan.buffer(b)
            plain = {"kind": "dot8", "comment": text, "units": math.prod(shape) // 8, "lanes": lanes,
                     "length": length, "idx": lines, "a": read_a(idx[:-2] + [idx[-2], "k"]), "start": start(idx),
                     "dst": dst, "group": lane_groups(lanes),
                     "b": f"{self.cname[buf.name]} + {self.offset(buf, idx[:-2] + ['k', idx[-1]], self.shape(b))}"}
            return self.keys_on_tensor_cores(a, read_a, b, tuple(shape), length, plain) if mma else plain
        if b is not None and (lanes := row_lanes(self.c, b, tuple(shape), length, self.threads, self.config)):
            tile = self.plan.buffer(b.args[0])
            row = self.offset(tile, idx[:-2] + [idx[-1], "k"], self.shape(b.args[0]))
            plain = {"kind": "dotrows", "comment": text, "units": math.prod(shape), "lanes": lanes, "length": length,
                     "idx": lines, "start": start(idx), "dst": dst, "b": f"{self.cname[tile.name]} + {row}",
                     "a": self.row_chunk(a, idx[:-2] + [idx[-2], "k"], length) if a is not None else None,
                     "a_at": read_a(idx[:-2] + [idx[-2], "(k + c)"]), "group": lane_groups(lanes)}
            return self.keys_on_tensor_cores(a, read_a, b, tuple(shape), length, plain) if mma else plain

        def body(idx):
            lead, i, j = idx[:-2], idx[-2], idx[-1]
            ra, rb = read_a(lead + [i, "k"]), read_b(lead + ["k", j])
            return [f"real dot = {start(idx)};", f"for (int k = 0; k < {length}; ++k) dot += {ra} * {rb};", f"{dst}[e] = dot;"]
        return self.elements(shape, body, text)

    def row_chunk(self, a: Node, idx: list[str], length: int) -> str | None:
        """The address of 8 elements of `a` from `idx` on along its rows, for one 16-byte load (`prism::load8`),
        where `a` is a 16-bit buffer in shared memory whose rows, `length` long, start 16 bytes apart; else None."""
        if a in self.held_in or self.plan.place.get(a) is not Place.SMEM:
            return None
        buf = self.plan.buffer(a)
        if buf.dtype.bytes != 2 or self.shape(a)[-1] != length or self.pad[buf.name] % 8:
            return None
        return f"{self.cname[buf.name]} + {self.offset(buf, idx, self.shape(a))}"

    def reduce(self, node: Node, dst: str) -> dict:
        x, dim = node.args[0], node.attr
        length = self.shape(x)[dim]
        init = {"sum": self.lit(0.0), "mean": self.lit(0.0), "max": "-real(INFINITY)"}[node.op]

        def body(idx):
            inner = list(idx)
            inner[dim] = "r"
            result = f"acc / real({length})" if node.op == "mean" else "acc"
            return [*reduction(node.op, length, self.read(x, inner), init), f"{dst}[e] = {result};"]

        return self.elements(self.shape(node), body, self.describe(node))

    def rows(self, x_shape, read_row, reduce: str, finish: list[str], text: str) -> dict:
        """A row reduction: `read_row(idx)` gives the term for element (row..., j)."""
        lines, idx = decompose("row", x_shape[:-1], "i")
        term = read_row(idx + ["j"])
        init = self.lit(0.0) if reduce == "sum" else "-real(INFINITY)"
        fold = f"part += {term}" if reduce == "sum" else f"part = prism::max_(part, {term})"
        return {"kind": "rows", "comment": text, "rows": math.prod(x_shape[:-1]), "idx": lines, "length": x_shape[-1],
                "init": init, "fold": fold, "reduce": reduce, "finish": finish}

    # accumulators
    def init_steps(self) -> list[dict]:
        steps, done = [], set()
        for acc, st in self.plan.state.items():
            for role, b in st.items():
                if b.name in done or self.layout.live[b.name][0] == AFTER:  # written whole after the loop
                    continue
                done.add(b.name)
                start = "-real(INFINITY)" if role == "m" else self.lit(0.0)  # "m": a running max
                steps.append(self.elements(self.shape(b), lambda idx, b=b, s=start: [f"{self.cname[b.name]}[e] = {s};"],
                                           comment(f"{self.names.get(acc, acc.op)}: {role} starts at {start}")))
        return [s | {"idx": []} for s in steps]

    def acc_steps(self, acc: Node, done: set) -> list[dict]:
        if acc in done:
            return []
        done.add(acc)
        x = acc.args[0]
        if ACCUMULATORS[acc.op].online and x in self.plan.groups:
            return self.softmax_steps(x, done)
        if self.plan.place[x] is Place.FUSED:  # a product added straight into the running sum
            return [self.matmul(x.args[0], x.args[1], acc, self.cname[self.held(acc).name], True, self.describe(acc))]
        if held_in_registers(acc):
            return [self.row_parts(acc)]
        return [self.fold(acc, [lambda idx, a=a: self.read(a, idx) for a in acc.args], operand=acc.args[0])]

    def fold(self, acc: Node, reads: list, operand: Node | None = None, rounded: bool = False, **names: str) -> dict:
        """One iteration of `acc`, from its `cuda_*` strings (see `accumulators`): `reads[i](idx)` is operand
        i at an index (`operand`: the node `reads[0]` reads, where it is one); `names` adds buffers of the
        online-softmax group ("scale")."""
        a, x, text = ACCUMULATORS[acc.op], self.shape(acc.args[0]), self.describe(acc)
        names |= {role: self.cname[b.name] for role, b in self.plan.state[acc].items()}
        if a.row:
            return self.rows(x, lambda idx: self.past_end(acc.args[0], a.past_end, a.cuda_term.format(
                *[r(idx) for r in reads])), a.cuda_reduce, [line.format(**names) for line in a.cuda_fold], text)
        if a.like == "matmul":  # its fold is the dot product's start; {row}: the element's row in per-row state
            def start(idx) -> str:
                return a.cuda_fold[0].format(row=offset(idx[:-1] + ["0"], x[:-1] + (1,)), **names)
            return self.product(reads[0], reads[1], x[-1], self.shape(acc), names[a.state[-1]], start, text, acc.args[1],
                                operand, rounded)

        def lines(idx) -> list[str]:
            return [line.format(*[r(idx) for r in reads], **names) for line in a.cuda_fold]
        return self.elements(self.shape(acc), lines, text)

    def softmax_steps(self, s: Node, done: set) -> list[dict]:
        """Online softmax over scores `s`, for every accumulator that folds them (they share the running
        max): the new row max and the factor exp(old max - new max); p = exp(s - new max); then each
        softmax accumulator folds p (for s), rescaling what it holds by the factor."""
        if s in self.layout.flash:
            done.update(self.plan.users[s])
            return [self.flash(s)]
        g = self.plan.groups[s]
        m, scale, p = (self.cname[g[r].name] for r in ("m", "scale", "p"))
        shape = self.shape(s)
        users = [u for u in self.plan.users[s] if u.op in ACCUMULATORS and ACCUMULATORS[u.op].online]
        done.update(users)
        name = self.names.get(s, "s")
        # the row's warp folds the old max in (each lane reads it before the warp's max, a collective, orders
        # them ahead of lane 0's write), then writes p = exp(s - new max) itself: no barrier between the two
        step = self.rows(shape, lambda idx: self.score(s, idx), "max", [f"{scale}[row] = prism::rescale(old, part);",
                         f"{m}[row] = part;"], comment(f"online softmax over {name}: running row max, rescaling factor, p"))
        at = decompose("row", shape[:-1], "i")[1] + ["j"]
        steps = [step | {"before": [f"const real old = {m}[row];"], "init": "old",
                         "each": [f"{p}[{offset(at, shape)}] = prism::exp_minus({self.score(s, at)}, part);"]}]
        p_at = [lambda idx: self.at(g["p"], idx)]
        for acc in (u for u in users if ACCUMULATORS[u.op].online == "softmax"):  # a row sum: in registers (`row_parts`)
            steps.append(self.row_parts(acc, p_at[0], scale) if ACCUMULATORS[acc.op].row else
                         self.fold(acc, p_at + [lambda idx, a=a: self.read(a, idx) for a in acc.args[1:]], rounded=True,
                                   scale=scale))
        return steps

    # the whole kernel
    def render(self) -> RenderedKernel:
        ctx = self.context()
        source = template_env().get_template("kernel.cu.j2").render(k=ctx, t=None)
        return self.rendered(ctx, source)

    def rendered(self, ctx: dict, source: str) -> RenderedKernel:
        k, c = self.k, self.c
        grid3 = tuple(dict(c.grid).get(a, 1) for a in ("x", "y", "z"))
        args = [tensor_name(n) for n in k.inputs] + [s.name for s in k.stores]
        zero = tuple(s.name for i, s in enumerate(k.stores) if sums.summed_axes(c, i) and not sums.finished(c, i))
        return RenderedKernel(k.name, ctx["function"], ctx["file"], source, grid3, (self.layout.launched, 1, 1), ctx["smem"],
                              tuple(args), len(k.stores), zero, self.tensor_core_steps > 0, ctx["wgmma"], maps=ctx["maps"],
                              tickets=sums.tickets(c), sums=sums.offsets(c)[1])

    def context(self, phase: int = 0) -> dict:
        """What the template renders the kernel from; its shared buffers' phases (`kernels.lifetimes`) counted
        from `phase` (3 for a combining kernel that runs after another in its launch: `render_launch`)."""
        k, c = self.k, self.c
        body = k.body()
        after = after_loop(body)
        varying = loop_varying(k)
        looped = in_loop(body, after)
        prologue = self.init_steps()
        prologue += [load_step(self, n) for n in looped if n.op == "tile" and n not in varying]
        # the loop's loads run together; one barrier after them (or, pipelined, issued stages - 1 iterations ahead)
        loop_tiles = [n for n in looped if n.op == "tile" and n in varying]
        stages = self.layout.stages
        staged = [{"cname": self.cname[self.plan.buffer(n).name], "ctype": CTYPE[self.plan.buffer(n).dtype],
                   "stride": stage_elements(self.layout, self.plan.buffer(n))} for n in loop_tiles] if stages > 1 else []
        into = [f"{st['cname']}_stages + ahead % {stages} * {st['stride']}" for st in staged]
        by_tma, maps = tma_copies(self, loop_tiles, into, stages) if self.layout.tma else ([], ())
        ahead = [] if by_tma else self._merge([load_step(self, n, "ahead", dst) for n, dst in zip(loop_tiles, into)])
        loop_steps = [] if staged else self._merge([load_step(self, n) for n in loop_tiles])
        done: set = set()
        flashed = flash_values(self.plan, self.layout.flash)
        invariant = []  # values the loop reads but does not change: computed once, before it
        for n in looped:
            kind = OPS[n.op].kind
            if kind is Kind.ACCUMULATE:
                loop_steps += self.acc_steps(n, done)
            elif n.op != "tile" and self.plan.computed(n) and n not in flashed:
                (loop_steps if n in varying else invariant).append(self.compute_step(n))
        post = [n for n in body if n in after and OPS[n.op].kind is not Kind.ACCUMULATE]
        loop_steps = shared_operand(loop_steps)
        registers = [p for st in _walk(loop_steps) if st["kind"] == "warp_mma" for p in st["products"]]
        flash = [st for st in _walk(loop_steps) if st["kind"] == "flash"]
        late = {o["v"][0] for st in flash if st["defer"] for o in st["outs"]}  # read through the stage before
        staged = [st | {"late": st["cname"] in late} for st in staged]
        parts = [st for st in loop_steps if st["kind"] == "row_parts"]
        epilogue = [self.row_parts_store(st) for st in parts]
        epilogue += [st | {"kind": "warp_mma_store"} for st in registers]
        epilogue += [st | {"kind": "flash_store"} for st in flash]
        epilogue += self._merge([load_step(self, n) for n in post if n.op == "tile"])
        epilogue += [self.compute_step(n) for n in post if n.op != "tile" and self.plan.computed(n)]
        epilogue += [self.store_step(i) for i in range(len(k.stores)) if i not in self.plan.writes.values()]
        epilogue += self.finish_steps()

        pipelined = {st["cname"] for st in staged}
        buffers = [{"cname": self.cname[b.name] + ("_stages" if self.cname[b.name] in pipelined else ""),
                    "ctype": CTYPE[b.dtype], "offset": self.layout.offsets[b.name], "bytes": self.layout.sizes[b.name],
                    "scratch": b.role == "warps",  # a row-wise op's: used only where a row spans warps
                    "first": phase + self.layout.live[b.name][0], "last": phase + self.layout.live[b.name][1],
                    "comment": comment(f"{b.role} {b.name}: {list(self.shape(b))} {b.dtype}"
                                       + (f", {stages} stages" if self.cname[b.name] in pipelined else "")
                                       + f", {in_use(self.layout.live[b.name])}")}
                   for b in self.plan.buffers if b.name in self.layout.offsets]
        smem = self.layout.smem
        inputs = [f"const __grid_constant__ prism::TensorMap {m.param}" for m in maps]
        inputs += [f"const {CTYPE[storage(n)]}* __restrict__ g_{ident(tensor_name(n))}" for n in k.inputs]
        outputs = [f"{CTYPE[stored_dtype(k, i)]}* __restrict__ g_{ident(s.name)}" for i, s in enumerate(k.stores)]
        function = f"prism_{ident(k.name)}"
        summary = [comment(f"load {l.tile} = {tensor_name(k.inputs[l.source])}{l.map}") for l in k.loads]
        summary += [comment(f"store {s.name}{s.map}") for s in k.stores]
        for step in prologue + invariant + loop_steps + epilogue + ahead:
            step["async"] = _async(step)
        wgmma = any(t.orient == "wg" for t in self.layout.registers.values()) or any(f.wg for f in self.layout.flash.values())
        ctx = {"program": comment(self.program.name), "name": comment(k.name), "function": function, "wgmma": wgmma,
               "file": f"{ident(k.name)}.cu", "grid_text": " x ".join(f"{a}={g}" for a, g in c.grid) or "1",
               "loop": c.loop, "loop_end": self.loop_end(), "threads": self.threads, "smem": smem, "summary": summary,
               "order": block_names(self.k, dict(c.grid), self.config.sms) if self.blk == "blk_" else [],
               "params": inputs + outputs + sums.parameters(c), "inputs": inputs, "outputs": outputs, "phase": phase,
               "registers": registers, "parts": parts, "flash": flash, "stages": stages, "staged": staged, "ahead": ahead,
               "in_flight": self.layout.in_flight, "overlap": self.layout.overlap, "lead": self.layout.lead, "maps": maps,
               "tma": by_tma, "tma_bytes": sum(st["bytes"] for st in by_tma),
               "pingpong": self.layout.pingpong, "copy_warp": self.layout.copy_warp, "launched": self.layout.launched,
               "sync": self.sync,
               "mbarriers": self.layout.mbarriers, "real": self.real, "buffers": buffers, "prologue": prologue, "invariant": invariant, "body": loop_steps, "epilogue": epilogue}
        return ctx

    @staticmethod
    def _merge(steps: list[dict]) -> list[dict]:
        """Several loads as one step (they are independent; one barrier after all of them)."""
        return steps if len(steps) < 2 else [{"kind": "group", "steps": steps}]


def _walk(steps: list[dict]):
    for st in steps:
        yield st
        yield from _walk(st.get("steps", []))


def _async(step: dict) -> bool:
    """Whether a step issues cp.async copies (16-byte loads), which the kernel waits for before its barrier."""
    return (step["kind"] == "load" and step["cp"]) or any(_async(s) for s in step.get("steps", ()))


def render_kernel(c: Concrete, program: Program, config: CodegenConfig = CodegenConfig()) -> RenderedKernel:
    return Emitter(c, program, config).render()

