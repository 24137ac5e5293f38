"""The code generator's tensor-core steps: products on wmma tiles, register-tiled products, online softmax.

Where it sits: a part of `codegen.Emitter` (it inherits these), kept apart because each step here has
its own shape in templates/steps.j2 and its own layout decision in `launch`:

- "mma": a product into a shared buffer on wmma tiles, one warp per output tile (`launch.mma_shape`);
- "mmarows": a product of a few rows (8 at most: the scores and `p @ v` at decode) as S^T = b^T @ a^T on
  m16n8k16 tiles, b's columns the tiles' rows and a's rows their 8 columns (`dots.row_mma`);
- "warp_mma": a loop's `acc_sum(a @ b)` with the accumulators in registers for the whole loop
  (`warp_mma.Tiling`: mma.sync fed by ldmatrix, or wgmma from the swizzled tiles, "wg"), written to its
  state after the loop ("warp_mma_store"); those with the
  same left operand and layout become one step at the end of the loop body (`shared_operand`), which
  loads that operand's fragments once for all of them;
- "flash": online softmax over scores s = q @ kt (or causal(q @ kt), masked there), the scores, their
  exp and every state in registers
  and `p @ v` fed to the next mma from registers (`warp_mma.Flash`, FlashAttention-2's dataflow), the
  states written after the loop ("flash_store"); on wgmma with `launch.overlap`, `p @ v` runs one iteration
  late ("defer"), beside the next iteration's softmax, the last one after the loop ("flash_tail"). The
  running max moves only where a row's scores pass it by more than `prism::kLazyMax` ("lazy"), so the
  outputs are rescaled only then, unless the max is itself stored (`acc_max_last`: it must be exact).

An "mma" or "mmarows" step keeps the plain form of its work beside it (`plain`), the path for GPUs without tensor
cores. "warp_mma" and "flash" have none: their states are written only after the loop, in bytes the
loop's buffers also use (`kernels.lifetimes`), and online softmax's scores and exp have no shared buffer
(`launch.unbuffered`); their kernels need sm_80, and `--no-tensor-cores` writes the plain form.
"""

from __future__ import annotations

import math

from ..ir.accumulators import ACCUMULATORS, RUNNING_MAX
from ..ir.nodes import Node
from ..kernels.fusion import Plan
from .ctext import CTYPE, comment, decompose, ident
from .launch import mma_shape, scores_product, stage_elements, stored_operand, uses_tensor_cores


