"""Edge cases of the planner, each checked against every guarantee (planner_checks)."""

from __future__ import annotations

import numpy as np
import pytest
from planner_checks import check_plan, run_epochs

from pipeline.modes import DGAP_MODES, JobMode, OverBudgetPolicy
from pipeline.planner.batch_former import BatchFormer
from pipeline.planner.plan_report import PlanReport
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import (
    Collate,
    EpochEnd,
    MeasuredSample,
    Quarantined,
    Step,
    StepInfo,
    WorldStamp,
)

MODES = list(DGAP_MODES)


def samples(lengths, visual=None):
    visual = visual or [0] * len(lengths)
    return [MeasuredSample(i, n, v) for i, (n, v) in enumerate(zip(lengths, visual, strict=True))]


def plan(lengths, w, mode=JobMode.JOIN, epochs=1, close=True, **kw):
    policy = BatchingPolicy(**{"token_budget": 1000, "max_window_samples": 64, **kw})
    data = [samples(lengths)] * epochs
    events = run_epochs(data, policy, w, mode, close=close)
    info = check_plan(events, data, policy, w, mode, closed=close)
    return events, info


def steps_of(events):
    return [e for e in events if isinstance(e, Step)]


def ends_of(events):
    return [e for e in events if isinstance(e, EpochEnd)]


@pytest.mark.parametrize("mode", MODES)
def test_empty_input(mode):
    events, _ = plan([], 4, mode)
    assert events == [EpochEnd(0, (None,) * 4, 0, (), WorldStamp(0, 4))]  # stamped


def test_fewer_samples_than_ranks_join():
    events, _ = plan([10, 20, 30], 8)
    (step,) = steps_of(events)
    assert [b.rank for b in step.batches] == [0, 1, 2]  # split to one sample per rank
    (end,) = ends_of(events)
    assert end.final_step == (0, 0, 0, None, None, None, None, None)


def test_fewer_samples_than_ranks_quota_carries_then_completes():
    events, _ = plan([10, 20, 30], 8, JobMode.QUOTA, epochs=3)
    ends = ends_of(events)
    # 3 (then 6) samples cannot fill 8 ranks: carried, never dropped; 9 can: one full step.
    assert [e.steps for e in ends] == [0, 0, 1]
    assert [len(e.carried_over) for e in ends] == [3, 6, 0]
    assert all(len(s.batches) == 8 for s in steps_of(events))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", list(OverBudgetPolicy))
def test_every_sample_over_budget(mode, policy):
    events, _ = plan([1500, 2000, 1001, 5000], 2, mode, over_budget=policy)
    st = steps_of(events)
    q = [e for e in events if isinstance(e, Quarantined)]
    if policy is OverBudgetPolicy.QUARANTINE:
        assert len(q) == 4 and not st
        assert all("exceeds token_budget=1000" in e.detail for e in q)
    else:
        assert not q
        batches = [b for s in st for b in s.batches]
        assert len(batches) == 4 and all(b.over_budget for b in batches)
        if policy is OverBudgetPolicy.TRUNCATE:
            assert all(b.cost == 1000 and b.num_tokens == 1000 for b in batches)
            assert all(s.info.step_tokens == 2000 for s in st)
        else:
            assert sorted(b.cost for b in batches) == [1001, 1500, 2000, 5000]


def test_one_huge_outlier_does_not_spoil_the_rest():
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(90, 110, size=500)] + [50_000]
    events, _ = plan(lengths, 4, over_budget=OverBudgetPolicy.ALONE)
    rep = PlanReport(BatchingPolicy(1000, max_window_samples=64), 4)
    for e in events:
        rep.observe(e)
    d = rep.to_dict()
    assert d["over_budget_samples"] == 1 and d["budget_violations"] == 0
    assert d["padding_efficiency"] > 0.9


def test_visual_cap_and_truncate_quarantines_with_reason():
    policy = BatchingPolicy(1000, max_window_samples=8, max_visual_tokens=100,
                            over_budget="truncate")
    data = [samples([100, 100, 100, 100, 100], [60, 60, 60, 500, 0])]
    events = run_epochs(data, policy, 1)
    check_plan(events, data, policy, 1, JobMode.JOIN)
    (q,) = [e for e in events if isinstance(e, Quarantined)]
    assert q.sample.sample_id == 3 and "truncation cannot cut visual tokens" in q.detail
    for s in steps_of(events):
        assert sum(x.num_visual_tokens for b in s.batches for x in b.samples) <= 100


def test_zero_length_sample_is_quarantined():
    events, _ = plan([0, 5, 5], 1)
    (q,) = [e for e in events if isinstance(e, Quarantined)]
    assert q.sample.sample_id == 0 and "num_tokens=0" in q.detail


@pytest.mark.parametrize("mode", MODES)
def test_world_size_one(mode):
    events, _ = plan(list(range(1, 400)), 1, mode)
    assert all(len(s.batches) == 1 for s in steps_of(events))
    assert ends_of(events)[0].carried_over == ()


