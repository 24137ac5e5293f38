"""The cli stage: `prismc`. Parses the command line, calls the stage that does the work, prints its result.

Takes argv; gives an exit code (0 success; 1 an error in the user's input, or a check that failed: a compile or
verify whose outputs do not agree; 2 a usage error; 3 not proved; 130 interrupted) and text: results on stdout,
located diagnostics on stderr, never a traceback for a user's mistake.

- `entry`: the console script (`main` imported, then run: a Ctrl-C while the modules load is said, not a traceback);
- `main`: the parser and `main(argv)` (what tests call in-process); the commands check, prove, rules,
  run, show, compile (one call of `pipeline.compile.compile_program`), verify and bench;
- `verify`: a compiled directory's .cu files built as they are on disk, emulated and checked again;
- `values`: the flags' values, read strictly (sizes, dims, counts, seconds);
- `texts`: what check and rules print (a rule a line, a program in one line), and the check that rule files
  given together name no rule twice;
- `show`: a program's kernels instantiated, as text or as a Graphviz picture;
- `bench`: the generated kernels against PyTorch eager and torch.compile on a GPU;
- `npz`: the .npz archives of `prismc run`, read defensively, written atomically.

May import every stage.
"""
