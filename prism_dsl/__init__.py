"""prism-dsl: a symbolic superoptimizer for tensor programs.

`.prism` text -> `lang` (checked IR programs) -> `search` (candidate programs of fused kernels, each proved
equal to the input program by `prove` with the axioms of `.rules` files) -> `pipeline` (choose, lower,
tune, render CUDA with `backend`, check against `semantics.reference`, write). docs/ARCHITECTURE.md
describes the stages, the data each passes on and the chain of checks.
"""

__version__ = "0.1.0"

# The stages, lowest first: a stage's modules import only their own stage and the stages before it
# (tests/test_layers.py checks this from the source).
STAGES = ("base", "ir", "kernels", "semantics", "lang", "prove", "search", "backend", "pipeline", "cli")
