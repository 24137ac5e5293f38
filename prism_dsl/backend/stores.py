"""A kernel's stores: each block's tile written to device memory, and sums across blocks finished in the launch.

Where it sits: a part of `codegen.Emitter` (a mixin, as `tensor_steps` and `row_parts` are). A store writes the
block's tile at its place in the output, 8 16-bit elements a thread by one 16-byte store where the rows allow.
A store that some grid axis does not write (`+=`) adds each element with an atomic, into the store's workspace
(`sums`), and the tile's last block to finish stores the sums once, in the output's type (`finish_steps`).
"""

from __future__ import annotations

import math
from functools import partial

from ..kernels.kernel import stored_dtype
from . import sums
from .ctext import CTYPE, address, comment, decompose, ident


class StoreSteps:
    """The store steps of `codegen.Emitter` (which gives `k`, `c`, `blk`, `config`, `read`, `describe`, `elements`
    and `vectored`)."""

    def store_target(self, index: int):
        """Store `index`'s output: (its C name, its element type, the block's tile of it, and where element `idx` of
        the tile goes, as a function of `idx`)."""
        store, out, grid = self.k.stores[index], self.c.output_shape(index), dict(self.c.grid)
        tile = tuple(s // grid[dm.axis] if dm.axis else s for s, dm in zip(out, store.map.dims))

        def where(idx) -> str:
            return address([([f"{self.blk}{dm.axis} * {t}"] if dm.axis and grid[dm.axis] > 1 else [])
                            + ([i] if i != "0" else []) for t, dm, i in zip(tile, store.map.dims, idx)], out)
        return f"g_{ident(store.name)}", CTYPE[stored_dtype(self.k, index)], tile, where

    def store_step(self, index: int) -> dict:
        store, out = self.k.stores[index], self.c.output_shape(index)
        name, ctype, tile, where = self.store_target(index)
        atomic = bool(sums.summed_axes(self.c, index))
        # a sum across blocks adds into its workspace, which the tile's last block stores (`sums`; f64: the output)
        into = partial(sums.sum_target, self.c, index) if sums.finished(self.c, index) else f"{name}[{{}}]".format

        def body(idx):
            v = self.read(store.value, idx)
            return [f"prism::atomic_add(&{into(where(idx))}, {v});" if atomic else
                    f"{name}[{where(idx)}] = prism::from_f<{ctype}>({v});"]

        text = comment(f"store {store.name}{store.map} {'+=' if store.add else '='} {self.describe(store.value)}")
        vec = 16 // stored_dtype(self.k, index).bytes  # elements a 16-byte store writes
        if atomic or not self.config.vector_loads or tile[-1] % vec or out[-1] % vec:
            return self.elements(tile, body, text)
        # vec adjacent elements of a row by one 16-byte store: the row's start, the tile's and each group's are
        # multiples of vec, and the runtime's tensors are 16-byte aligned (`cuda_runtime`, ALIGNMENT)
        found = self.vectored(store.value, tile, own=False) if vec == 8 else None
        lines, idx = decompose("e", tile, "i")
        vectors, value = found[2:] if found else ([], self.read(store.value, idx[:-1] + [f"({idx[-1]} + c)"]))
        return {"kind": "vector_elements", "comment": f"{text}: {vec} elements a thread, one 16-byte store",
                "units": math.prod(tile) // vec, "vec": vec, "idx": lines, "vectors": vectors, "value": value,
                "store": f"prism::store16({name} + {where(idx)}, w);"}

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
                    return [f"{name}[{where(idx)}] = prism::from_f<{ctype}>(prism::load_sum(&{sum_at}));",
                            f"{sum_at} = 0.0f;"]
                inner.append(self.elements(tile, body, f"{c.kernel.stores[i].name}'s tile: the sums, then zero"))
            steps.append({"kind": "finish", "ticket": sums.ticket_index(c, g, self.blk), "pieces": g.pieces, "steps": inner,
                          "comment": f"the last of the tile's {g.pieces} blocks (summed over {', '.join(g.axes)}) stores "
                                     "the sums every block of the tile has added"})
        return steps
