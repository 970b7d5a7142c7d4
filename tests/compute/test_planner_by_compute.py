"""The planner balancing ranks by a fitted compute model: every DGAP guarantee still holds, the
epoch's samples are the same as under token balancing (only rank and step change), the model is
recorded in each step and in the snapshot, and a restore continues identically."""

from __future__ import annotations

import json
import random
from collections import Counter
from statistics import median

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.modes import JobMode
from pipeline.planner.compute_fit import ComputeModel, batch_features
from pipeline.planner.epochs import plan_epochs
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import PlannerState, StepPlanner
from pipeline.planner.types import Collate, EpochEnd, MeasuredSample, Step
from tests.planner.planner_checks import check_plan, scenarios

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# An image costs far more than its tokens; attention grows with L^2.
MODEL = ComputeModel((1e-3, 1e-6, 2e-6, 4e-9, 4e-5, 2e-2, 3e-4), 0.03, 64)
models = st.builds(lambda c: ComputeModel(c), st.tuples(*[st.floats(0, 1e-2)] * 7))


def plan(epochs, policy, w, mode, seed, model):
    planner = StepPlanner(policy, w, mode, seed, compute_model=model)
    return [ev for evs in plan_epochs(planner, epochs, close=True) for ev in evs]


def trained(events) -> list[Counter]:
    """Per epoch: how often each sample is trained (fillers are not training)."""
    out, cur = [], Counter()
    for ev in events:
        if isinstance(ev, Step):
            cur.update(s.sample_id for b in ev.batches if not b.filler for s in b.samples)
        elif isinstance(ev, EpochEnd):
            out.append(cur)
            cur = Counter()
    return out


@SETTINGS
@given(scenarios(), models)
def test_guarantees_hold_and_each_step_records_its_model(sc, model):
    policy, w, mode, seed, epochs = sc
    events = plan(epochs, policy, w, mode, seed, model)
    check_plan(events, epochs, policy, w, mode)
    assert all(ev.compute == model for ev in events if isinstance(ev, Step))
    assert all(ev.compute is None for ev in plan(epochs, policy, w, mode, seed, None)
               if isinstance(ev, Step))


@SETTINGS
@given(scenarios(), models)
def test_a_model_changes_only_rank_and_step_never_which_samples(sc, model):
    """Join: each epoch trains the same samples as under token balancing. Quota: which samples
    fill the aligned steps may carry into the next epoch differently, but the job trains every
    sample as often, and each epoch as many steps."""
    policy, w, mode, seed, epochs = sc
    by_tokens = plan(epochs, policy, w, mode, seed, None)
    by_model = plan(epochs, policy, w, mode, seed, model)
    if mode is JobMode.JOIN:
        assert trained(by_model) == trained(by_tokens)
    else:
        assert sum(trained(by_model), Counter()) == sum(trained(by_tokens), Counter())
    q = [ev.sample.sample_id for ev in by_tokens if not isinstance(ev, (Step, EpochEnd))]
    assert q == [ev.sample.sample_id for ev in by_model if not isinstance(ev, (Step, EpochEnd))]


@SETTINGS
@given(scenarios(), models, st.data())
def test_restore_with_a_model_continues_identically(sc, model, data):
    """The model is set partway (as the producer does when the gate opens); a snapshot taken
    after that, restored from JSON, carries it and continues with the same events."""
    policy, w, mode, seed, epochs = sc
    flat = [(e, s) for e, ss in enumerate(epochs) for s in ss] + [(len(epochs), None)]
    switch = data.draw(st.integers(0, len(flat)))
    cut = data.draw(st.integers(switch, len(flat)))
    last = len(epochs) - 1

    def drive(planner, lo, hi, out, cur=0):
        for i in range(lo, hi):
            if i == switch:
                planner.set_compute_model(model)
            e, s = flat[i]
            while cur < e:
                out.extend(planner.end_epoch(last_epoch=cur == last))
                cur += 1
            if s is not None:
                out.extend(planner.feed(s))
        return cur

    full: list = []
    drive(StepPlanner(policy, w, mode, seed), 0, len(flat), full)
    first = StepPlanner(policy, w, mode, seed)
    got: list = []
    cur = drive(first, 0, cut, got)
    state = PlannerState.from_dict(json.loads(json.dumps(first.snapshot().to_dict())))
    assert state == first.snapshot()
    assert state.compute_model == (model if switch < cut else None)
    second = StepPlanner.restore(state, policy, w, mode, seed)
    drive(second, cut, len(flat), got, cur)
    assert got == full


def test_without_a_model_the_snapshot_encodes_as_before():
    p = StepPlanner(BatchingPolicy(token_budget=64), 2)
    p.feed_many(MeasuredSample(i, 10 + i) for i in range(50))
    assert "compute_model" not in p.snapshot().to_dict()


def mixed_data(n: int, seed: int) -> list[MeasuredSample]:
    """Chat-like text with one sample in five an image (576 visual tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = int(rng.lognormvariate(5.5, 0.8)) + 1
        vis = 576 if rng.random() < 0.2 else 0
        out.append(MeasuredSample(i, min(text + vis, 4096), vis))
    return out


def test_balancing_by_the_model_evens_predicted_step_time():
    """Per-step max/mean of the model's predicted rank time: clearly better balanced by the
    model than by tokens, on a mix where images cost more than their tokens."""
    policy = BatchingPolicy(token_budget=4096, collate=Collate.PADDED)
    data = mixed_data(6000, 1)

    def imbalance(model):
        planner = StepPlanner(policy, 4, JobMode.JOIN, 0, compute_model=model)
        ratios = []
        for ev in planner.feed_many(data) + planner.end_epoch(last_epoch=True):
            if isinstance(ev, Step) and len(ev.batches) == 4:
                t = [MODEL.predict(batch_features(b.samples, [s.num_tokens for s in b.samples],
                                                  Collate.PADDED)) for b in ev.batches]
                ratios.append(max(t) / (sum(t) / 4))
        return median(ratios)

    by_tokens, by_model = imbalance(None), imbalance(MODEL)
    assert by_model < by_tokens
    assert by_model <= 1.05
