"""The pipeline stage: `prismc compile` as one function, and its passes.

Takes a `compile.Request`: the input program (a checked `ir.nodes.Program`), the output directory, the hardware
(`kernels.hardware.Hardware`), the build options (`build.BuildOptions`: dims, kernel parameters, how launch
parameters are ranked, nvcc architectures, the CPU emulation, the seed) and the search's settings
(`compile.Searching`; none to compile the program as written). Gives a `report.Report`, frozen and
written once as report.json, and the output directory, replaced whole or not at all.

- `compile`: `compile_program`, the passes in order: search (and size: `padding`), choose, lower, tune, render, compile-check,
  emulate, measure, write;
- `optimize`: search and choose: the proved programs (a search, or its checkpoint proved again), each
  tuned by the cost model or timed on the GPU, ranked; the tuning database of estimates;
- `measuring`: timing on the GPU (`--rank measure`): which programs and which choices of their kernel parameters
  are timed, the timer, the database's measured times;
- `padding`: the dims a compile is built for, where no tile divides a size given (rounded up, the launcher
  padding the inputs and cutting the outputs);
- `build`: lower, tune, render, compile-check, emulate and measure, for one program (`Tuned`, `Build`);
- `output`: the write pass;
- `report`: what was found, typed: `proved` (an e-graph proof), `checked` (runs against the float64
  reference), `verified` (both); report.json and the summary in words.

May import: base, ir, kernels, semantics, lang, prove, search, backend.
"""
