"""What a batch costs: the quantity the token budget caps, and the one rank balancing evens out.

Two numbers per batch, on purpose:
- *token cost* (what `token_budget` bounds; it models activation memory):
  padded collate `n * max_len`, packed/varlen collate `sum(len)`.
- *compute cost* (what DDP step time follows; used to balance ranks): `a*L + b*L^2` per sample,
  where L is the padded length for padded collate and the true length for packed collate.
  With the defaults a=1, b=0 it equals the token cost, so balancing by it is balancing tokens.

`pad_to_multiple` (m, `batching.pad_to_multiple`): the collate pads every sequence to a multiple
of m (context parallelism splits each sequence into 2*CP chunks, FP8 kernels want multiples of
8 or 16), so both costs are taken on the lengths as sent, `ceil(L / m) * m`: the budget caps
what actually reaches the GPU, padding included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.planner.types import Collate


@dataclass(frozen=True, slots=True)
class CostModel:
    collate: Collate = Collate.PADDED
    attn_a: float = 1.0
    attn_b: float = 0.0
    pad_to_multiple: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.collate, Collate):
            object.__setattr__(self, "collate", Collate(self.collate))
        for name in ("attn_a", "attn_b"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.attn_a == 0 and self.attn_b == 0:
            raise ValueError("attn_a and attn_b cannot both be 0 (every batch would cost nothing)")
        m = self.pad_to_multiple
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"pad_to_multiple must be an integer >= 1, got {m!r}")

    @property
    def padded(self) -> bool:
        return self.collate is Collate.PADDED

    @property
    def compute_is_tokens(self) -> bool:
        """True when compute cost == token cost (defaults); lets callers skip the extra sum."""
        return self.attn_a == 1.0 and self.attn_b == 0.0

    def sent_length(self, length: int) -> int:
        """A sequence's length as the collate sends it: rounded up to `pad_to_multiple`."""
        m = self.pad_to_multiple
        return -(-length // m) * m

    def sent_lengths(self, lengths: Sequence[int]) -> Sequence[int]:
        return lengths if self.pad_to_multiple == 1 else [self.sent_length(n) for n in lengths]

    def token_cost(self, lengths: Sequence[int]) -> int:
        """Cost the budget caps: `n * max_len` (padded) or `sum(len)` (packed), on the lengths
        as sent (`sent_length`)."""
        if not lengths:
            return 0
        lengths = self.sent_lengths(lengths)
        if self.padded:
            return len(lengths) * max(lengths)
        return sum(lengths)

    def sample_compute(self, length: int) -> float:
        return self.attn_a * length + self.attn_b * length * length

    def compute_cost(self, lengths: Sequence[int]) -> float:
        """Attention-aware cost `sum(a*L + b*L^2)`; L is the padded length under padded collate
        (lengths as sent, `sent_length`)."""
        if not lengths:
            return 0.0
        lengths = self.sent_lengths(lengths)
        if self.padded:
            return len(lengths) * self.sample_compute(max(lengths))
        return sum(self.sample_compute(n) for n in lengths)
