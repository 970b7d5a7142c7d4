"""SDO's epoch visits: budget and unique visit ids per epoch, the coverage floor over 20 epochs,
determinism, exact continuation from a restored (JSON) ledger, and DGAP guarantees unchanged
when the planner is fed the visits."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sdo_cases import graph_of, run_epochs

from pipeline.organization.epoch_visits import plan_epoch_visits, split_visit_id
from pipeline.organization.exposure_ledger import ExposureLedger
from pipeline.organization.locality import planner_lookahead, repeat_gap
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import MeasuredSample, Step
from tests.planner.planner_checks import check_plan

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def knobs(draw):
    n = draw(st.integers(1, 90))
    c = draw(st.integers(1, 4))
    low = math.ceil(n / c)
    v = draw(st.one_of(st.none(), st.integers(low, 2 * n + 1)))
    return {
        "n": n, "k": draw(st.integers(1, 10)), "clusters": draw(st.integers(1, 6)),
        "coverage_epochs": c, "visits_per_epoch": v, "seed": draw(st.integers(-5, 10**6)),
        "data_seed": draw(st.integers(0, 1000)),
    }


def _graph(kn):
    g, _ = graph_of(kn["n"], kn["k"], seed=kn["data_seed"], clusters=kn["clusters"])
    return g


@SETTINGS
@given(knobs())
def test_every_epoch_is_its_budget_of_distinct_visits_and_the_floor_holds(kn):
    g = _graph(kn)
    c = kn["coverage_epochs"]
    budget = kn["visits_per_epoch"] or g.size
    epochs, ledger = run_epochs(g, 20, seed=kn["seed"], coverage_epochs=c,
                                visits_per_epoch=kn["visits_per_epoch"])
    last_seen = dict.fromkeys(g.ids, -1)
    exposure: Counter = Counter()
    longest = dict.fromkeys(g.ids, 0)
    for e, ev in enumerate(epochs):
        assert ev.epoch == e
        ids = ev.visit_ids
        assert len(ids) == budget, "an epoch is exactly its budget of visits"
        assert len(set(ids)) == len(ids), "visit ids are unique within the epoch"
        per = Counter(v.sample_id for v in ev.visits)
        ks: dict = {}
        for v in ev.visits:  # k counts the sample's visits in this epoch, in order: 0, 1, ...
            assert split_visit_id(v.visit_id) == (v.sample_id, v.k)
            ks.setdefault(v.sample_id, []).append(v.k)
        assert all(k == list(range(len(k))) for k in ks.values())
        assert ev.mandatory <= budget
        for sid in g.ids:
            if per[sid]:
                longest[sid] = max(longest[sid], e - last_seen[sid] - 1)
                last_seen[sid] = e
            else:
                longest[sid] = max(longest[sid], e - last_seen[sid])
            assert e - last_seen[sid] < c, f"{sid} unseen for {c} epochs (coverage floor)"
        exposure.update(per)
    # The ledger is exactly the history above.
    idx = g.index
    assert all(ledger.exposure[idx[s]] == exposure[s] for s in g.ids)
    assert all(ledger.last_seen[idx[s]] == last_seen[s] for s in g.ids)
    assert all(ledger.max_unseen[idx[s]] == longest[s] for s in g.ids)
    assert ledger.summary()["max_epochs_unseen"] <= c - 1


@SETTINGS
@given(knobs(), st.integers(0, 19))
def test_same_seed_same_epochs_and_a_restored_ledger_continues_identically(kn, cut):
    g = _graph(kn)
    kw = {"seed": kn["seed"], "coverage_epochs": kn["coverage_epochs"],
          "visits_per_epoch": kn["visits_per_epoch"]}
    full, end = run_epochs(g, 20, **kw)
    again, end2 = run_epochs(g, 20, **kw)
    assert [e.visits for e in again] == [e.visits for e in full]
    assert end2 == end
    head, mid = run_epochs(g, cut, **kw)
    restored = ExposureLedger.from_dict(json.loads(json.dumps(mid.to_dict())))
    tail, end3 = run_epochs(g, 20 - cut, ledger=restored, first_epoch=cut, **kw)
    assert [e.visits for e in head + tail] == [e.visits for e in full]
    assert end3 == end


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(knobs(), st.integers(1, 4), st.sampled_from(["join", "quota"]),
       st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 1000))
def test_planner_fed_the_visits_keeps_budget_alignment_and_exactly_once(kn, w, mode, loc, ls):
    g = _graph(kn)
    lens = np.random.default_rng(ls).integers(1, 900, g.size)
    measured = {sid: MeasuredSample(sid, int(n), 0, int(n) // 2)
                for sid, n in zip(g.ids, lens, strict=True)}
    window = planner_lookahead(loc, 16 * 1024, 1024)
    policy = BatchingPolicy(token_budget=1024, over_budget="alone", lookahead_tokens=window)
    epochs, _ = run_epochs(g, 3, seed=kn["seed"], coverage_epochs=kn["coverage_epochs"],
                           visits_per_epoch=kn["visits_per_epoch"],
                           repeat_gap=repeat_gap(window, float(lens.mean())))
    fed = [ev.planner_samples(measured) for ev in epochs]
    planner = StepPlanner(policy, w, mode, seed=kn["seed"])
    events = []
    for e, samples in enumerate(fed):
        events += planner.feed_many(samples)
        events += planner.end_epoch(last_epoch=e == len(fed) - 1)
    check_plan(events, fed, policy, w, mode)  # budget, alignment, every visit exactly once
    if mode == "join":
        for e, ev in enumerate(epochs):
            got = [sid for s in events if isinstance(s, Step) and s.epoch == e
                   for b in s.batches for sid in b.sample_ids]
            assert sorted(got) == sorted(ev.visit_ids)


def test_coverage_floor_that_cannot_hold_is_refused_naming_the_setting():
    g, _ = graph_of(30)
    with pytest.raises(ValueError, match="visits_per_epoch"):
        run_epochs(g, 3, coverage_epochs=2, visits_per_epoch=14)  # 14 * 2 < 30
    run_epochs(g, 6, coverage_epochs=2, visits_per_epoch=15)  # 15 * 2 == 30 holds


def test_ledger_of_another_graph_or_epoch_is_refused():
    g, _ = graph_of(20)
    other, _ = graph_of(20, seed=1)
    _, ledger = run_epochs(g, 2)
    with pytest.raises(ValueError, match="another KNN graph"):
        plan_epoch_visits(other, ledger, 2, seed=0, coverage_epochs=2)
    with pytest.raises(ValueError, match="before epoch 2"):
        plan_epoch_visits(g, ledger, 1, seed=0, coverage_epochs=2)
    bad = ledger.to_dict()
    bad["last_seen"][0] = 5  # a visit in the future
    with pytest.raises(ValueError, match="inconsistent"):
        ExposureLedger.from_dict(bad)
