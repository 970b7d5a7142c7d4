"""Statistics of a plan, for `odb-pipeline plan` and the benchmark.

`PlanReport` watches the event stream and counts what a user needs to judge a plan: steps,
padding efficiency, budget violations (must be 0), over-budget handling, per-rank step counts,
per-step rank balance, carry-over, filler batches. A filler (quota mode's closing step) is not
coverage: its sample is not counted as emitted and its tokens count as padding (computed, not
learned from). With global steps a batch is a micro-batch: `batches` counts them, balance is
over each rank's micro-batches of a step together, and the micro-batches a rank runs per step
are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.types import EpochEnd, PlanEvent, Quarantined, Step
from pipeline.quarantine import QuarantineReason


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0.0 when empty)."""
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, round(q * (len(sorted_vals) - 1))))
    return sorted_vals[i]


@dataclass
class PlanReport:
    policy: BatchingPolicy
    world_size: int
    samples_in: int = 0
    steps: int = 0
    batches: int = 0
    emitted_samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    budget_violations: int = 0
    visual_violations: int = 0
    over_budget_alone: int = 0
    truncated: int = 0
    quarantined: int = 0
    quarantined_over_budget: int = 0
    partial_steps: int = 0
    epochs: int = 0
    carried_over: int = 0
    filler_batches: int = 0
    per_rank_steps: list[int] = field(default_factory=list)
    epoch_steps: list[int] = field(default_factory=list)
    _balance: list[float] = field(default_factory=list)
    _micros: list[int] = field(default_factory=list)  # per (step, rank): its micro-batches

    def __post_init__(self) -> None:
        if not self.per_rank_steps:
            self.per_rank_steps = [0] * self.world_size

    def observe(self, ev: PlanEvent) -> None:
        budget = self.policy.token_budget
        vcap = self.policy.max_visual_tokens
        cm = self.policy.cost_model
        if isinstance(ev, Step):
            self.steps += 1
            ranks = ev.ranks()
            if len(ranks) < self.world_size:
                self.partial_steps += 1
            per_rank = dict.fromkeys(ranks, 0)
            for r in ranks:
                self.per_rank_steps[r] += 1
            for b in ev.batches:
                self.batches += 1
                per_rank[b.rank] += b.cost
                n = len(b.samples)
                lens = [b.truncated_to.get(s.sample_id, s.num_tokens) for s in b.samples]
                self.padded_tokens += cm.token_cost(lens)  # as sent (pad_to_multiple)
                if not b.over_budget:
                    if b.cost > budget:
                        self.budget_violations += 1
                    if vcap is not None and sum(s.num_visual_tokens for s in b.samples) > vcap:
                        self.visual_violations += 1
                if b.filler:
                    self.filler_batches += 1
                    continue
                self.emitted_samples += n
                self.real_tokens += sum(lens)
                if b.over_budget:
                    if b.truncated_to:
                        self.truncated += len(b.truncated_to)
                    else:
                        self.over_budget_alone += n
            costs = list(per_rank.values())
            mean = sum(costs) / len(costs)
            self._balance.append(max(costs) / mean if mean > 0 else 1.0)
            if self.policy.global_steps:
                self._micros += [len(ev.micros_for(r)) for r in ranks]
        elif isinstance(ev, Quarantined):
            self.quarantined += 1
            if ev.reason is not QuarantineReason.INVALID_SIZE:
                self.quarantined_over_budget += 1
        elif isinstance(ev, EpochEnd):
            self.epochs += 1
            self.epoch_steps.append(ev.steps)
            self.carried_over = len(ev.carried_over)

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def budget_fill(self) -> float:
        """Real tokens per batch as a fraction of the budget (what decides the batch count)."""
        denom = self.batches * self.policy.token_budget
        return self.real_tokens / denom if denom else 0.0

    def to_dict(self) -> dict:
        bal = sorted(self._balance)
        micro = sorted(self._micros)
        return {
            "samples": self.samples_in,
            "emitted_samples": self.emitted_samples,
            "epochs": self.epochs,
            "steps": self.steps,
            "epoch_steps": list(self.epoch_steps),
            "batches": self.batches,
            "padding_efficiency": round(self.padding_efficiency, 6),
            "budget_fill": round(self.budget_fill, 6),
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "budget_violations": self.budget_violations + self.visual_violations,
            "over_budget_samples": self.over_budget_alone
            + self.truncated
            + self.quarantined_over_budget,
            "over_budget_alone": self.over_budget_alone,
            "truncated": self.truncated,
            "quarantined": self.quarantined,
            "per_rank_steps": list(self.per_rank_steps),
            "partial_steps": self.partial_steps,
            "rank_balance_p50": round(_percentile(bal, 0.50), 6),
            "rank_balance_p95": round(_percentile(bal, 0.95), 6),
            "rank_balance_max": round(bal[-1], 6) if bal else 0.0,
            "carried_over": self.carried_over,
            "filler_batches": self.filler_batches,
            **({"global_token_budget": self.policy.global_token_budget,
                "micro_batches_per_rank_step_p50": _percentile(micro, 0.50),
                "micro_batches_per_rank_step_max": micro[-1] if micro else 0}
               if self.policy.global_steps else {}),
        }

    def summary_text(self) -> str:
        d = self.to_dict()
        prs = d["per_rank_steps"]
        rank_line = (
            f"{min(prs)}..{max(prs)} (min..max over {len(prs)} ranks)" if len(prs) > 8 else str(prs)
        )
        if self.policy.global_steps:
            batches = (f"{d['batches']} micro-batches of up to {self.policy.token_budget}, "
                       f"global steps of up to {self.policy.global_token_budget}: "
                       f"{d['micro_batches_per_rank_step_p50']} per rank and step (p50), "
                       f"{d['micro_batches_per_rank_step_max']} at most")
        else:
            batches = str(d["batches"])
        lines = [
            f"samples            {d['samples']} in, {d['emitted_samples']} emitted"
            f" over {d['epochs']} epoch(s)",
            f"steps              {d['steps']} ({d['partial_steps']} with absent ranks)",
            f"batches            {batches}",
            f"padding efficiency {d['padding_efficiency']:.4f}",
            f"budget fill        {d['budget_fill']:.4f}",
            f"budget violations  {d['budget_violations']}",
            f"over budget        {d['over_budget_samples']} sample(s):"
            f" {d['over_budget_alone']} alone, {d['truncated']} truncated,"
            f" {self.quarantined_over_budget} quarantined",
            f"quarantined        {d['quarantined']}",
            f"steps per rank     {rank_line}",
            f"rank balance       p50 {d['rank_balance_p50']:.4f}  p95 {d['rank_balance_p95']:.4f}"
            "  (max/mean rank cost per step)",
            f"carried over       {d['carried_over']} sample(s) after the last epoch",
            f"filler batches     {d['filler_batches']} (a rank with no sample of a step)",
        ]
        return "\n".join(lines)
