"""The kernels stage: custom kernels as data, and what it takes to launch them on a GPU.

Takes `ir` programs (`Program`, `Node`) whose kernel-level nodes may be custom kernels. Gives:

- `kernel`: the kernel types (`Kernel`, `Load`, `Store`, `TileMap`, `DimMap`, `SymbolicMap`), symbolic
  tile and output shapes, and which body nodes run in or after the loop;
- `fusion`: the placement of each body value (shared memory, registers, accumulator state) and the
  shared-memory buffers a block allocates (`Plan`);
- `lower`: every op outside custom kernels turned into a pre-defined kernel of the same IR;
- `sizes`: exact, compiled evaluation of the SymPy size expressions;
- `hardware`: the GPUs (`Hardware`, read from `gpus/*.toml`);
- `constraints`: the conditions on a kernel's symbols, and instantiation to a `Concrete` kernel;
- `params`: kernel parameters from the command line, and valid choices for the rest;
- `position`: where a block's values sit in the whole tensors (for `causal`), and where a causal loop stops;
- `masking`: which dims a program may be built past, and where the folds mask the elements past the end;
- `lifetimes`: when each shared-memory buffer is in use, and the bytes shared by buffers never in use at once.

The language, search, prover, code generator and cost model build on these. May import: base, ir.
"""
