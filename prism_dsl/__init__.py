"""prism-dsl: a symbolic superoptimizer for tensor programs.

Pipeline (ARCHITECTURE.md section 4): `.prism` text -> `syntax` (lark) -> `check` (symbolic shapes) ->
`ir` programs, evaluated by `reference` (the float64 oracle) and printed back by `printer`.
Axioms: `.rules` text -> `rules` (parsed, checked) -> `soundness` (numeric check; `symbolic`: SymPy) -> `egraph` (egglog
program text) -> `prove`, which runs egglog through `egglog_runner` in a child process.
"""

__version__ = "0.1.0"

# The stages, lowest first: a stage's modules import only their own stage and the stages before it
# (tests/test_layers.py checks this from the source).
STAGES = ("base", "ir", "kernels", "semantics", "lang", "prove", "search", "backend", "pipeline", "cli")
