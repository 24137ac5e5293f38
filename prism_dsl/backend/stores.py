"""A kernel's stores: each block's tile written to device memory, and sums across blocks finished in the launch.

Where it sits: a part of `codegen.Emitter` (a mixin, as `tensor_steps` and `row_parts` are). A store writes the
block's tile at its place in the output, 8 16-bit elements a thread by one 16-byte store where the rows allow.
A store that some grid axis does not write (`+=`) adds each element with an atomic, into the store's workspace
(`sums`), and the tile's last block to finish stores the sums once, in the output's type (`finish_steps`).
"""

from __future__ import annotations

import math
from functools import partial

from ..kernels.kernel import SUM, stored_dtype
from ..kernels.masking import callers_shape
from ..lang.printer import node_text
from . import sums
from .copies import in_place
from .ctext import C_OPS, CTYPE, address, comment, decompose, ident, tensor_name


class StoreSteps:
    """The store steps of `codegen.Emitter` (which gives `k`, `c`, `blk`, `config`, `read`, `describe`, `elements`
    and `vectored`)."""

    def store_target(self, index: int):
        """Store `index`'s output: (its C name, its element type, the block's tile of it, and where element `idx` of
        the tile goes, as a function of `idx`)."""
        out = self.c.output_shape(index)
        return (f"g_{ident(self.k.stores[index].name)}", CTYPE[stored_dtype(self.k, index)], self.store_tile(index),
                lambda idx: address(self.placed(index, idx), out))

    def store_tile(self, index: int) -> tuple[int, ...]:
        grid = dict(self.c.grid)
        return tuple(s // grid[dm.axis] if dm.axis else s for s, dm in zip(self.c.output_shape(index),
                                                                            self.k.stores[index].map.dims))

    def placed(self, index: int, idx) -> list[list[str]]:
        """Where element `idx` of the block's tile of store `index` sits in the whole output, dim by dim (`address`'s
        parts)."""
        grid, dims = dict(self.c.grid), self.k.stores[index].map.dims
        return [([f"{self.blk}{dm.axis} * {t}"] if dm.axis and grid[dm.axis] > 1 else []) + ([i] if i != "0" else [])
                for t, dm, i in zip(self.store_tile(index), dims, idx)]

    def stored(self, index: int, value: str, idx) -> str:
        """What store `index` writes at element `idx` of the block's tile: `value` (the tile's value, or the finished
        sum), or its `then` over it (`kernels.finishing`), which reads the other tensors at that element; one read in
        place (`copies.in_place`) is read at the caller's sizes, guarded past them (0 there: elements the launcher
        cuts)."""
        then = self.k.stores[index].then
        if then is None:
            return value
        at, ends = self.placed(index, idx), dict(self.config.ends)

        def text(n) -> str:
            if n.op == "const":
                return self.lit(n.attr)
            if n.op == "input" and n.attr == SUM:
                return value
            if n.op != "input":
                return C_OPS[n.op].format(*[text(a) for a in n.args])
            built = self.c.shape(n)
            shape = callers_shape(n, self.c.binding, ends) if in_place(n, self.config) else built
            parts = [[] if size == 1 else p for p, size in zip(at[len(at) - len(built):], built)]
            read = f"prism::to_f(g_{ident(tensor_name(n))}[{address(parts, shape)}])"
            past = [f"{' + '.join(p)} < {size}" for p, size, b in zip(parts, shape, built) if p and size < b]
            return f"({' && '.join(past)} ? {read} : real(0))" if past else read
        return text(then)

    def store_step(self, index: int) -> dict:
        store, out = self.k.stores[index], self.c.output_shape(index)
        name, ctype, tile, where = self.store_target(index)
        atomic = bool(sums.summed_axes(self.c, index))
        # a sum across blocks adds into its workspace, which the tile's last block stores (`sums`; f64: the output)
        into = partial(sums.sum_target, self.c, index) if sums.finished(self.c, index) else f"{name}[{{}}]".format

        def body(idx):
            v = self.read(store.value, idx)
            return [f"prism::atomic_add(&{into(where(idx))}, {v});" if atomic else
                    f"{name}[{where(idx)}] = prism::from_f<{ctype}>({self.stored(index, v, idx)});"]

        text = comment(f"store {store.name}{store.map} {'+=' if store.add else '='} {self.describe(store.value)}"
                       + (f", then {then_text(store.then)}" if store.then is not None else ""))
        finished = atomic and sums.finished(self.c, index)
        # elements a 16-byte store writes; a finished sum's 4 adds of f32 into its workspace by one 16-byte reduction
        vec = 4 if finished else 16 // stored_dtype(self.k, index).bytes
        if ((atomic or store.then is not None) and not finished or not self.config.vector_loads
                or tile[-1] % vec or out[-1] % vec):
            return self.elements(tile, body, text)
        # vec adjacent elements of a row by one 16-byte store: the row's start, the tile's and each group's are
        # multiples of vec, and the runtime's tensors are 16-byte aligned (`cuda_runtime`, ALIGNMENT)
        found = self.vectored(store.value, tile, own=False) if vec == 8 else None
        lines, idx = decompose("e", tile, "i")
        vectors, value = found[2:] if found else ([], self.read(store.value, idx[:-1] + [f"({idx[-1]} + c)"]))
        how, write = ((f"{vec} sums a thread, one 16-byte atomic add", f"prism::atomic_add4(&{into(where(idx))}, w);")
                      if finished else (f"{vec} elements a thread, one 16-byte store",
                                        f"prism::store16({name} + {where(idx)}, w);"))
        return {"kind": "vector_elements", "comment": f"{text}: {how}", "units": math.prod(tile) // vec, "vec": vec,
                "idx": lines, "vectors": vectors, "value": value, "store": write}

    def finish_steps(self) -> list[dict]:
        """The steps that finish each group of sums across blocks (`sums`): the tile's last block to take its ticket
        stores the tile's sums in the output's type, and zeroes them for the next launch."""
        c, steps = self.c, []
        for g in sums.groups(c):
            inner = []
            for i in g.stores:
                name, ctype, tile, where = self.store_target(i)

                def body(idx, i=i, name=name, ctype=ctype, where=where):
                    sum_at = sums.sum_target(c, i, where(idx))
                    total = self.stored(i, f"prism::load_sum(&{sum_at})", idx)
                    return [f"{name}[{where(idx)}] = prism::from_f<{ctype}>({total});", f"{sum_at} = 0.0f;"]
                inner.append(self.elements(tile, body, f"{c.kernel.stores[i].name}'s tile: the sums, then zero"))
            steps.append({"kind": "finish", "ticket": sums.ticket_index(c, g, self.blk), "pieces": g.pieces, "steps": inner,
                          "comment": f"the last of the tile's {g.pieces} blocks (summed over {', '.join(g.axes)}) stores "
                                     "the sums every block of the tile has added"})
        return steps


def then_text(then) -> str:
    """A store's `then` as the program would write it, the sum as `sum`."""
    return node_text(then, {n: "sum" if n.attr == SUM else n.attr for n in then.walk() if n.op == "input"})

