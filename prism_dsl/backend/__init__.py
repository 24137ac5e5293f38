"""The backend stage: concrete kernels become code a GPU runs, and that code is compiled, run and timed.

Takes concrete custom kernels (`kernels.constraints.Concrete`) of a lowered program. Gives:

- `codegen`: CUDA C per kernel through the Jinja templates (`RenderedKernel`), and those templates;
- `cost`: the cost model: an `Estimate` per kernel, kernel parameters tuned by it; `intake`, its memory side (what
  the SMs take in, and a pipeline's own floor);
- `roofline`: a program's floor, the time no program computing it beats;
- `nvcc`: the generated code compiled by nvcc for each architecture, with ptxas's figures;
- `emulate`: the generated code compiled as C++ and run on the CPU, where there is no GPU;
- `compare`: an output judged against the float64 reference, for the emulation and the GPU alike;
- `copies`: how tiles come into shared memory: cp.async by every thread, or the tensor memory accelerator;
- `cuda_runtime`: a runtime plan launched through PyCUDA, kernels timed as the GPU runs them, and `cuda_plan`, what
  a well-formed plan holds and the tensor maps the CUDA driver encodes for it. Neither imports anything of the
  package: both are copied beside generated code, as prism_runtime.py and cuda_plan.py.

May import: base, ir, kernels, semantics, lang, prove, search (it uses base, ir, kernels and lang).
"""
