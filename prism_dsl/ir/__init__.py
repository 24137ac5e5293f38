"""The intermediate representation: the vocabulary every later stage speaks.

- `ops`: the operator table (`OPS`: kind, operands, parameters, where an op may be written) and the
  dims the prover tracks;
- `accumulators`: the loop accumulators of custom kernels, one row each with all the stages need (the
  NumPy fold, the shape and closed form, how split pieces combine, the CUDA fold, FLOPs);
- `nodes`: one frozen, interned `Node` type (op, operands, attribute, dtype, symbolic shape) and
  `Program` (inputs, outputs, dims; names and source locations as side tables);
- `shapes`: the shape and dtype rule of each op kind over SymPy sizes, and `build`, the one way to make
  a well-typed node.

It takes nothing from the other stages: programs reach it from `lang` (checked source) and `search`
(candidates), and every later stage reads them. It may import `base` only.
"""
