"""The search stage: programs of fused custom kernels, each proved equal to the input program.

Takes the input program (a checked `ir.nodes.Program` of pre-defined ops), the rules (`prove.rules.Library`),
the hardware (`kernels.hardware.Hardware`, for shared memory) and the limits (`config.SearchConfig`).
Gives `driver.Result`: the proved programs (`ir.nodes.Program`s with custom kernels whose sizes stay symbolic,
so each holds for every binding of the dims), in the order found, and `config.Stats` (counts, pruning by
typed `config.Rejection`, the messages of proofs that could not run).

- `abstract`: abstract expressions, and the input program's saturated e-graph (`InputGraph`) that
  prunes by them;
- `generate`: kernel generation, candidates whose maps and sizes are still symbols;
- `maps`: index classes and map choices, a generated kernel made concrete;
- `split`: split reductions (FlashDecoding), a loop kernel as partial and combining kernels;
- `assembly`: program assembly, the numeric filter, and the pool of egglog provers (`Prover`);
- `driver`: `search`, both phases as one stream, under a time limit or an interruption;
- `checkpoint`: the proved programs of a complete search, kept in the user cache.

May import: base, ir, kernels, semantics, lang, prove.
"""
