"""Property tests: the planner's guarantees hold for arbitrary inputs and settings."""

from __future__ import annotations

import json
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_checks import check_plan, run_epochs, scenarios

from pipeline.modes import JobMode
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import PlannerState, StepPlanner
from pipeline.planner.types import (
    EpochEnd,
    MeasuredSample,
    Quarantined,
    Step,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scenarios())
def test_guarantees_hold(sc):
    """Budget, coverage (join: exactly once; quota: carried, never dropped, and the job's last
    step closes it with fillers), equal step counts (quota), in-band final steps, step info
    (loss tokens = the batches' sum, fillers excluded), bounded termination."""
    policy, w, mode, seed, epochs = sc
    events = run_epochs(epochs, policy, w, mode, seed)
    check_plan(events, epochs, policy, w, mode)


@SETTINGS
@given(scenarios())
def test_quota_job_emits_every_sample_of_every_epoch_exactly_once(sc):
    """Guarantee 3, quota mode, over the whole job: each (epoch, sample) fed is emitted once
    (or quarantined), every rank gets the same steps, fillers only in the last step."""
    policy, w, _, seed, epochs = sc
    events = run_epochs(epochs, policy, w, JobMode.QUOTA, seed)
    info = check_plan(events, epochs, policy, w, JobMode.QUOTA)
    emitted = Counter(s.sample_id for e in events if isinstance(e, Step)
                      for b in e.batches if not b.filler for s in b.samples)
    quarantined = Counter(e.sample.sample_id for e in events if isinstance(e, Quarantined))
    assert emitted + quarantined == Counter(s.sample_id for ep in epochs for s in ep)
    per_rank = Counter(b.rank for e in events if isinstance(e, Step) for b in e.batches)
    assert set(per_rank.values()) <= {info["steps"]} and len(per_rank) in (0, w)
    if info["filler_steps"]:
        (closing,) = info["filler_steps"]
        assert sum(not b.filler for b in closing.batches) >= 1  # never a step of fillers only
    # Without closing, the same plan carries the remainder out of the job instead.
    open_events = run_epochs(epochs, policy, w, JobMode.QUOTA, seed, close=False)
    check_plan(open_events, epochs, policy, w, JobMode.QUOTA, closed=False)
    carried = [e for e in open_events if isinstance(e, EpochEnd)][-1].carried_over
    assert bool(carried) == bool(info["filler_steps"])


@SETTINGS
@given(scenarios())
def test_deterministic_and_seed_only_permutes_ranks(sc):
    policy, w, mode, seed, epochs = sc
    a = run_epochs(epochs, policy, w, mode, seed)
    b = run_epochs(epochs, policy, w, mode, seed)
    assert a == b
    c = run_epochs(epochs, policy, w, mode, seed + 1)

    def batches(evs):
        return [
            (e.step, sorted(bt.sample_ids for bt in e.batches)) for e in evs if isinstance(e, Step)
        ]

    assert batches(c) == batches(a)


@SETTINGS
@given(scenarios(), st.data())
def test_snapshot_restore_continues_identically(sc, data):
    policy, w, mode, seed, epochs = sc
    flat = [(e, s) for e, ss in enumerate(epochs) for s in ss] + [(len(epochs), None)]
    cut = data.draw(st.integers(0, len(flat)))

    last = len(epochs) - 1

    def drive(planner, items, out, cur=0):
        for e, s in items:
            while cur < e:
                out.extend(planner.end_epoch(last_epoch=cur == last))
                cur += 1
            if s is not None:
                out.extend(planner.feed(s))
        return cur

    full: list = []
    drive(StepPlanner(policy, w, mode, seed), flat, full)

    first = StepPlanner(policy, w, mode, seed)
    got: list = []
    # Replay the prefix with the epoch boundaries (the job's closing step included when the cut
    # is after it), then restore and continue.
    cur = drive(first, flat[:cut], got)
    state = first.snapshot()
    assert state.epoch == cur
    # The state survives a JSON round trip (the coordinator keeps it in Redis).
    state = PlannerState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert state == first.snapshot()
    second = StepPlanner.restore(state, policy, w, mode, seed)
    drive(second, flat[cut:], got, cur)
    assert got == full


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=0, max_size=400),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 64),
)
def test_bounded_termination_join(lengths, w, window):
    """After the input ends, END arrives within ceil(held/W)+1 steps and only the last step can
    leave ranks out."""
    policy = BatchingPolicy(token_budget=300, max_window_samples=window)
    p = StepPlanner(policy, w, JobMode.JOIN)
    for i, n in enumerate(lengths):
        p.feed(MeasuredSample(i, n))
    held = p.buffered
    tail = p.end_epoch()
    steps = [e for e in tail if isinstance(e, Step)]
    assert len(steps) <= held  # never more steps than samples still held
    assert sum(len(s.batches) < w for s in steps) <= 1
    assert all(len(s.batches) == w for s in steps[:-1])