@pytest.mark.parametrize("mode", MODES)
def test_world_size_1024(mode):
    rng = np.random.default_rng(2)
    lengths = [int(x) for x in rng.integers(1, 400, size=5000)]
    events, _ = plan(lengths, 1024, mode, epochs=2, max_window_samples=256)
    for s in steps_of(events):
        if mode is JobMode.QUOTA:
            assert len(s.batches) == 1024


def test_join_ranks_end_together_when_enough_samples():
    events, _ = plan([7] * 1001, 8, token_budget=70)
    end = ends_of(events)[0]
    assert len(set(end.final_step)) == 1 and all(len(s.batches) == 8 for s in steps_of(events))


def test_quota_equal_steps_and_carry_reaches_next_epoch():
    # 21 single-sample batches at W=8: 2 full steps; singletons cannot split, so the other 5
    # are carried to the head of the next epoch and emitted there.
    events, _ = plan([900] * 21, 8, JobMode.QUOTA, epochs=2, close=False)
    e0, e1 = ends_of(events)
    assert e0.steps == 2 and len(e0.carried_over) == 5
    assert len(set(e0.final_step)) == 1
    first_epoch1 = steps_of(events)[2]
    carried = {s.sample_id for s in e0.carried_over}
    assert first_epoch1.epoch == 1
    assert carried <= {i for b in first_epoch1.batches for i in b.sample_ids}
    assert e1.steps == 3 and len(e1.carried_over) == 2  # 26 batches: 3 steps, 2 carried


