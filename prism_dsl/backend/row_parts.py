"""Row folds held in registers through a kernel's loop: each thread's part of a row accumulator.

Where it sits: a part of `codegen.Emitter` (a mixin, as `tensor_steps` is), for the accumulators that sum
whole rows (`acc_sum_last`, `acc_mean_last`, `acc_rms_last`, and `acc_var_last`'s merged deviations:
`Accumulator.row`, outside online softmax, whose rows share the running max: `held_in_registers`). Summed
each iteration by one warp per row (the lanes' sums added by five shuffles, the row's state in shared memory
read, added to and written back, a barrier after it), an RMSNorm folded into a projection costs that on every
iteration of its loop (at n = d = 4096, 16 rows a warp, each its own chain of shuffles) while the products
wait at the barrier.

So each thread keeps its part of a few rows in registers for the whole loop ("row_parts"): it reads its
elements of the iteration's tile, 8 at a time by one 16-byte load where every 16-bit tile the term reads
allows it (`prism::load8`), and adds them into its parts; no shuffle, no shared memory written, no barrier.
After the loop ("row_parts_store") the threads' parts of each row are added by shuffles once, and the sum
goes into the row's state by the accumulator's own `cuda_fold` (`part` is the row's sum), so the state and
what reads it after the loop are as before.

Which elements a thread takes: `per` threads share a row (a power of two up to a warp, and no more than the
row has 8-element groups, or elements), so `at_once` = threads / per rows are folded side by side, and a
thread holds `parts` = ceil(rows / at_once) of them. Where per >= 8, the 8 lanes of a 16-byte load's quarter
warp read adjacent groups of one row; below 8 they read the same group of 8 adjacent rows, which the
padding or swizzle of 16-bit tiles (`fusion.ROW_PAD`, wgmma's 128-byte swizzle) puts in different banks.
The lanes of a row are then `stride` = 1 or 8 apart, and the shuffles after the loop use those distances.

The variance (`acc_var_last`, a "welford" fold) keeps four parts a row: the count of elements the thread
read, their mean and the sum of their squared deviations about it, and a shift (the first element the
thread reads of the row) that the means are held less of. Each group (a 16-byte load's 8 elements, or one)
gives its own mean and deviations, merged into the running ones by Chan's formula (the difference of the
means squared, weighted by the counts; the weight by one reciprocal, `prism::recip`); after the loop the
lanes' are merged by the same formula across the shuffles (the shifts' difference taken apart from the
means'), their counts possibly unequal (a row's groups need not divide among its lanes). Means held less a
value of the row are differences of nearby values, not values far from zero rounded at their own magnitude,
and nothing subtracts two large sums (E[x^2] - E[x]^2 loses all accuracy on rows far from zero): an element
far from the rest, even the shift, costs about its distance in roundings, not its square.

A row-wise op of a tile (rms_norm, layer_norm, softmax: "row_groups") takes its rows the same way: `per`
threads a row, each reading its 8-element groups by 16-byte loads, a pass over the row for each statistic
(the max, the sum of squares...), its lanes' parts added by shuffles, then the pass that writes the row. One
thread a row, as it once was, read its row element by element (a padded 16-bit tile of rows of 128: lanes 4
banks apart, 4-way conflicts) and wrote it to an f32 buffer of rows of 128 words (every lane in one bank,
32-way conflicts).
"""

from __future__ import annotations

import math
import re

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import DType, Node
from ..ir.ops import OPS, Kind
from ..kernels.fusion import Place
from ..kernels.masking import given_end
from .ctext import decompose

VECTOR = 8  # 16-bit elements per 16-byte shared-memory load
HELD = 64  # a row-wise op's elements a thread holds in registers through its passes, at most


def held_in_registers(acc: Node) -> bool:
    """Whether the loop folds `acc` into per-thread parts: a row sum outside online softmax (every such
    accumulator of `ir.accumulators`; a row max would need its own fold and shuffles here)."""
    a = ACCUMULATORS[acc.op]
    return a.row and not a.online and a.cuda_reduce in ("sum", "welford")


