"""The backend stage: concrete kernels become code a GPU runs, and that code is compiled, run and timed.

Takes concrete custom kernels (`kernels.constraints.Concrete`) of a lowered program. Gives:

- `codegen`: CUDA C per kernel through the Jinja templates (`RenderedKernel`), and those templates; `launch`, the
  kernel's shape (threads, tensor-core layouts, pipeline stages, shared memory) decided once for it and `cost`;
  `tensor_steps` its tensor-core steps, `warp_mma` their warp layouts, `row_parts` row sums held in registers
  through a loop, `dots` the plain dot products (off the tensor cores) 16 bytes a load, `tails` a split's
  combining kernel in its first kernel's launch, `ctext` C names and index arithmetic;
- `cost`: the cost model: an `Estimate` per kernel; `intake`, its memory side (what the SMs take in, and a
  pipeline's own floor); `tuning`, kernel parameters chosen by it;
- `roofline`: a program's floor, the time no program computing it beats;
- `nvcc`: the generated code compiled by nvcc for each architecture, with ptxas's figures; `sass`, the SASS read
  back (the hot loop's instruction mix);
- `emulate`: the generated code compiled as C++ and run on the CPU, where there is no GPU; `banks`, the
  shared-memory wavefronts and bank conflicts counted there;
- `compare`: an output judged against the float64 reference, for the emulation and the GPU alike;
- `copies`: how tiles come into shared memory: cp.async by every thread, or the tensor memory accelerator;
- `cuda_runtime`: a runtime plan launched through PyCUDA, kernels timed as the GPU runs them, and `cuda_plan`, what
  a well-formed plan holds and the tensor maps the CUDA driver encodes for it. Neither imports anything of the
  package: both are copied beside generated code, as prism_runtime.py and cuda_plan.py.

May import: base, ir, kernels, semantics, lang, prove, search (it uses base, ir, kernels and lang).
"""
