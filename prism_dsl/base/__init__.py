"""The base stage: what every other stage stands on; it knows nothing of tensors or programs.

- `errors`: `PrismError`, which carries every `Diagnostic` of a run with its file:line:col (`Loc`), and
  the `Collector` that passes report into;
- `files`: bounded reads of regular files only, atomic writes, scratch directories a later run can sweep;
- `cache`: the user cache directory (small JSON records under content keys, digests of the code that
  made them);
- `resources`: where the data shipped beside the code lives (the default axioms, the CUDA templates).

Takes paths and bytes from the file system; gives errors, file contents and cache records.
May import: no other stage (the standard library only).
"""