class RowParts:
    """The "row_parts" and "row_parts_store" steps of an `Emitter` (which gives shape, read, plan, cname...)."""

    def caller_end(self, node: Node) -> int | None:
        """The size the caller gave of the dim `node`'s last dim is placed in, where it was built past it."""
        return given_end(self.k, node, -1, dict(self.config.ends))

    def past_end(self, node: Node, fill: float | None, term: str, col: str = "j") -> str:
        """`term`, or `fill` (a fold's identity, `Accumulator.past_end`) where element `col` of the last dim of
        `node` lies past the size the caller gave: a dim built past it (`kernels.masking`), placed in the whole
        tensor as a causal mask's dims are (`place`)."""
        end = None if fill is None else self.caller_end(node)
        if end is None:
            return term
        at, _ = self.place(node, -1)
        return f"({col}{at} < {end} ? {term} : {self.lit(fill) if math.isfinite(fill) else '-real(INFINITY)'})"

    def score(self, s: Node, idx: list[str]) -> str:
        """Online softmax's score `s` at `idx`, -inf past the size given (`past_end`)."""
        return self.past_end(s, -math.inf, self.read(s, idx))

    def row_parts(self, acc: Node, read=None, scale: str | None = None) -> dict:
        """One iteration's fold of `acc` into this thread's parts of its rows. Online softmax's row sum passes
        `read` (idx -> its term, exp(s - max) from the group's buffer) and `scale`, the buffer of each row's
        rescaling factor this iteration: every part is rescaled by it first (the sum is linear in its
        parts), and after the loop the parts' sum is the state (which starts at 0)."""
        a, x = ACCUMULATORS[acc.op], acc.args[0]
        shape = self.shape(x)
        rows, length = math.prod(shape[:-1]), shape[-1]
        leaves = None if read else self._vector_leaves(x, length)
        vec = VECTOR if leaves is not None else 1
        units = length // vec
        per = 1
        while per * 2 <= min(32, units) and rows * per * 2 <= self.threads:
            per *= 2
        stride = 1 if per >= 8 else 8
        at_once = self.threads // per
        lines, idx = decompose("row", shape[:-1], "i")
        vectors = self._loads(leaves or [], idx + ["j8"])
        self.held_in = {leaf: f"v{n}[c]" for n, leaf in enumerate(leaves or [])}
        try:
            term = read(idx + ["j"]) if read else self.past_end(x, a.past_end, a.cuda_term.format(
                *[self.read(arg, idx + ["j"]) for arg in acc.args]))
        finally:
            self.held_in = {}
        held = self.cname[self.held(acc).name]
        reg = "r_" + held.removeprefix("s_")
        finish = [f"{held}[row] += part;"] if scale else \
            [line.format(**{role: self.cname[b.name] for role, b in self.plan.state[acc].items()}) for line in a.cuda_fold]
        welford = a.cuda_reduce == "welford"
        if welford:  # the group's values first, then its mean and deviations merged into the running ones
            term = f"t[c] = {term};"
        return {"kind": "row_parts", "comment": self.describe(acc), "r": reg, "rows": rows, "length": length,
                "idx": lines, "per": per, "stride": stride, "at_once": at_once, "parts": -(-rows // at_once),
                "vec": vec, "units": units, "passes": -(-units // per), "vectors": vectors,
                "fold": term if welford else f"{reg}[q] += {term};", "welford": _welford(reg, vec) if welford else [],
                "init": self.lit(0.0), "column": bool(re.search(r"\bj\b", term)),
                "rescale": f"{reg}[q] *= {scale}[row];" if scale else "", "finish": finish,
                "barrier": False}  # it writes no shared memory

    def _vector_leaves(self, x: Node, length: int, own: bool = False,
                       partners: list[Node] | None = None, stop: Node | None = None) -> list[Node] | None:
        """The 16-bit shared tiles (or values) the term of `x` reads along the row, when every read of the term
        is at the element itself and 8 adjacent ones of each such buffer are one aligned 16-byte group: those
        the fold reads by `load8`. None: the fold reads element by element. `own`: `x` is the element-wise
        value being computed into its own buffer, so its operands are the term. `partners`, where given,
        takes RoPE's rotated operand too (its partner half a row away is a whole 16-byte group as well, where
        the half row is a multiple of 8): the tiles whose partner groups are read (`held_partner`). `stop`: a value
        held in registers (a row-wise op the chain `x` reads), not walked."""
        if length % VECTOR:
            return None
        leaves: list[Node] = []

        def rope(n: Node) -> bool:
            x = n.args[0]
            if partners is None or length // 2 % VECTOR or self.plan.place[x] is not Place.SMEM:
                return False
            if self.plan.buffer(x).dtype not in (DType.F16, DType.BF16) or self.shape(x)[-1] != length:
                return False
            partners.append(x)
            return all(walk(m) for m in n.args)

        def walk(n: Node) -> bool:
            if n is stop:
                return True
            place = self.plan.place[n]
            if place is Place.INLINE:
                return n.op == "const" or (OPS[n.op].kind in (Kind.UNARY, Kind.BINARY) and all(walk(m) for m in n.args)
                                           or n.op == "rope" and rope(n))
            if place is not Place.SMEM:
                return False
            b = self.plan.buffer(n)
            if b.dtype in (DType.F16, DType.BF16) and self.shape(n)[-1] == length and n not in leaves:
                leaves.append(n)
            return True

        if own:  # the operands of the value computed
            whole = (OPS[x.op].kind in (Kind.UNARY, Kind.BINARY) and all(walk(a) for a in x.args)
                     or x.op == "rope" and rope(x))
        else:
            whole = walk(x)
        return leaves if whole and leaves else None

    def _loads(self, tiles: list[Node], idx: list[str], prefix: str = "v") -> list[dict]:
        """The 16-byte loads (`load8`, into `{prefix}{n}`) of each 16-bit tile's 8 elements from index `idx`."""
        return [{"name": f"{prefix}{n}", "at": f"{self.cname[self.plan.buffer(t).name]} + "
                                               f"{self.offset(self.plan.buffer(t), idx)}"} for n, t in enumerate(tiles)]

    def vectored(self, node: Node, shape: tuple[int, ...],
                 own: bool) -> tuple[list[str], list[str], list[dict], str] | None:
        """`node`'s value at 8 adjacent elements of a row (`c` the element within them), where every 16-bit tile
        it reads along the row is read at the element itself (RoPE's partner group too): (the lines that place
        the first element `e`, its indices, the 16-byte loads, the value). None where that does not hold."""
        partners: list[Node] = []
        leaves = self._vector_leaves(node, shape[-1], own, partners) if self.config.vector_loads else None
        if leaves is None:
            return None
        lines, idx = decompose("e", shape, "i")
        half, last = shape[-1] // 2, idx[-1]
        other = idx[:-1] + [f"({last} < {half} ? {last} + {half} : {last} - {half})"]  # the partner group's first
        partners = list(dict.fromkeys(partners))
        vectors = self._loads(leaves, idx) + self._loads(partners, other, "p")
        self.held_in = {leaf: f"v{n}[c]" for n, leaf in enumerate(leaves)}
        self.held_partner = {x: f"p{n}[c]" for n, x in enumerate(partners)}
        try:
            value = self.read(node, idx[:-1] + [f"({last} + c)"]) if not own else \
                self.value(node, idx[:-1] + [f"({last} + c)"])
        finally:
            self.held_in, self.held_partner = {}, {}
        return lines, idx, vectors, value

    def vector_elements(self, node: Node, shape: tuple[int, ...], dst: str, b) -> dict | None:
        """An element-wise value computed into its buffer `b` (`dst`) 8 adjacent elements of a row a thread
        ("vector_elements", `vectored`): a 16-bit buffer written by one 16-byte store (`store16`), an f32 one by 8
        adjacent writes. None where `vectored` is (the element-at-a-time form then)."""
        found = self.vectored(node, shape, own=True)
        if found is None:
            return None
        lines, idx, vectors, value = found
        wide = b.dtype in (DType.F32, DType.F64)
        store = (f"for (int c = 0; c < {VECTOR}; ++c) {dst}[e + c] = w[c];" if wide
                 else f"prism::store16({dst} + {self.offset(b, idx, shape)}, w);")
        return {"kind": "vector_elements", "comment": f"{self.describe(node)}: 8 elements a thread, 16-byte loads",
                "units": math.prod(shape) // VECTOR, "vec": VECTOR, "idx": lines, "vectors": vectors, "value": value,
                "store": store}

    def rowwise(self, node: Node, dst: str | None, store: int | None = None) -> dict:
        """A row-wise op of the tile `node` into the f32 buffer `dst`, row by row ("row_groups"): `per` threads a
        row (as many as the row has 8-element groups, or elements, up to a warp; past a warp where the block has
        fewer rows than warps), a pass per statistic, each reduced over the row's lanes by shuffles (and over its
        warps through the op's scratch, `fusion.ROW_SCRATCH`), then the pass that writes. Every thread runs the
        same passes, shuffles and barriers (a row past the last reads row 0 and writes nothing), so each shuffle
        sees the whole warp. A thread that takes at most `HELD` elements of its row computes them once, into
        registers (`xr`), which the passes after read: the row's tiles are read from shared memory once, and the
        element-wise chain that makes the row (its prologue: softmax(x / t)) evaluated once. `dst` None: the op
        is stored whole, or an element-wise chain of it (`fusion.Place.STORED`), and the pass that writes puts
        each row of that straight into the kernel's output `store`, 8 elements by one 16-byte store where it is
        16-bit and the row is read 8 at a time."""
        x, shape = node.args[0], self.shape(node)
        rows, length = math.prod(shape[:-1]), shape[-1]
        leaves = self._vector_leaves(x, length)
        vec = VECTOR if leaves is not None else 1
        units = length // vec
        per = 1
        while per * 2 <= min(32, units):
            per *= 2
        while per >= 32 and per * 2 <= units and rows * per * 2 <= self.threads and self.threads % (per * 2) == 0:
            per *= 2  # fewer rows than warps: a row's groups over several warps, none idle
        stride, at_once, sweeps = (1 if per >= 8 else 8), self.threads // per, -(-units // per)
        lines, idx = decompose("row", shape[:-1], "i")
        self.held_in = {leaf: f"v{n}[c]" for n, leaf in enumerate(leaves or [])}
        try:
            xj = self.read(x, idx + ["j"])
        finally:
            self.held_in = {}
        vectors = self._loads(leaves or [], idx + ["j8"])
        fill = None
        if sweeps * vec <= HELD and sweeps <= 16:  # this thread's elements of the row, computed once (the sweeps
            # unrolled whole, so that they are registers, not a stack frame)
            held = f"xr[s * {vec} + c]" if vec > 1 else "xr[s]"
            fill = _pass("", "", [f"{held} = {xj};"]) | {"vectors": vectors, "size": sweeps * vec}
            xj = held
        passes, write = self._statistics(node, xj, idx, length)
        for p in passes:
            p["vectors"] = [] if fill else vectors
        self._across_warps(node, passes, max(1, per // 32))
        if dst is not None:
            out = _pass("", "", [f"{dst}[row * {length} + j] = {write};"])
        else:
            out = self._write_out(node, write, leaves or [], vec, idx, length, store)
        read_again = [v for v in vectors if any(re.search(rf"\b{v['name']}\[", line) for line in out["body"])]
        out["vectors"] = read_again if fill else vectors  # the chain after the op may read the row's tiles again
        return {"kind": "row_groups", "comment": self.describe(node), "rows": rows, "length": length, "idx": lines,
                "per": per, "stride": stride, "at_once": at_once, "parts": -(-rows // at_once), "vec": vec,
                "units": units, "sweeps": sweeps, "unroll": sweeps <= 16, "fill": fill, "passes": passes,
                "offsets": [o for k in range(1, per.bit_length()) if (o := stride * (per >> k)) < 32],
                "write": out}

    def _statistics(self, node: Node, xj: str, idx: list[str], length: int) -> tuple[list[dict], str]:
        """A row-wise op's passes over the row (`xj` its element j), one per statistic, and the value it writes."""
        eps = f" + {self.read(node.args[1], idx)}" if node.op in ("rms_norm_eps", "layer_norm") else ""
        inv = f"const real inv = real(1) / prism::sqrt_(ss / real({length}){eps});"
        if node.op in ("rms_norm", "rms_norm_eps"):
            return [_pass("ss", self.lit(0.0), [f"const real v = {xj};", "ss += v * v;"], "sum", (inv,))], \
                f"{xj} * inv"
        if node.op == "layer_norm":  # the mean first, then the variance around it (no cancellation)
            return [_pass("mu", self.lit(0.0), [f"mu += {xj};"], "sum", (f"mu /= real({length});",)),
                    _pass("ss", self.lit(0.0), [f"const real v = {xj} - mu;", "ss += v * v;"], "sum", (inv,))], \
                f"({xj} - mu) * inv"
        # softmax, the stable form
        return [_pass("mx", "-real(INFINITY)", [f"mx = prism::max_(mx, {xj});"], "max"),
                _pass("sum", self.lit(0.0), [f"sum += prism::exp_({xj} - mx);"], "sum")], \
            f"prism::exp_({xj} - mx) / sum"

    def _across_warps(self, node: Node, passes: list[dict], warps: int) -> None:
        """Where a row spans `warps` warps: after each pass's shuffles, each warp's value into the op's scratch, a
        barrier, then every thread combines its row's warps' values (each pass its own row of the scratch, so no
        thread overwrites what another has yet to read)."""
        if warps == 1:
            return
        scratch = self.cname[next(b for b in self.plan.buffers if b.node is node and b.role == "warps").name]
        for i, p in enumerate(passes):
            first, at = f"{scratch}[{i * 32} + g * {warps}]", f"{scratch}[{i * 32} + g * {warps} + w]"
            fold = f"{p['var']} += {at};" if p["reduce"] == "sum" else f"{p['var']} = prism::max_({p['var']}, {at});"
            p["cross"] = [f"if (PRISM_TID % PRISM_WARP == 0) {scratch}[{i * 32} + PRISM_TID / PRISM_WARP] = {p['var']};",
                          f"{self.sync};", f"{p['var']} = {first};", f"for (int w = 1; w < {warps}; ++w) {fold}"]

    def _write_out(self, node: Node, write: str, leaves: list[Node], vec: int, idx: list[str], length: int,
                   store: int) -> dict:
        """The pass that writes a `STORED` op's row straight to the output of store `store`: the op's value
        (`write`), or the element-wise chain of it the kernel stores, whose other 16-bit tiles along the row
        (RMSNorm's gain) are read 8 at a time too; one 16-byte store of 8 elements where the output is 16-bit."""
        value = self.k.stores[store].value
        more = [t for t in (self._vector_leaves(value, length, stop=node) or []) if t not in leaves] \
            if vec == VECTOR else []
        self.held_in = {leaf: f"v{n}[c]" for n, leaf in enumerate(leaves)} | {node: f"({write})"}
        self.held_in |= {leaf: f"u{n}[c]" for n, leaf in enumerate(more)}
        try:
            write = self.read(value, idx + ["j"])
        finally:
            self.held_in = {}
        name, ctype, _, where = self.store_target(store)
        loads = [line for u in self._loads(more, idx + ["j8"], "u")
                 for line in (f"float {u['name']}[8];", f"prism::load8({u['name']}, {u['at']});")]
        if vec == VECTOR and ctype in ("half", "__nv_bfloat16") and self.config.vector_loads \
                and self.c.output_shape(store)[-1] % VECTOR == 0:
            return _pass("", "", [f"w[c] = {write};"]) | {
                "pre": loads + [f"real w[{VECTOR}];"], "post": [f"prism::store16({name} + {where(idx + ['j8'])}, w);"]}
        return _pass("", "", [f"{name}[{where(idx + ['j'])}] = prism::from_f<{ctype}>({write});"]) | {"pre": loads}

    @staticmethod
    def row_parts_store(st: dict) -> dict:
        """After the loop: the parts of each row added across the threads that share it, into its state."""
        per, stride = st["per"], st["stride"]
        offsets = [stride * (per >> k) for k in range(1, per.bit_length())]
        used = [line for line in st["idx"] if any(re.search(rf"\b{line.split()[2]}\b", f) for f in st["finish"])]
        return st | {"kind": "row_parts_store", "offsets": offsets, "idx": used, "barrier": True}


def _welford(reg: str, vec: int) -> list[str]:
    """A group of `vec` values `t` (a 16-byte load's, or one) merged into a thread's parts of a row's variance by
    Chan's formula: its mean and squared deviations about it, then the running count (`{reg}_n`), mean (`{reg}_mu`)
    and squared deviations (`{reg}`) moved by the difference of the two means, weighted by the counts. Means are
    held less the thread's shift (`{reg}_k`, the first value it reads of the row), so they are differences of
    nearby values, not values far from zero rounded at their own magnitude."""
    return [f"if ({reg}_n[q] == 0) {reg}_k[q] = t[0];",
            "real gs = 0;",
            "PRISM_UNROLL",
            f"for (int c = 0; c < {vec}; ++c) {{ t[c] -= {reg}_k[q]; gs += t[c]; }}",
            f"const real gm = gs * real({1 / vec!r});",
            "real g2 = 0;",
            "PRISM_UNROLL",
            f"for (int c = 0; c < {vec}; ++c) g2 += (t[c] - gm) * (t[c] - gm);",
            f"const real nn = {reg}_n[q] + real({vec}), w = real({vec}) * prism::recip(nn), dl = gm - {reg}_mu[q];",
            f"{reg}[q] += g2 + dl * dl * {reg}_n[q] * w;",
            f"{reg}_mu[q] += dl * w;",
            f"{reg}_n[q] = nn;"]


def _pass(var: str, init: str, body: list[str], reduce: str | None = None, after: tuple[str, ...] = ()) -> dict:
    """One pass of a "row_groups" step over its row: `body` folds each element into `var`, the row's lanes'
    values of it are combined by `reduce` ("sum" or "max"), then `after` runs on every lane (the pass that
    writes: `body` alone)."""
    fold = {"sum": f"{var} += prism::shfl_xor({var}, {{}});", None: "",
            "max": f"{var} = prism::max_({var}, prism::shfl_xor({var}, {{}}));"}[reduce]
    return {"var": var, "init": init, "body": body, "fold": fold, "after": after, "reduce": reduce, "cross": [],
            "pre": [], "post": [], "column": any(re.search(r"\bj\b", line) for line in body)}
