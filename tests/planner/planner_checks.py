"""Shared invariant checks for planner tests: every plan the tests make goes through these."""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st

from pipeline.modes import DGAP_MODES, JobMode, OverBudgetPolicy
from pipeline.planner.epochs import plan_epochs
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Collate, EpochEnd, MeasuredSample, Quarantined, Step


def run_epochs(
    epochs: list[list[MeasuredSample]],
    policy: BatchingPolicy,
    world_size: int,
    mode: JobMode | str = JobMode.JOIN,
    seed: int = 0,
    close: bool = True,
) -> list:
    """Plan the epochs as one job; `close`: the last one is the job's last (closing step)."""
    planner = StepPlanner(policy, world_size, mode, seed)
    return [ev for events in plan_epochs(planner, epochs, close=close) for ev in events]


def check_plan(
    events: list,
    epochs: list[list[MeasuredSample]],
    policy: BatchingPolicy,
    world_size: int,
    mode: JobMode | str,
    closed: bool = True,
) -> dict:
    """Assert every guarantee the planner gives; returns a few counts for extra asserts.

    `closed`: the last epoch was ended with `last_epoch=True` (quota: nothing is carried out of
    the job; fillers only in its very last step).
    """
    mode = JobMode(mode)
    cm = policy.cost_model
    budget = policy.token_budget
    vcap = policy.max_visual_tokens
    expected_step = 0
    epoch = 0
    carry_in: list[MeasuredSample] = []
    emitted: Counter = Counter()
    quarantined: Counter = Counter()
    last_step: list[int | None] = [None] * world_size
    steps_this_epoch = 0
    partial_this_epoch = 0
    ends: list[EpochEnd] = []
    filler_steps: list[Step] = []
    all_steps = [ev for ev in events if isinstance(ev, Step)]
    for ev in events:
        if isinstance(ev, Step):
            assert ev.epoch == epoch
            assert ev.step == expected_step, "steps are global, monotonic and contiguous"
            expected_step += 1
            steps_this_epoch += 1
            ranks = [b.rank for b in ev.batches]
            assert ranks == sorted(set(ranks)), "at most one batch per rank, sorted by rank"
            assert all(0 <= r < world_size for r in ranks)
            assert ev.batches, "a step has at least one batch"
            if mode is JobMode.QUOTA:
                assert len(ev.batches) == world_size, "quota: every step is full"
            elif len(ev.batches) < world_size:
                partial_this_epoch += 1
            tokens = loss = 0
            real_samples = {s for b in ev.batches if not b.filler for s in b.samples}
            if any(b.filler for b in ev.batches):
                filler_steps.append(ev)
            for b in ev.batches:
                assert b.samples, "no empty batches"
                lens = [b.truncated_to.get(s.sample_id, s.num_tokens) for s in b.samples]
                assert b.cost == cm.token_cost(lens)
                if b.over_budget:
                    assert len(b.samples) == 1, "over-budget batches hold one sample"
                    s = b.samples[0]
                    # (over the budget as sent: padded to pad_to_multiple)
                    over = cm.sent_length(s.num_tokens) > budget or (
                        vcap is not None and s.num_visual_tokens > vcap
                    )
                    assert over
                    if b.truncated_to:
                        assert b.truncated_to == {s.sample_id: policy.max_alone_tokens}
                        assert b.cost <= budget
                else:
                    assert b.cost <= budget, f"budget violated: {b.cost} > {budget}"
                    if vcap is not None:
                        assert sum(s.num_visual_tokens for s in b.samples) <= vcap
                last_step[b.rank] = ev.step
                if b.filler:
                    assert len(b.samples) == 1 and b.samples[0] in real_samples, \
                        "a filler copies one real sample of its step"
                    assert b.loss_tokens == 0, "a filler has zero loss weight"
                    continue
                tokens += sum(lens)
                loss += sum(min(s.loss_tokens, n) for s, n in zip(b.samples, lens, strict=True))
                emitted.update(s.sample_id for s in b.samples)
            real = [b for b in ev.batches if not b.filler]
            assert ev.info.step_samples == sum(len(b.samples) for b in real)
            assert ev.info.step_tokens == tokens
            assert ev.info.step_loss_tokens == loss == sum(b.loss_tokens for b in ev.batches)
        elif isinstance(ev, Quarantined):
            assert ev.reason
            quarantined[ev.sample.sample_id] += 1
        elif isinstance(ev, EpochEnd):
            assert ev.epoch == epoch
            assert ev.steps == steps_this_epoch
            assert len(ev.final_step) == world_size
            assert ev.final_step == tuple(last_step), "final_step is each rank's last step"
            if mode is JobMode.QUOTA:
                assert len(set(ev.final_step)) <= 1, "quota: every rank ends on the same step"
                if closed and epoch == len(epochs) - 1:
                    assert ev.carried_over == (), "the job's last epoch carries nothing out"
            else:
                assert ev.carried_over == ()
                assert partial_this_epoch <= 1, "bounded termination: at most one partial step"
            fed = Counter(s.sample_id for s in carry_in) + Counter(
                s.sample_id for s in epochs[epoch]
            )
            out = emitted + quarantined + Counter(s.sample_id for s in ev.carried_over)
            assert out == fed, "every sample exactly once (or carried, in quota mode)"
            carry_in = list(ev.carried_over)
            ends.append(ev)
            epoch += 1
            emitted, quarantined = Counter(), Counter()
            last_step = [None] * world_size
            steps_this_epoch = partial_this_epoch = 0
        else:  # pragma: no cover
            raise AssertionError(f"unknown event {ev!r}")
    assert epoch == len(epochs), "one EpochEnd per epoch"
    if filler_steps:
        assert mode is JobMode.QUOTA and closed, "fillers only close a quota job"
        assert filler_steps == all_steps[-1:], "fillers only in the job's very last step"
        assert filler_steps[0].epoch == len(epochs) - 1
    return {"steps": expected_step, "ends": ends, "filler_steps": filler_steps}


@st.composite
def scenarios(draw):
    budget = draw(st.integers(1, 400))
    world_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    vcap = draw(st.one_of(st.none(), st.integers(1, 60)))
    multiple = draw(st.sampled_from([None, None, 1, 2, 3, 8, 16]))
    policy = BatchingPolicy(
        token_budget=budget,
        collate=draw(st.sampled_from(list(Collate))),
        # Both window bounds small, so cutting (and its restore) happens often.
        lookahead_tokens=budget * draw(st.integers(1, 8)),
        max_window_samples=draw(st.integers(1, 48)),
        over_budget=draw(st.sampled_from(list(OverBudgetPolicy))),
        max_visual_tokens=vcap,
        attn_b=draw(st.sampled_from([0.0, 0.001])),
        pad_to_multiple=multiple if multiple is None or multiple <= budget else None,
    )
    n_epochs = draw(st.integers(1, 3))
    length = st.integers(0, budget + budget // 3 + 1)
    visual = st.integers(0, 80) if vcap is not None else st.just(0)
    n = draw(st.integers(0, 120))
    base = []
    for i in range(n):
        tokens = draw(length)
        base.append(MeasuredSample(i, tokens, draw(visual), draw(st.integers(0, max(0, tokens)))))
    # Same ids every epoch (a new pass over the dataset), order possibly different.
    epochs = [base] + [draw(st.permutations(base)) for _ in range(n_epochs - 1)]
    mode = draw(st.sampled_from(list(DGAP_MODES)))
    seed = draw(st.integers(0, 2**31))
    return policy, world_size, mode, seed, epochs
