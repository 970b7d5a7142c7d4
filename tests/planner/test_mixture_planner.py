"""The planner with a mixture's source shares in force (`set_source_targets`): every guarantee
of the plain planner still holds (budget, coverage, alignment, termination), it is still
deterministic and continues identically from a snapshot (a JSON round trip included), and with
global steps a step holds the same samples at any world size. Only which formed unit goes next
changes."""

from __future__ import annotations

import dataclasses
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_checks import check_plan, scenarios
from test_global_steps import check_global_plan, jobs

from pipeline.planner.step_planner import PlannerState, StepPlanner

# the plain planner's properties run at 120 examples; these check that shares break none
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mixtures(draw, epochs):
    """Each sample of the epochs a source (the same in every epoch), and targets."""
    k = draw(st.integers(2, 3))
    ids = sorted({s.sample_id for ep in epochs for s in ep}, key=str)
    source = {i: draw(st.integers(0, k - 1)) for i in ids}
    tagged = [[dataclasses.replace(s, source=source[s.sample_id]) for s in ep] for ep in epochs]
    counts = draw(st.lists(st.integers(0, 50), min_size=k, max_size=k).filter(lambda c: sum(c)))
    return tagged, counts, draw(st.sampled_from(["samples", "loss_tokens"]))


def _drive(planner: StepPlanner, flat: list, out: list, cur: int, last: int) -> int:
    for e, s in flat:
        while cur < e:
            out.extend(planner.end_epoch(last_epoch=cur == last))
            cur += 1
        if s is not None:
            out.extend(planner.feed(s))
    return cur


@SETTINGS
@given(scenarios(), st.data())
def test_a_mixtures_plan_keeps_every_guarantee_and_replays_from_a_snapshot(sc, data):
    policy, w, mode, seed, epochs = sc
    epochs, counts, by = data.draw(mixtures(epochs))
    flat = [(e, s) for e, ss in enumerate(epochs) for s in ss] + [(len(epochs), None)]
    last = len(epochs) - 1

    def planner() -> StepPlanner:
        p = StepPlanner(policy, w, mode, seed)
        p.set_source_targets(counts, by)
        return p

    full: list = []
    _drive(planner(), flat, full, 0, last)
    check_plan(full, epochs, policy, w, mode)
    again: list = []
    _drive(planner(), flat, again, 0, last)
    assert again == full  # deterministic

    cut = data.draw(st.integers(0, len(flat)))
    first = planner()
    got: list = []
    cur = _drive(first, flat[:cut], got, 0, last)
    state = PlannerState.from_dict(json.loads(json.dumps(first.snapshot().to_dict())))
    assert state == first.snapshot()
    second = StepPlanner.restore(state, policy, w, mode, seed)
    _drive(second, flat[cut:], got, cur, last)
    assert got == full


@SETTINGS
@given(jobs(), st.data())
def test_a_mixtures_global_steps_hold_the_same_samples_at_any_world_size(job, data):
    epochs, counts, by = data.draw(mixtures(job["epochs"]))
    job = {**job, "epochs": epochs}

    def with_shares(world: int) -> list:  # test_global_steps.plan, the mixture's shares set
        p = StepPlanner(job["policy"], world, job["mode"], job["seed"],
                        compute_model=job["compute_model"])
        p.set_source_targets(counts, by)
        events: list = []
        for e, samples in enumerate(epochs):
            events += p.feed_many(samples)
            events += p.end_epoch(last_epoch=e == len(epochs) - 1)
        return events

    reference = check_global_plan(with_shares(1), job, 1)
    for world in (2, 3, job["other_w"]):
        assert check_global_plan(with_shares(world), job, world) == reference
