"""The lang stage: the `.prism` language, from text to checked IR and back to text.

- `grammar/`: the lark grammars (`.prism`, `.rules` and the expressions they share);
- `syntax`: source files to syntax tree, syntax errors worded from a table of bad examples;
- `syntax_tree`: the syntax tree of both languages, as parsed, every node with its location;
- `check`: names, imports, inlined defs, folded constants and symbolic shapes: the checked program;
- `check_kernel`: `kernel` declarations inside a program (maps, tiles, loop phases, stores);
- `scope`: what the two checkers share (the names a file sees, POISON);
- `printer`: IR back to `.prism` text that parses to the identical IR.

Takes `.prism` text (a file and what it imports). Gives a `check.Source` whose programs are
`ir.nodes.Program`s (graphs of interned `ir.nodes.Node`s; custom kernels as `kernels.kernel.Kernel`), or
one `base.errors.PrismError` holding every mistake found; and, from `printer`, text again.
May import: base, ir, kernels, semantics. It sits above semantics because the checker folds constant
expressions with the reference semantics (`semantics.reference.NUMPY`), and above kernels because it
builds kernel IR (`check_kernel` makes `kernels.kernel.Kernel`s). The `.rules` language is read in
`prove.rules`, with this stage's grammar, syntax tree and error machinery.
"""
