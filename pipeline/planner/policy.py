"""`BatchingPolicy`: every knob of the batching core in one validated, immutable value."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.modes import OverBudgetPolicy
from pipeline.planner.cost_model import CostModel
from pipeline.planner.types import Collate

# The window is bounded in tokens, relative to the budget: a batch then takes about the same
# share of the window (1/LOOKAHEAD_BUDGETS) whatever the sample lengths, and padding follows that
# share, so short-sample data sees many candidates and long-sample data holds few. Measured
# (bench/planner_bench.py, budget 16384): 128 budgets keeps padding efficiency within 0.005 of
# the offline GMT oracle on log-normal and heavy-tailed (CV 3) real chats; 64 budgets falls
# ~0.01 behind on the heavy tail. The window's payloads then cost ~16 MiB of text per job
# (int32 ids + labels), less than the balancing pool (~256 batches, see StepPlanner).
LOOKAHEAD_BUDGETS = 128
# Not all a held sample costs is proportional to its tokens: its metadata and its id in the
# planner checkpoint (rewritten with every published step). With tiny samples (2-13 tokens) the
# token bound alone held 264k samples (5 MB checkpoints, 74 MB metadata); this cap binds only
# below ~32 tokens per sample at the default lookahead.
MAX_WINDOW_SAMPLES = 65536


@dataclass(frozen=True, slots=True)
class BatchingPolicy:
    """How batches are formed. Validated on construction (ValueError names field and value).

    token_budget: cap on each batch's token cost (see `CostModel`).
    max_visual_tokens: optional second cap, on the sum of visual tokens in a batch.
    lookahead_tokens: the online window, in tokens (visual tokens included): the former holds
        about this many tokens of samples to choose batches from (None: LOOKAHEAD_BUDGETS x
        token_budget). Image payloads weigh ~2000x a text token (Qwen2-VL float32 patches), so
        image-heavy jobs may want less.
    max_window_samples: safety cap on the samples the window holds (see MAX_WINDOW_SAMPLES).
    attn_a/attn_b: compute model `a*L + b*L^2`, used to balance ranks (not to cap batches).
    ramp_up: an epoch's planning starts small and grows (see `StepPlanner`): its first step
        comes after a few budgets of samples instead of the full window and pool.
    pad_to_multiple: every sequence is sent padded to a multiple of this (None: not padded;
        see `CostModel`): costs, the budget and the over-budget policy apply to the padded
        lengths, so a sample fits alone when its padded length does (`max_sample_tokens`).
    global_token_budget: the cost of one optimizer step, all ranks together (None: a step is W
        batches of up to `token_budget`, today's planning). With it a step's samples do not
        depend on the world size: formed batches (now micro-batches, each within
        `token_budget`) join a global step in formation order until the next would pass it,
        and the step is then split over the ranks (docs/global-steps.md).
    """

    token_budget: int
    collate: Collate = Collate.PADDED
    attn_a: float = 1.0
    attn_b: float = 0.0
    max_visual_tokens: int | None = None
    lookahead_tokens: int | None = None
    max_window_samples: int = MAX_WINDOW_SAMPLES
    over_budget: OverBudgetPolicy = OverBudgetPolicy.ALONE
    ramp_up: bool = True
    pad_to_multiple: int | None = None
    global_token_budget: int | None = None

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
        la = self.lookahead_tokens
        if la is None:
            object.__setattr__(self, "lookahead_tokens", LOOKAHEAD_BUDGETS * self.token_budget)
        elif isinstance(la, bool) or not isinstance(la, int) or la < self.token_budget:
            raise ValueError(f"lookahead_tokens must be an integer >= token_budget "
                             f"({self.token_budget}) or None, got {la!r}")
        if not isinstance(self.ramp_up, bool):
            raise ValueError(f"ramp_up must be a bool, got {self.ramp_up!r}")
        g = self.global_token_budget
        if g is not None and (isinstance(g, bool) or not isinstance(g, int)):
            raise ValueError(f"global_token_budget must be an integer or None, got {g!r}")
        if g is not None and g < self.token_budget:
            raise ValueError(
                f"global_token_budget ({g}) is below token_budget ({self.token_budget}): a "
                "global step holds at least one micro-batch of up to token_budget tokens; "
                "raise global_token_budget (e.g. a multiple of token_budget) or lower "
                "token_budget")
        ws = self.max_window_samples
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ValueError(f"max_window_samples must be an integer >= 1, got {ws!r}")
        m = self.pad_to_multiple
        if m is not None and (isinstance(m, bool) or not isinstance(m, int)
                              or not 1 <= m <= self.token_budget):
            raise ValueError(f"pad_to_multiple must be an integer in [1, token_budget "
                             f"({self.token_budget})] or None, got {m!r}")
        self.cost_model  # validates attn_a / attn_b  # noqa: B018

    @property
    def global_steps(self) -> bool:
        """Steps are planned for the whole world first, then split (`global_token_budget`)."""
        return self.global_token_budget is not None

    @property
    def cost_model(self) -> CostModel:
        return CostModel(self.collate, self.attn_a, self.attn_b, self.pad_to_multiple or 1)

    @property
    def max_alone_tokens(self) -> int:
        """The longest sample that fits a batch alone: the budget, or with `pad_to_multiple`
        the largest multiple of it within the budget (what truncation cuts to)."""
        m = self.pad_to_multiple or 1
        return self.token_budget // m * m