class TensorCoreSteps:
    """Methods of `codegen.Emitter` (which provides plan, layout, shape, cname, pad, names, describe)."""

    def _mma(self, a: Node, b: Node, shape, dst: str, accumulate: bool, text: str) -> dict | None:
        if not self.config.tensor_cores or self.real != "float":
            return None
        if not uses_tensor_cores(a, b, self.plan, self.shape):
            return None
        ba = self.plan.buffer(a)
        sa, sb = self.shape(a), self.shape(b)
        m, k, n = sa[-2], sa[-1], sb[-1]
        frag = mma_shape(m, n, k)
        self.tensor_core_steps += 1
        return {"kind": "mma", "comment": text, "fm": frag[0], "fn": frag[1], "m": m, "k": k, "ncols": n,
                "a": self.cname[ba.name], "c": dst, "ab": CTYPE[ba.dtype], "lda": k + self.pad[ba.name],
                **self._right(b), "accumulate": accumulate}

    def keys_on_tensor_cores(self, a: Node | None, read_a, b: Node, shape: tuple[int, ...], length: int,
                             plain: dict) -> dict:
        """plain's dst = start + a @ b as S^T = b^T @ a^T on m16n8k16 tiles (`dots.row_mma`): each warp takes 16
        keys (b's columns: a transposed tile's rows by ldmatrix, or a tile's columns by ldmatrix.trans) of one
        leading index at a time against a's rows as the tile's 8 columns (two 16-bit elements a word: straight from
        a's buffer, or `read_a`'s values rounded to b's type where `a` is None), each output then written as `plain`
        writes it (its start, its index names); `plain` is also the path for targets without tensor cores."""
        rows = b.op == "transpose"
        tile = b.args[0] if rows else b
        lead, m, keys = shape[:-2], shape[-2], shape[-1]
        lines, at = decompose("p", lead, "j") if lead else ([], [])
        tbuf = self.plan.buffer(tile)
        ctype = CTYPE[tbuf.dtype]
        place = (["(key0 + lane % 16)", "(kk + lane / 16 * 8)"] if rows  # row, column of this lane's 8 elements
                 else ["(kk + lane / 16 * 8 + lane % 8)", "(key0 + lane / 8 % 2 * 8)"])
        if a is not None:  # where rows are permuted too (xor_rows), each pair's own offset
            abuf = self.plan.buffer(a)
            pairs = [f"*reinterpret_cast<const uint32_t*>(&{self.cname[abuf.name]}"
                     f"[{self.offset(abuf, at + ['g', col], self.shape(a))}])"
                     for col in ("(kk + 2 * t)", "(kk + 2 * t + 8)")]
        else:
            pairs = [f"prism::pack2<{ctype}>({read_a(at + ['g', f'(kk + 2 * t + {i})'])}, "
                     f"{read_a(at + ['g', f'(kk + 2 * t + {i + 1})'])})" for i in (0, 8)]
        self.tensor_core_steps += 1
        return {"kind": "mmarows", "comment": plain["comment"], "plain": plain, "T": ctype, "m": m, "nkeys": keys,
                "length": length, "tiles": math.prod(lead) * keys // 16, "idx": lines, "trans": not rows,
                "kt": f"{self.cname[tbuf.name]} + {self.offset(tbuf, at + place, self.shape(tile))}", "pairs": pairs,
                "rounded": a is None, "out": f"p * {m * keys}" if lead else "0"}

    def causal_fragment(self, s: Node) -> dict:
        """Where the scores' rows and columns sit in the whole tensors (C terms added to a fragment
        element's row and column in the tile) and the diagonal's offset, for masking in registers."""
        (row, rows), (col, cols) = self.place(s, -2), self.place(s, -1)
        return {"row": row, "col": col, "offset": cols - rows, "n": self.shape(s)[-1]}

    def past_fragment(self, s: Node) -> dict | None:
        """Where the scores' columns sit in the whole tensor and the size the caller gave of it, where it was built
        past that size (`kernels.masking`): the columns past it are masked in registers; None elsewhere."""
        end = self.caller_end(s)  # `RowParts`
        return None if end is None else {"col": self.place(s, -1)[0], "end": end, "n": self.shape(s)[-1]}

    def _right(self, b: Node) -> dict:
        """A product's right operand: its shared buffer, that buffer's row stride, and whether it holds
        the operand transposed ("bt": rows are the product's columns)."""
        tile, transposed = stored_operand(b)
        buf = self.plan.buffer(tile)
        return {"b": self.cname[buf.name], "ldb": self.shape(tile)[-1] + self.pad[buf.name], "bt": transposed,
                "xb": self._xor(buf, self.shape(tile)[-1])}

    def _xor(self, buf, cols: int) -> int:
        """The row length of a tile whose rows' 16-byte chunks are permuted (`launch.xor_rows`), else 0: the
        template's ldmatrix addresses permute them as `ctext.xor_column` does."""
        return cols if buf.name in self.layout.xor_rows else 0

    def warp_mma(self, acc: Node, dst: str, text: str) -> dict:
        """acc += a @ b into registers, each warp its own tiles (see `warp_mma`); `dst` its state after the loop."""
        a, b = acc.args[0].args
        ba = self.plan.buffer(a)
        self.tensor_core_steps += 1
        held = self.held(acc)
        product = {"comment": text, "t": self.registers[acc], "acc": "r_" + dst[2:], "c": dst, "in_flight": self.layout.in_flight,
                   "ldc": self.shape(acc)[-1] + self.pad[held.name],
                   "every_warp": self.threads == 32 * self.registers[acc].warps,
                   "a": self.cname[ba.name], "ab": CTYPE[ba.dtype], "lda": self.shape(a)[-1] + self.pad[ba.name],
                   "xa": self._xor(ba, self.shape(a)[-1]), **self._right(b)}
        return {"kind": "warp_mma", **product, "products": [product]}

    def flash(self, s: Node) -> dict:
        """Online softmax over s = q @ kt with s, p and the states in registers (`warp_mma.Flash`), for every
        accumulator that folds s; the same step as "flash_store" writes the states after the loop."""
        m = scores_product(s, self.plan)
        f, (q, kt), users = self.layout.flash[s], m.args, self.plan.users[s]
        reg = "f_" + ident(self.plan.buffer(s).name)

        def tile(n: Node) -> tuple[str, int, int]:
            b = self.plan.buffer(n)
            return self.cname[b.name], self.shape(n)[-1] + self.pad[b.name], self._xor(b, self.shape(n)[-1])
        outs = [{"r": f"{reg}_o{j}", "v": tile(u.args[1]), "c": self.cname[self.held(u).name],
                 "ldc": self.shape(u)[-1] + self.pad[self.held(u).name], **self._stage_of(u.args[1])}
                for j, u in enumerate(u for u in users if ACCUMULATORS[u.op].like == "matmul")]
        sums = [self.cname[self.held(u).name] for u in users if ACCUMULATORS[u.op].row and u.op != RUNNING_MAX]
        self.tensor_core_steps += 1
        text = comment(f"online softmax over {self.describe(s)}, folded by "
                       + ", ".join(self.names.get(u, u.op) for u in users))
        right = self._right(kt)
        return {"kind": "flash", "comment": text, "f": f, "r": reg, "q": tile(q), "k": (right["b"], right["ldb"], right["xb"]),
                "kt": right["bt"], "causal": self.causal_fragment(s) if s is not m else None, "past": self.past_fragment(s),
                "ab": CTYPE[self.plan.buffer(q).dtype], "outs": outs, "sums": sums,
                "m": self.cname[self.plan.groups[s]["m"].name], "defer": self.layout.overlap and f.wg and bool(outs),
                "lazy": lazy_max(s, self.plan, {st.value for st in self.c.kernel.stores}),
                "every_warp": self.threads == 32 * f.warps, "turns": self.layout.stages if self.layout.pingpong else 0}

    def _stage_of(self, v: Node) -> dict:
        """Where a pipelined loop tile's stage of the iteration before ("prev") and of the last iteration
        ("last", after the loop) start: what a `p @ v` run one iteration late reads (`launch.overlap`)."""
        if not self.layout.overlap:
            return {}
        b, stages = self.plan.buffer(v), self.layout.stages
        base, stride = self.cname[b.name] + "_stages", stage_elements(self.layout, b)
        bound = "loop_end" if self.loop_end() else str(self.c.loop)
        return {"prev": f"{base} + (it + {stages - 1}) % {stages} * {stride}",
                "last": f"{base} + ({bound} - 1) % {stages} * {stride}"}


