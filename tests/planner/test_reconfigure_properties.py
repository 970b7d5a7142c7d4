"""Property tests of `StepPlanner.reconfigure`: the rest of an epoch moves onto a new world size.

A run feeds part of the input with W ranks, "publishes" what was emitted, voids the last few
published steps (and, for a rank that died, its batches after its last acknowledged step), hands
those batches back with `reconfigure(N, returned, first_step=...)` and plans the rest with N
ranks. Whatever the sizes, the switch point and the returned set:
- budget holds for every batch (or it is flagged over budget);
- every step of each world is aligned for that world: batches only for its ranks, all of them
  except join mode's last partial step of an epoch (quota: always all, fillers only at the close);
- identity coverage across both worlds: the samples of the kept old-world batches plus those of
  the new world's batches (and the quarantined) are exactly the input, each once;
- step numbers are write-once: the new world starts at `first_step` and counts on contiguously;
- loss-scale info is exact on both sides (each step's totals are its batches' sums);
- determinism, and snapshot/restore right before or right after the switch changes nothing.
"""

from __future__ import annotations

import json
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.modes import DGAP_MODES, JobMode, OverBudgetPolicy
from pipeline.planner.compute_fit import FEATURES, ComputeModel
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import PlannerState, StepPlanner
from pipeline.planner.types import (
    Collate,
    EpochEnd,
    MeasuredSample,
    Quarantined,
    Step,
    WorldStamp,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw):
    budget = draw(st.integers(8, 300))
    policy = BatchingPolicy(
        token_budget=budget,
        collate=draw(st.sampled_from(list(Collate))),
        lookahead_tokens=budget * draw(st.integers(1, 6)),
        max_window_samples=draw(st.integers(1, 32)),
        over_budget=draw(st.sampled_from(list(OverBudgetPolicy))),
        attn_b=draw(st.sampled_from([0.0, 0.001])),
    )
    old = draw(st.sampled_from([1, 2, 3, 4, 8]))
    new = draw(st.sampled_from([1, 2, 3, 4, 8]))
    n_epochs = draw(st.integers(1, 2))
    n = draw(st.integers(0, 90))
    base = [MeasuredSample(i, draw(st.integers(0, budget + budget // 4)), 0,
                           draw(st.integers(0, 5))) for i in range(n)]
    epochs = [base] + [draw(st.permutations(base)) for _ in range(n_epochs - 1)]
    # The switch happens before operation `at` of the sequence "feed each sample, end the
    # epoch" (so also between epochs, after an END).
    ops = sum(len(e) + 1 for e in epochs)
    at = draw(st.integers(0, ops - 1))
    return {
        "policy": policy, "old": old, "new": new, "epochs": epochs, "at": at,
        "mode": draw(st.sampled_from(list(DGAP_MODES))), "seed": draw(st.integers(0, 2**31)),
        "pool_steps": draw(st.sampled_from([None, 1, 2, 3])),
        "voided": draw(st.integers(0, 4)),  # published steps at the end that the old world
        "dead": draw(st.sets(st.integers(0, 7), max_size=2)),  # never runs; ranks that died
        "dead_lag": draw(st.integers(0, 3)),  # steps before B the dead ranks did not ack
        "gap": draw(st.integers(0, 2)),  # extra step numbers skipped at the switch
        "snapshot": draw(st.sampled_from(["none", "before", "after"])),
        # Balanced by a fitted compute model (it carries over the switch) or by the policy.
        "compute_model": draw(st.one_of(st.none(), st.builds(
            lambda c: ComputeModel(c), st.tuples(*[st.floats(0, 1e-2)] * len(FEATURES))))),
    }


def _roundtrip(p: StepPlanner, sc: dict, world: int) -> StepPlanner:
    state = PlannerState.from_dict(json.loads(json.dumps(p.snapshot().to_dict())))
    return StepPlanner.restore(state, sc["policy"], world, sc["mode"], sc["seed"],
                               sc["pool_steps"], generation=p.world.generation)


def run(sc: dict) -> tuple[list, list, int]:
    """(old-world events as run, new-world events, the new world's first step)."""
    old, new = sc["old"], sc["new"]
    p = StepPlanner(sc["policy"], old, sc["mode"], sc["seed"], sc["pool_steps"],
                    compute_model=sc["compute_model"])
    ops = [(e, s) for e, samples in enumerate(sc["epochs"]) for s in [*samples, None]]
    last_epoch = len(sc["epochs"]) - 1
    before: list = []

    def apply(op, events):
        e, s = op
        events.extend(p.feed(s) if s is not None else p.end_epoch(last_epoch=e == last_epoch))

    for op in ops[:sc["at"]]:
        apply(op, before)
    # Steps after the last published END can be voided (an END delivered to anyone is kept:
    # the boundary never falls before it).
    ends = [i for i, ev in enumerate(before) if isinstance(ev, EpochEnd)]
    tail = [ev for ev in before[(ends[-1] + 1 if ends else 0):] if isinstance(ev, Step)]
    voided = tail[len(tail) - min(sc["voided"], len(tail)):]
    kept_steps = [ev for ev in before if isinstance(ev, Step) and ev not in voided]
    dead = {r for r in sc["dead"] if r < old} if new < old else set()
    returned = [bt for st_ in voided for bt in st_.batches]
    lagging = kept_steps[len(kept_steps) - min(sc["dead_lag"], len(kept_steps)):]
    for st_ in lagging:  # a dead rank's batches after its last ack go back too
        returned += [bt for bt in st_.batches if bt.rank in dead]
    returned.sort(key=lambda bt: next(s.step for s in before if isinstance(s, Step)
                                      and bt in s.batches) * 100 + bt.rank)
    if sc["snapshot"] == "before":
        p = _roundtrip(p, sc, old)
    first = p.next_step + sc["gap"]
    after = list(p.reconfigure(new, returned, first_step=first, pool_steps=sc["pool_steps"]))
    if sc["snapshot"] == "after":
        p = _roundtrip(p, sc, new)
    for op in ops[sc["at"]:]:
        apply(op, after)
    old_events = [ev for ev in before if not (isinstance(ev, Step) and ev in voided)]
    # The old world's kept steps without the returned batches of the dead ranks.
    back = {id(bt) for bt in returned}
    old_events = [Step(ev.epoch, ev.step, tuple(bt for bt in ev.batches if id(bt) not in back),
                       ev.info, ev.world) if isinstance(ev, Step) else ev for ev in old_events]
    return old_events, after, first


def _check_batch(bt, policy: BatchingPolicy) -> None:
    if not bt.over_budget:
        assert bt.cost <= policy.token_budget


def _check_info(step: Step) -> None:
    real = [bt for bt in step.batches if not bt.filler]
    assert step.info.step_samples == sum(len(bt.samples) for bt in real)
    assert step.info.step_tokens == sum(bt.num_tokens for bt in real)
    assert step.info.step_loss_tokens == sum(bt.loss_tokens for bt in real)


@SETTINGS
@given(scenarios())
def test_a_reconfiguration_keeps_every_guarantee_across_both_worlds(sc):
    old_events, new_events, first = run(sc)
    policy, mode = sc["policy"], JobMode(sc["mode"])
    old, new = sc["old"], sc["new"]
    # Every step and END knows its world: the old one's (0), then the next (1).
    assert {ev.world for ev in old_events if isinstance(ev, Step | EpochEnd)} <= {
        WorldStamp(0, old)}
    assert {ev.world for ev in new_events if isinstance(ev, Step | EpochEnd)} <= {
        WorldStamp(1, new)}
    # Old world: its ranks only; loss-scale info as planned for the batches it runs.
    for ev in old_events:
        if isinstance(ev, Step):
            assert all(0 <= bt.rank < old for bt in ev.batches)
            for bt in ev.batches:
                _check_batch(bt, policy)
    # New world: numbered from first_step on, contiguous, its ranks only, aligned.
    new_steps = [ev for ev in new_events if isinstance(ev, Step)]
    assert [s.step for s in new_steps] == list(range(first, first + len(new_steps)))
    assert all(s.compute == sc["compute_model"] for s in new_steps), "the model carries over"
    ends = [ev for ev in new_events if isinstance(ev, EpochEnd)]
    for s in new_steps:
        assert sorted(bt.rank for bt in s.batches) == sorted({bt.rank for bt in s.batches})
        assert all(0 <= bt.rank < new for bt in s.batches)
        for bt in s.batches:
            _check_batch(bt, policy)
        _check_info(s)
        last_of_epoch = max(x.step for x in new_steps if x.epoch == s.epoch)
        if mode is JobMode.QUOTA or s.step != last_of_epoch:
            assert len(s.batches) == new, f"step {s.step}: {len(s.batches)} of {new} ranks"
        if any(bt.filler for bt in s.batches):
            assert s is new_steps[-1]  # quota's closing step only
    for end in ends:
        assert len(end.final_step) == new  # the END names the world that ends the epoch
        mine = [s for s in new_steps if s.epoch == end.epoch]
        for r in range(new):
            got = [s.step for s in mine if s.batch_for(r) is not None]
            assert end.final_step[r] == (max(got) if got else None) or mode is JobMode.QUOTA
        if mode is JobMode.QUOTA and mine:
            assert set(end.final_step) == {mine[-1].step}
    # Identity coverage across both worlds (the job is closed: quota carries nothing out).
    fed = Counter(s.sample_id for ep in sc["epochs"] for s in ep)
    emitted = Counter(s.sample_id for ev in old_events + new_events if isinstance(ev, Step)
                      for bt in ev.batches if not bt.filler for s in bt.samples)
    quarantined = Counter(ev.sample.sample_id for ev in old_events + new_events
                          if isinstance(ev, Quarantined))
    assert emitted + quarantined == fed
    assert not (emitted & quarantined)


@SETTINGS
@given(scenarios())
def test_a_reconfiguration_is_deterministic_and_survives_snapshot_restore(sc):
    """Same inputs, same plan; restoring a snapshot right before or after the switch (JSON round
    trip, as the producer's checkpoint does) plans exactly what the uninterrupted planner does."""
    base = run({**sc, "snapshot": "none"})
    assert run({**sc, "snapshot": "none"}) == base
    for where in ("before", "after"):
        got = run({**sc, "snapshot": where})
        assert got[1] == base[1], f"snapshot {where} the switch changed the new world's plan"


def test_first_step_never_reuses_a_published_number():
    p = StepPlanner(BatchingPolicy(token_budget=100, lookahead_tokens=100), 2, pool_steps=1)
    for i in range(8):
        p.feed(MeasuredSample(i, 60))
    assert p.next_step > 0
    try:
        p.reconfigure(3, (), first_step=p.next_step - 1)
    except ValueError as exc:
        assert "never reused" in str(exc)
    else:
        raise AssertionError("a first_step before next_step was accepted")
    for bad in (0, -1, True, 2.0):
        try:
            p.reconfigure(bad, (), first_step=p.next_step)
        except ValueError:
            continue
        raise AssertionError(f"world_size {bad!r} accepted")
