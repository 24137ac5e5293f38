"""The prove stage: axioms as data, each checked for soundness, and proofs that two programs are equal.

- `rules`: the `.rules` language, parsed and checked into a `Library` of rules with their file:line;
- soundness, independent of egglog: `patterns` (a rule side's value at concrete shapes), `sampling`
  (random shapes and values), `soundness` (the numeric check, the verdicts and their cache), `symbolic`
  (SymPy proves or refutes what it can);
- proof: `egraph` (rules as an egglog program, programs as terms with shape facts), `layout` (custom
  kernels as terms with layout operators), `prover` (pairs the outputs, saturates, guards the proof
  numerically, `explain`s it), `egglog_runner` and `egglog_worker` (egglog in a child process that is
  killed when a limit passes).

Takes `.rules` files, two `ir.nodes.Program`s (either may hold custom kernels) and limits
(`egglog_runner.Limits`). Gives a `rules.Library`, each rule's status (proved symbolically, tested
numerically, or a `base.errors.PrismError` naming every unsound rule) and a `prover.Proof`: for each
pair of outputs proved or not, with the reason, the numeric guard's evidence and, on request, the rules
used.
May import: base, ir, kernels, semantics, lang (the worker imports nothing: it runs as a script).
"""