def test_quota_last_epoch_closes_with_fillers():
    """Guarantee 3: after the final epoch the carried samples form one last aligned step; the
    ranks without a sample get a flagged copy that carries no loss and no coverage."""
    lengths = [900] * 20 + [700]
    loss = {i: n // 2 for i, n in enumerate(lengths)}
    data = [[MeasuredSample(i, n, 0, loss[i]) for i, n in enumerate(lengths)]] * 2
    policy = BatchingPolicy(1000, max_window_samples=64)
    events = run_epochs(data, policy, 8, JobMode.QUOTA, seed=3)
    info = check_plan(events, data, policy, 8, JobMode.QUOTA)
    e0, e1 = ends_of(events)
    assert len(e0.carried_over) == 5 and e1.carried_over == ()  # nothing leaves the job
    *_, closing = steps_of(events)
    assert info["filler_steps"] == [closing] and closing.epoch == 1
    assert e1.final_step == (closing.step,) * 8 and e1.steps == 4  # 3 full steps + closing
    real = [b for b in closing.batches if not b.filler]
    fillers = [b for b in closing.batches if b.filler]
    assert len(real) == 2 and len(fillers) == 6 and {b.rank for b in closing.batches} == set(
        range(8))
    shortest = min((s for b in real for s in b.samples), key=lambda s: s.num_tokens)
    assert shortest.num_tokens == 700  # the cheapest sample to run is copied
    assert all(b.samples == (shortest,) and b.cost == 700 for b in fillers)
    assert closing.info == StepInfo(2, sum(b.num_tokens for b in real),
                                    sum(b.loss_tokens for b in real))
    rep = PlanReport(policy, 8)
    for e in events:
        rep.observe(e)
    d = rep.to_dict()
    assert d["emitted_samples"] == 42 and d["filler_batches"] == 6 and d["carried_over"] == 0
    assert set(d["per_rank_steps"]) == {e0.steps + e1.steps}


def test_quota_last_epoch_with_nothing_left_adds_no_step():
    events, info = plan([100] * 80, 8, JobMode.QUOTA)  # 8 batches of 10: one full step
    assert not info["filler_steps"] and len(steps_of(events)) == 1


def test_join_last_epoch_is_unchanged():
    data = [samples([900] * 21)]
    policy = BatchingPolicy(1000, max_window_samples=64)
    assert run_epochs(data, policy, 8) == run_epochs(data, policy, 8, close=False)


def test_packed_collate_fills_budget():
    rng = np.random.default_rng(3)
    lengths = [int(x) for x in rng.integers(10, 500, size=3000)]
    events, _ = plan(lengths, 4, collate=Collate.PACKED, max_window_samples=256)
    batches = [b for s in steps_of(events) for b in s.batches]
    fill = sum(b.cost for b in batches) / (1000 * len(batches))
    assert fill > 0.97


def test_padding_efficiency_close_to_oracle_on_lognormal():
    rng = np.random.default_rng(4)
    lengths = np.clip(rng.lognormal(np.log(700), 0.5, 6000).round(), 16, 8192).astype(int)
    policy = BatchingPolicy(16384)
    rep = PlanReport(policy, 8)
    for e in run_epochs([samples(lengths.tolist())], policy, 8):
        rep.observe(e)
    d = rep.to_dict()
    assert d["budget_violations"] == 0 and d["emitted_samples"] == 6000
    assert d["padding_efficiency"] > 0.98
    assert d["rank_balance_p50"] < 1.05


@pytest.mark.parametrize("bound", ["tokens", "samples"])
def test_former_window_is_bounded(bound):
    kw = {"lookahead_tokens": 150} if bound == "tokens" else {"max_window_samples": 10}
    f = BatchFormer(BatchingPolicy(100, **kw))
    for i in range(1000):
        f.add(MeasuredSample(i, 1 + i % 50))
        assert f.tokens < 150 if bound == "tokens" else len(f) < 10
        assert f.tokens == sum(s.num_tokens for s in f.samples())


def test_window_in_tokens_holds_more_short_samples_than_long():
    """The same token window holds ~16x more samples when they are 16x shorter."""
    held = []
    for n in (20, 320):
        f = BatchFormer(BatchingPolicy(1000, lookahead_tokens=64_000))
        sizes = []
        for i in range(20_000):
            f.add(MeasuredSample(i, n - i % 3))
            sizes.append(len(f))
        held.append(np.mean(sizes[5000:]))
    assert 10 < held[0] / held[1] < 20


def test_samples_that_must_go_alone_do_not_wait_in_the_window():
    """A sample longer than half the budget is a batch of its own whatever arrives later, so it
    is cut first and never left to fill the token window (it holds 2/3 of the tokens fed here)."""
    rng = np.random.default_rng(6)
    f = BatchFormer(BatchingPolicy(1000, lookahead_tokens=16_000))
    for i in range(20_000):
        n = int(rng.integers(600, 1000)) if i % 10 == 0 else int(rng.integers(10, 60))
        if f.add(MeasuredSample(i, n)) and i > 2000:  # past the start-up, after every cut
            assert [s for s in f.samples() if s.num_tokens > 500] == []


def test_planner_rejects_bad_arguments():
    policy = BatchingPolicy(100)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        StepPlanner(policy, 0)
    with pytest.raises(ValueError, match="mode must be one of"):
        StepPlanner(policy, 2, "bogus")


def test_restore_rejects_other_world_size():
    p = StepPlanner(BatchingPolicy(100), 2)
    with pytest.raises(ValueError, match="world_size 2, not 4"):
        StepPlanner.restore(p.snapshot(), BatchingPolicy(100), 4)


def test_negative_visual_tokens_quarantined_without_cap():
    policy = BatchingPolicy(100)
    events = run_epochs([[MeasuredSample("bad", 5, -1), MeasuredSample("ok", 5)]], policy, 1)
    (q,) = [e for e in events if isinstance(e, Quarantined)]
    assert q.sample.sample_id == "bad" and "num_visual_tokens=-1" in q.detail


def test_former_rejects_samples_that_cannot_fit():
    f = BatchFormer(BatchingPolicy(100, max_visual_tokens=5))
    for bad in (MeasuredSample(0, 0), MeasuredSample(1, 101), MeasuredSample(2, 10, 6)):
        with pytest.raises(ValueError, match="does not fit a batch on its own"):
            f.add(bad)


def test_compute_model_balances_attention_cost():
    """With b > 0 long-sequence batches cost more compute at equal tokens; steps group them."""
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(np.log(1000), 0.9, 8000).round(), 16, 8192).astype(int)
    policy = BatchingPolicy(16384, attn_b=1 / 1024)
    data = [samples(lengths.tolist())]
    events = run_epochs(data, policy, 8)
    check_plan(events, data, policy, 8, JobMode.JOIN)
    cm = policy.cost_model
    ratios = []
    for s in steps_of(events)[:-1]:
        c = [cm.compute_cost([x.num_tokens for x in b.samples]) for b in s.batches]
        ratios.append(max(c) / (sum(c) / len(c)))
    ratios.sort()
    assert ratios[len(ratios) // 2] < 1.05


def test_truncate_never_cuts_visual_tokens():
    policy = BatchingPolicy(100, over_budget="truncate")
    data = [[MeasuredSample("img", 300, 150), MeasuredSample("txt", 300, 20)]]
    events = run_epochs(data, policy, 1)
    check_plan(events, data, policy, 1, JobMode.JOIN)
    (q,) = [e for e in events if isinstance(e, Quarantined)]
    assert q.sample.sample_id == "img" and "150 visual tokens cannot be truncated" in q.detail
    (step,) = steps_of(events)
    assert step.batches[0].truncated_to == {"txt": 100}


def test_cli_empty_file(tmp_path, capsys):
    from pipeline.cli import main

    p = tmp_path / "empty.txt"
    p.write_text("")
    assert (
        main(["plan", "--lengths", str(p), "--world-size", "4", "--token-budget", "9", "--json"])
        == 0
    )
    import json

    d = json.loads(capsys.readouterr().out)
    assert d["samples"] == 0 and d["steps"] == 0 and d["per_rank_steps"] == [0, 0, 0, 0]
