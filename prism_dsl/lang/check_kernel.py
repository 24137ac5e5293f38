"""Checking a `kernel` declaration inside a program: maps, tile shapes, phases, stores.

Called by `check.Checker` for each kernel in a program body. Errors go to the checker's Collector with
their file:line:col like every other error. The result is a `kernels.kernel.Kernel` whose outputs enter the
program's environment as `kernel` nodes, so later statements, kernels and `return` use them by name.

Phases are inferred, not declared: a value that depends on a tile the loop splits changes every
iteration (the loop body); an accumulator folds such a value over the loop; values computed from
accumulators (and from tiles the loop does not split) exist after the loop. Mixing the two phases in one
op, storing a value that still changes per iteration, or accumulating one that does not are errors.
"""

from __future__ import annotations

import sympy

from . import syntax_tree as ast
from ..base.errors import Loc
from ..ir.nodes import Node, dim_symbol
from ..kernels.kernel import AXES, ONE, DimMap, Kernel, Load, Store, TileMap, after_loop, loop_varying, output_shape, tile_shape
from ..ir.ops import BLOCK_CALLABLE, KERNEL_RANK, OPS, Kind
from ..ir.shapes import fmt_shape, same
from ..kernels.pieces import Classes, added_by_blocks, combined_by, over_the_loop, stored_by_blocks
from .scope import POISON, unknown_name
from .syntax import suggest


