"""The semantics stage: what a program means, in float64 NumPy; the oracle that proofs, the search's
candidates and generated code are checked against.

- `reference`: each operator's meaning (`NUMPY`; the accumulators' folds come from `ir.accumulators`),
  node-by-node evaluation, dim bindings and size limits, random inputs rounded to their storage dtype;
- `blocks`: the block-level interpreter, the executable definition of what a custom kernel computes,
  and `evaluate`, which runs a whole program (custom kernels there, every other node in `reference`);
- `precision`: each storage type's rounding unit and the least tolerance a check of it allows.

Takes checked programs (`ir.nodes.Program`, custom kernels as `kernels.kernel.Kernel`), input arrays by
name and kernel parameters by symbol name. Gives output arrays by name (float64) and dim bindings
(`dict[sympy.Symbol, int]`).
May import: base, ir, kernels (to instantiate a kernel at concrete sizes before running it).
"""