def lazy_max(s: Node, p: Plan, stored: set[Node]) -> bool:
    """Whether online softmax over `s` in registers may move its running max lazily (`prism::kLazyMax`). Its
    outputs and sum are then taken against a max up to kLazyMax under the true one, which only their quotient
    does not see: so no running max folds s (acc_max_last: its value must be exact), and each output and the
    sum are read only by divisions of an output by the sum, never stored or read otherwise."""
    folds = p.users[s]
    if any(u.op == RUNNING_MAX or u in stored for u in folds):
        return False
    return all(r.op == "div" and r.args[0] in folds and r.args[1] in folds and ACCUMULATORS[r.args[0].op].like == "matmul"
               and ACCUMULATORS[r.args[1].op].row for u in folds for r in p.users[u])


def shared_operand(steps: list[dict]) -> list[dict]:
    """A loop body with its register-tiled products last, and those that read the same left operand with the
    same layout (a gated MLP's gate and up projections of one tile of x) as one step whose "products" run on
    the same fragments of `a`. The order is free: such a product writes only its registers, which no step
    of the loop reads, and every buffer it reads was written by an earlier step or load."""
    out = [st for st in steps if st["kind"] != "warp_mma"]
    for st in (st for st in steps if st["kind"] == "warp_mma"):
        prev = out[-1] if out else None
        if prev is not None and prev["kind"] == "warp_mma" and all(prev[f] == st[f] for f in ("a", "lda", "ab", "t")):
            out[-1] = prev | {"products": prev["products"] + st["products"]}
        else:
            out.append(st)
    return out
