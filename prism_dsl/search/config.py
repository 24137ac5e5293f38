"""What every phase of the search shares: its limits (`SearchConfig`), its account of what it did
(`Stats`), the typed reasons it drops things for (`Rejection`) and its stop signal (`Stop`)."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SearchConfig:
    """The search's limits. Frozen: it is part of the checkpoint's key."""

    max_kernels: int = 1  # custom kernels per program
    max_predefined: int = 1  # pre-defined kernels (one op of the input program each) per program
    max_block_ops: int = 8  # body ops per custom kernel, accumulators included
    max_accumulators: int = 4  # LayerNorm before a projection needs four (product, mean, variance, column sums)
    max_inputs: int = 7  # tensors one custom kernel loads (causal attention: Q, K, V and two RoPE tables each)
    max_outputs: int = 3  # tensors one custom kernel stores
    max_grid_axes: int = 3
    expression_pruning: bool = True  # off: every op that passes the other checks (small limits only)
    split_reductions: bool = True  # loop kernels also split in two (`Split`); the second is not counted above
    ops: tuple[str, ...] | None = None  # the block ops to try; None: those in the input's saturated e-graph
    steady: bool = True  # drop programs that lose accuracy where the input does not (`Assembly.steady`)


class Rejection(enum.Enum):
    """Why the search dropped an op, a kernel, a map choice or a program. The value is the name the
    pruning counts go by in printed tables and report.json."""

    # kernel generation
    EXPRESSION = "expression"  # an accumulator's abstract expression is not in the saturated e-graph
    SHAPE = "shape"  # operands disagree on their whole sizes; an assembled output has another shape
    UNSTABLE_EXP = "unstable exp"  # an input written with softmax accepts only max-shifted exp
    NO_POST_LOOP_FORM = "no post-loop form"  # the missing outputs cannot be built from the kernel's values
    UNUSED_ACCUMULATOR = "unused accumulator"  # no output reads it (or can, through element-wise ops)
    UNUSED_OUTPUT = "unused output"  # a step computes a value that nothing reads
    DUPLICATE = "duplicate"  # generated (or assembled) before
    LIMITS = "limits"  # over a `SearchConfig` limit
    # program assembly
    MAPS = "maps"  # a map choice that gives no kernel, or one the reference interpreter cannot run
    SHARED_MEMORY = "shared memory"  # over the hardware's shared memory even at the smallest tiles
    NUMERIC = "numeric"  # disagrees with its abstract expression on small random inputs
    SUBSUMED_GRID = "subsumed grid"  # its grid axes are a subset of another valid grid's
    CHECKER = "checker"  # the printed program does not pass the checker
    UNPROVED = "unproved"  # the e-graph did not prove it equal to the input program
    UNSTEADY = "unsteady"  # far from the input's values on inputs far from zero: it loses accuracy the input keeps


@dataclass
class Stats:
    generated: int = 0  # block and kernel ops generated (each one checked)
    candidates: int = 0  # complete generated programs
    maps: int = 0  # map choices tried by program assembly
    proofs: int = 0  # candidates sent to the prover
    proved: int = 0  # candidates proved equal to the input program
    pruned: Counter[Rejection] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # why each proof that could not run did not

    def prune(self, reason: Rejection, count: int = 1) -> None:
        self.pruned[reason] += count

    def as_dict(self) -> dict:
        return {"generated": self.generated, "candidates": self.candidates, "maps": self.maps,
                "proofs": self.proofs, "proved": self.proved,
                "pruned": dict(sorted((r.value, n) for r, n in self.pruned.items())), "errors": list(self.errors)}


class Stop(Exception):
    """The search was told to stop (time limit, interruption)."""
