"""`BatchingPolicy`: every knob of the batching core in one validated, immutable value."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.planner.cost_model import CostModel
from pipeline.planner.types import Collate, OverBudgetPolicy


@dataclass(frozen=True, slots=True)
class BatchingPolicy:
    """How batches are formed. Validated on construction (ValueError names field and value).

    token_budget: cap on each batch's token cost (see `CostModel`).
    max_visual_tokens: optional second cap, on the sum of visual tokens in a batch.
    buffer_size: the online window; the former holds at most this many samples.
    attn_a/attn_b: compute model `a*L + b*L^2`, used to balance ranks (not to cap batches).
    """

    token_budget: int
    collate: Collate = Collate.PADDED
    attn_a: float = 1.0
    attn_b: float = 0.0
    max_visual_tokens: int | None = None
    buffer_size: int = 2048
    over_budget: OverBudgetPolicy = OverBudgetPolicy.ALONE

    def __post_init__(self) -> None:
        if isinstance(self.token_budget, bool) or not isinstance(self.token_budget, int):
            raise ValueError(f"token_budget must be an integer, got {self.token_budget!r}")
        if self.token_budget <= 0:
            raise ValueError(f"token_budget must be > 0, got {self.token_budget}")
        try:
            object.__setattr__(self, "collate", Collate(self.collate))
        except ValueError:
            raise ValueError(
                f"collate must be one of {[c.value for c in Collate]}, got {self.collate!r}"
            ) from None
        try:
            object.__setattr__(self, "over_budget", OverBudgetPolicy(self.over_budget))
        except ValueError:
            raise ValueError(
                f"over_budget must be one of {[p.value for p in OverBudgetPolicy]}, "
                f"got {self.over_budget!r}"
            ) from None
        mv = self.max_visual_tokens
        if mv is not None and (isinstance(mv, bool) or not isinstance(mv, int) or mv <= 0):
            raise ValueError(f"max_visual_tokens must be a positive integer or None, got {mv!r}")
        bs = self.buffer_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"buffer_size must be an integer >= 1, got {bs!r}")
        self.cost_model  # validates attn_a / attn_b  # noqa: B018

    @property
    def cost_model(self) -> CostModel:
        return CostModel(self.collate, self.attn_a, self.attn_b)