class _KernelCheck:
    """One kernel declaration checked for the program `checker` (a `check.Checker`) whose names are `env`."""

    def __init__(self, checker, decl: ast.KernelDecl, env: dict):
        self.c, self.decl, self.env = checker, decl, env
        self.errors = checker.errors
        self.error = checker.errors.error
        self.before = len(self.errors.diagnostics)
        self.storing = False  # checking a store's map (the loop cannot appear there)
        self.named_axes: set[str] = set()  # axes the grid names, valid sizes or not (no knock-on errors)
        # Where each body node of this kernel is written. Nodes are interned, so the same expression in
        # two kernels is one node; the program-wide table would point errors at the first kernel.
        self.where: dict[Node, Loc] = {}

    def expr(self, e: ast.Expr, local: dict):
        """`e` checked, each node it builds placed where this kernel writes it (`where`): an accumulator inside a
        store's expression is pointed at, not the kernel."""
        outer, self.c.locs = self.c.locs, {}
        calls, self.c.calls = self.c.calls, {}  # a def's value remembered elsewhere would not be placed here
        try:
            return self.c.expr(e, local, defs_stack=())
        finally:
            built, self.c.locs, self.c.calls = self.c.locs, outer, calls
            for node, loc in built.items():
                self.where.setdefault(node, loc)
                outer.setdefault(node, loc)

    def ok(self) -> bool:
        return len(self.errors.diagnostics) == self.before

    # -- header -------------------------------------------------------------------------------------

    def size(self, s: ast.Size, what: str) -> sympy.Expr | None:
        if isinstance(s.value, int):
            if s.value < 1:
                self.error(s.loc, f"{what} must be at least 1, got {s.value}")
                return None
            return sympy.Integer(s.value)
        if s.value in self.c.scope.dims:
            self.c.used_dims.add(s.value)
        # Any other name is a kernel symbol, chosen at instantiation; the same name is the same symbol in
        # every kernel of the program.
        return dim_symbol(s.value)

    def grid(self) -> list[tuple[str, sympy.Expr]]:
        grid: dict[str, sympy.Expr] = {}
        for axis, size, loc in self.decl.grid:
            if axis not in AXES:
                self.error(loc, f"unknown grid axis '{axis}' (the axes are x, y and z)")
                continue
            if axis in self.named_axes:
                self.error(loc, f"grid axis '{axis}' is given twice")
                continue
            self.named_axes.add(axis)
            value = self.size(size, f"the size of grid axis {axis}")
            if value is not None:
                grid[axis] = value
        return [(a, grid[a]) for a in AXES if a in grid]

    # -- maps ---------------------------------------------------------------------------------------

    def dim_map(self, e: ast.MapEntry, loop_ok: bool, seen: set[str]) -> DimMap | None:
        if not e.names:
            return DimMap()
        *first, last = e.names
        axis, loop = None, False
        if first:
            if first[0] not in AXES or last != "loop":
                self.error(e.loc, f"'{'*'.join(e.names)}' is not a map entry: write AXIS*loop, e.g. x*loop")
                return None
            axis, loop = first[0], True
        elif last == "loop":
            loop = True
        elif last in AXES:
            axis = last
        else:
            hint = suggest(last, set(AXES) | {"loop"}) or "; a map entry is ':', x, y, z, loop or AXIS*loop"
            self.error(e.loc, f"'{last}' is not a grid axis or 'loop'{hint}")
            return None
        if loop and not loop_ok:
            self.error(e.loc, "'loop' here, but " + ("a store's map cannot use the loop" if self.storing
                                                      else f"kernel '{self.decl.name}' has no loop(...)"))
            return None
        if axis is not None and axis not in self.named_axes:
            self.error(e.loc, f"grid axis '{axis}' is not in the grid of kernel '{self.decl.name}'")
            return None
        for name in ([axis] if axis else []) + (["loop"] if loop else []):
            if name in seen:
                self.error(e.loc, f"'{name}' splits two dims of one tile; it can split one")
                return None
            seen.add(name)
        return DimMap(axis, loop)

    def tile_map(self, entries, loop_ok: bool) -> TileMap | None:
        seen: set[str] = set()
        dims = [self.dim_map(e, loop_ok, seen) for e in entries]
        return None if any(d is None for d in dims) else TileMap(tuple(dims))

    # -- the kernel ---------------------------------------------------------------------------------

    def run(self) -> None:
        decl = self.decl
        if decl.name in self.c.kernel_names:
            self.error(decl.loc, f"duplicate kernel '{decl.name}'", f"first declared at {self.c.kernel_names[decl.name]}")
        self.c.kernel_names.setdefault(decl.name, decl.loc)
        grid = self.grid()
        loop = self.size(decl.loop, "the loop range") if decl.loop is not None else None
        if self.parameter(loop) is not None and (same_as := [a for a, g in grid if g == loop]):
            self.error(decl.loop.loc, f"'{loop}' is both the loop range and the size of grid axis {same_as[0]}: the "
                       "loop's pieces and the blocks' would be cut alike, and a tile split by one would pass for one "
                       "split by the other; give each its own name")
        shell = Kernel(decl.name, tuple(grid), loop, (), (), ())  # for tile shapes while checking
        sources: list[Node] = []
        loads: list[Load] = []
        local: dict = {}
        stores: list[tuple[ast.StoreStmt, Node, TileMap]] = []
        stored: set[str] = set()
        old_callable, self.c.callable = self.c.callable, BLOCK_CALLABLE
        try:
            for stmt in decl.body:
                if isinstance(stmt, ast.LoadStmt):
                    self.load(stmt, shell, loop is not None, sources, loads, local)
                elif isinstance(stmt, ast.Stmt):
                    value = self.expr(stmt.expr, local)
                    if stmt.name in local:
                        self.error(stmt.loc, f"'{stmt.name}' is already defined in kernel '{decl.name}'")
                    local[stmt.name] = value
                    if isinstance(value, Node) and value.op not in ("tile", "const"):
                        self.c.names.setdefault(value, stmt.name)
                        self.c.locs.setdefault(value, stmt.expr.loc)
                        self.where.setdefault(value, stmt.expr.loc)
                else:
                    self.storing = True
                    value = self.expr(stmt.expr, local)
                    tmap = self.tile_map(stmt.entries, loop_ok=False)
                    self.storing = False
                    if stmt.name in stored:
                        self.error(stmt.loc, f"'{stmt.name}' is stored twice; every name is assigned once")
                    stored.add(stmt.name)
                    if isinstance(value, Node):
                        self.where.setdefault(value, stmt.expr.loc)
                    if isinstance(value, Node) and tmap is not None:
                        stores.append((stmt, value, tmap))
        finally:
            self.c.callable = old_callable
        if not any(isinstance(stmt, ast.StoreStmt) for stmt in decl.body):
            self.error(decl.loc, f"kernel '{decl.name}' stores nothing; add 'store NAME[map] = value'")
        if not self.ok() or len(stores) < len(stored):  # (a value from a kernel that failed: said there, not here)
            return self.poison_outputs()
        kernel = Kernel(decl.name, tuple(grid), loop, tuple(loads), (), tuple(sources))
        checked = [s for s in (self.store(stmt, value, tmap, kernel) for stmt, value, tmap in stores) if s]
        if not self.ok():
            return self.poison_outputs()
        kernel = Kernel(decl.name, tuple(grid), loop, tuple(loads), tuple(checked), tuple(sources))
        self.phases(kernel)
        if loop is not None and loop != 1 and self.ok() and not any(load.map.loop_dim() is not None for load in loads):
            self.error(decl.loop.loc, f"the loop of kernel '{decl.name}' walks no tile, so every iteration would do "
                       "the same; split a tile's dim by it (a map entry 'loop' or 'x*loop'), or drop loop(...)")
        if not self.ok():
            return self.poison_outputs()
        for i, (store, (stmt, _, _)) in enumerate(zip(kernel.stores, stores)):
            shape = output_shape(store.value.shape, store.map, kernel)
            node = Node("kernel", tuple(sources), (kernel, i), store.value.dtype, shape)
            self.env[store.name] = node
            self.c.locs.setdefault(node, stmt.loc)
            self.c.names.setdefault(node, store.name)

    def poison_outputs(self) -> None:
        """After an error in the kernel, the names it stores are known but valueless: uses stay quiet."""
        for stmt in self.decl.body:
            if isinstance(stmt, ast.StoreStmt) and stmt.name not in self.env:
                self.env[stmt.name] = POISON

    def load(self, stmt: ast.LoadStmt, shell: Kernel, has_loop, sources, loads, local) -> None:
        if stmt.tile in local:
            self.error(stmt.loc, f"'{stmt.tile}' is already defined in kernel '{self.decl.name}'")
            return
        source = self.env.get(stmt.source)
        if source is None:
            self.error(stmt.source_loc, unknown_name(stmt.source, self.env, self.c.scope))
        tmap = self.tile_map(stmt.entries, loop_ok=has_loop)
        local[stmt.tile] = POISON  # until the load is found sound
        if not isinstance(source, Node) or tmap is None:
            return
        if source.op == "const":
            return self.error(stmt.source_loc, f"'{stmt.source}' is a constant; a kernel loads tensors")
        if len(tmap.dims) != source.rank:
            return self.error(stmt.loc, f"the map of '{stmt.tile}' has {len(tmap.dims)} entries but '{stmt.source}' "
                              f"has {source.rank} dims {fmt_shape(source.shape)}; give one entry per dim")
        if source.rank > KERNEL_RANK:
            return self.error(stmt.loc, f"'{stmt.source}' has rank {source.rank}; kernels load tensors of rank "
                              f"{KERNEL_RANK} at most")
        if source not in sources:
            sources.append(source)
        shape = tile_shape(source.shape, tmap, shell)
        node = Node("tile", (), stmt.tile, source.dtype, shape)
        loads.append(Load(stmt.tile, sources.index(source), tmap))
        local[stmt.tile] = node
        self.c.locs.setdefault(node, stmt.loc)
        self.where.setdefault(node, stmt.loc)

    def store(self, stmt: ast.StoreStmt, value: Node, tmap: TileMap, kernel: Kernel) -> Store | None:
        if stmt.name in self.env:
            return self.error(stmt.loc, f"'{stmt.name}' is already defined; every name is assigned once")
        if value.op == "const":
            return self.error(stmt.loc, "a kernel stores tiles, not constants")
        rank = len(tmap.dims)
        if rank > KERNEL_RANK:
            return self.error(stmt.loc, f"the map of '{stmt.name}' has {rank} entries; kernels store tensors of "
                              f"rank {KERNEL_RANK} at most")
        extra = value.shape[: max(0, value.rank - rank)]
        if any(not same(s, ONE) for s in extra):
            return self.error(stmt.loc, f"the stored tile has shape {fmt_shape(value.shape)} but the map has {rank} "
                              f"entries; only leading dims of size 1 can be left out")
        split_by = {a for n in value.walk() if n.op == "tile" for a in kernel.load(n.attr).map.axes()}
        alike = [a for a, g in kernel.grid if a not in split_by and not same(g, ONE)]
        if alike:  # (before '+=': adding such blocks' results would add copies of one)
            return self.error(stmt.loc, f"every block along grid axis {', '.join(alike)} would compute the same "
                              f"'{stmt.name}': no tile it is computed from is split by "
                              f"{'it' if len(alike) == 1 else 'them'}; split a tile by the axis, or drop the axis "
                              f"from the grid")
        unmapped = [a for a, g in kernel.grid if a not in tmap.axes()]
        summed = [a for a in unmapped if not same(kernel.size(a), ONE)]
        if summed and not stmt.add:
            return self.error(stmt.loc, f"grid axis {', '.join(summed)} writes no dim of '{stmt.name}', so its blocks' "
                              f"results must be added: write 'store {stmt.name}[...] += ...', or map the axis to a dim")
        if stmt.add and not unmapped:
            return self.error(stmt.loc, f"'+=' adds the results of blocks along axes that write no dim, but every "
                              f"axis writes a dim of '{stmt.name}'; write '='")
        if why := self.by_blocks(kernel, value, tmap, summed):
            return self.error(stmt.loc, why)
        return Store(stmt.name, value, tmap, stmt.add)

    def by_blocks(self, kernel: Kernel, value: Node, tmap: TileMap, summed: list[str]) -> str | None:
        """What makes the blocks' stores of `value` depend on how many blocks there are (`kernels.pieces`), in
        words: along an axis summed over, anything but a partial sum; along an axis that writes a dim of whole
        positions (not a dim of per-piece results, one element a block), a value mixing a piece with the whole."""
        for a, g in kernel.grid:
            sym = self.parameter(g)
            if sym is None:
                continue
            classes = Classes(sym, lambda t, a=a: a in kernel.load(t.attr).map.axes())
            if a in summed and (why := added_by_blocks(value, classes)):
                return (f"the blocks along grid axis {a} add what depends on how many they are ({sym}): {why}; '+=' "
                        "adds partial sums only (products over the axis's pieces, acc_sum, acc_sum_last), and a term "
                        "the axis does not split belongs after the sum")
            at = tmap.dim_of(a)
            if at is not None and -at <= value.rank and sym in sympy.sympify(value.shape[at]).free_symbols and (
                    why := stored_by_blocks(value, classes)):
                return (f"what the blocks along grid axis {a} store depends on how many they are ({sym}): {why}; a "
                        "block needs the whole of a dim it works across (split another dim by the axis, or walk this "
                        "one with the loop and fold it)")
        return None

    def combining(self, kernel: Kernel, acc: Node) -> str | None:
        """Why accumulator `acc` cannot combine the per-piece states its loop walks (another kernel's, one for each
        block along one of that kernel's grid axes: `pieces.combined_by`), or None: it must be a fold that combines
        them. (What it folds through other ops first is left to the prover.)"""
        tile = acc.args[-1]  # (acc_rescaled_sum's first operand is the pieces' running max, which it rescales by)
        if tile.op != "tile":
            return None
        load = kernel.load(tile.attr)
        source = kernel.inputs[load.source]
        if source.op != "kernel":
            return None
        first, index = source.attr
        store = first.stores[index]
        for axis, _ in first.grid:
            at = store.map.dim_of(axis)
            if at is None or not load.map.dims[at].loop or (folds := combined_by(store.value, axis, first)) is None:
                continue
            if acc.op not in folds:
                name = self.c.names.get(source, store.name)
                how = f"combine by {' or '.join(sorted(folds))}" if folds else "combine by no fold"
                return (f"{acc.op} folds the pieces of '{name}', which kernel '{first.name}' stores one a block along "
                        f"its grid axis {axis}, each {store.value.op} over its piece: they {how}")
        return None

    def parameter(self, size) -> sympy.Symbol | None:
        """The kernel parameter that a grid size or loop range is, or None where it is fixed (a number, a dim)."""
        if isinstance(size, sympy.Symbol) and size.name not in self.c.scope.dims:
            return size
        return None

    def phases(self, kernel: Kernel) -> None:
        body = kernel.body()
        varying, after = loop_varying(kernel), after_loop(body)
        sym = self.parameter(kernel.loop)
        loop = None if sym is None else Classes(sym, lambda t: kernel.load(t.attr).map.loop_dim() is not None)
        for n in body:
            loc = self.where.get(n, self.decl.loc)
            if OPS[n.op].kind is Kind.ACCUMULATE:
                if kernel.loop is None:
                    self.error(loc, f"{n.op} accumulates over the loop, but kernel '{kernel.name}' has no loop(...)")
                elif any(a in after for a in n.args):
                    self.error(loc, f"{n.op} reads a value computed after the loop; accumulators cannot be nested")
                elif not any(a in varying for a in n.args):
                    self.error(loc, f"{n.op} accumulates a value that is the same in every iteration; accumulate a "
                               f"value computed from a tile the loop splits")
                elif loop is not None and (why := over_the_loop(n, loop)):
                    self.error(loc, f"{n.op} gives what depends on how many iterations the loop has ({loop.sym}): "
                               f"{why}; fold what the loop splits, and add a term it does not split after the loop")
                elif why := self.combining(kernel, n):
                    self.error(loc, why)
            elif any(a in after for a in n.args) and any(a in varying for a in n.args):
                self.error(loc, f"{n.op} combines a value from inside the loop with one from after it; "
                           f"accumulate the first (acc_sum, acc_rms_last, ...) before using it after the loop")
        for s in kernel.stores:
            if s.value in varying:
                self.error(self.where.get(s.value, self.decl.loc),
                           f"'{s.name}' stores a value that changes every loop iteration; accumulate it first "
                           f"(acc_sum, acc_max_last, ...)")


def check_kernel(checker, decl: ast.KernelDecl, env: dict) -> None:
    _KernelCheck(checker, decl, env).run()
