"""prism-dsl: a symbolic superoptimizer for tensor programs.

Pipeline (ARCHITECTURE.md section 4): `.prism` text -> `syntax` (lark) -> `check` (symbolic shapes) ->
`ir` programs, evaluated by `reference` (the float64 oracle) and printed back by `printer`.
"""

__version__ = "0.1.0"
