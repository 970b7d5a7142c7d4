"""Guarantee 12 on the pure planner: with `global_token_budget` a step's samples do not depend on
the world size, nor on reconfigurations (docs/global-steps.md).

The same input planned at W = 1, 2, 3, 4 (and one more size up to 8): every step holds the same
samples under the same `optimizer_step` with the same loss-scale totals, every rank has at
least one micro-batch in every step, every micro-batch fits `token_budget` (over-budget ones
alone and flagged), a step's cost stays within G, fillers only where the step has fewer
samples than ranks, every sample once per epoch. A run moved 4 -> 2 -> 3 mid-epoch (its voided
steps handed back whole, snapshots taken around each switch) trains the steps of the run that
never moved, each once, with write-once step numbers. `micro_split` alone: every formed batch
placed once, the ranks' loads within one batch of each other (longest-processing-time first).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import TrainingJobConfig
from pipeline.modes import DGAP_MODES, OverBudgetPolicy
from pipeline.planner.compute_fit import FEATURES, ComputeModel
from pipeline.planner.micro_split import split_step
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import PlannerState, StepPlanner
from pipeline.planner.types import (
    Collate,
    EpochEnd,
    MeasuredSample,
    PendingBatch,
    Quarantined,
    Step,
)

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def jobs(draw):
    budget = draw(st.integers(4, 300))
    vcap = draw(st.one_of(st.none(), st.integers(1, 60)))
    policy = BatchingPolicy(
        token_budget=budget,
        collate=draw(st.sampled_from(list(Collate))),
        # Windows past the ramp's first one (16 budgets) too, so the ramp shapes the plan.
        lookahead_tokens=budget * draw(st.sampled_from([1, 2, 3, 5, 8, 32, 64])),
        max_window_samples=draw(st.sampled_from([1, 3, 8, 40, 10_000])),
        over_budget=draw(st.sampled_from(list(OverBudgetPolicy))),
        max_visual_tokens=vcap,
        attn_b=draw(st.sampled_from([0.0, 0.001])),
        ramp_up=draw(st.booleans()),
        global_token_budget=budget * draw(st.integers(1, 10)) + draw(st.integers(0, budget)),
        # Sequences padded to a multiple (a group's CP): the budgets cap the padded lengths.
        pad_to_multiple=draw(st.sampled_from([None, None, 1, 2, 3, 4])),
    )
    n = draw(st.integers(0, 110))
    visual = st.integers(0, 80) if vcap is not None else st.just(0)
    base = []
    for i in range(n):
        tokens = draw(st.integers(0, budget + budget // 3))
        base.append(MeasuredSample(i, tokens, draw(visual), draw(st.integers(0, max(0, tokens)))))
    epochs = [base] + [draw(st.permutations(base)) for _ in range(draw(st.integers(0, 1)))]
    return {
        "policy": policy, "epochs": epochs, "mode": draw(st.sampled_from(list(DGAP_MODES))),
        "seed": draw(st.integers(0, 2**31)), "other_w": draw(st.integers(5, 8)),
        "compute_model": draw(st.one_of(st.none(), st.builds(
            lambda c: ComputeModel(c), st.tuples(*[st.floats(0, 1e-2)] * len(FEATURES))))),
    }


def plan(job: dict, world: int) -> list:
    p = StepPlanner(job["policy"], world, job["mode"], job["seed"],
                    compute_model=job["compute_model"])
    events: list = []
    last = len(job["epochs"]) - 1
    for e, samples in enumerate(job["epochs"]):
        events += p.feed_many(samples)
        events += p.end_epoch(last_epoch=e == last)
    return events


def check_global_plan(events: list, job: dict, world: int) -> dict[int, tuple]:
    """Every guarantee of a global plan at `world` ranks; returns optimizer step -> (epoch,
    its samples, its totals): what must not depend on the world."""
    policy: BatchingPolicy = job["policy"]
    cm = policy.cost_model
    budget, vcap, g = policy.token_budget, policy.max_visual_tokens, policy.global_token_budget
    by_opt: dict[int, tuple] = {}
    epoch, emitted, quarantined = 0, Counter(), Counter()
    last = None
    for ev in events:
        if isinstance(ev, Step):
            assert ev.epoch == epoch
            assert ev.world.size == world
            assert ev.step == ev.info.optimizer_step == len(by_opt), "no reconfiguration here"
            assert [(b.rank, b.micro) for b in ev.batches] == sorted(
                (b.rank, b.micro) for b in ev.batches)
            assert ev.ranks() == list(range(world)), "every rank runs every global step"
            for r in range(world):
                assert [b.micro for b in ev.micros_for(r)] == list(
                    range(len(ev.micros_for(r))))
            real = [b for b in ev.batches if not b.filler]
            fillers = [b for b in ev.batches if b.filler]
            assert real, "a step holds samples"
            for b in ev.batches:
                lens = [b.truncated_to.get(s.sample_id, s.num_tokens) for s in b.samples]
                assert b.cost == cm.token_cost(lens)
                if b.over_budget:
                    assert len(b.samples) == 1
                else:
                    assert b.cost <= budget, "every micro-batch fits token_budget"
                    if vcap is not None:
                        assert sum(s.num_visual_tokens for s in b.samples) <= vcap
            # Fillers: only for ranks the step's samples cannot reach, each its rank's only one.
            if fillers:
                assert len(real) + len(fillers) == world
                assert all(len(b.samples) == 1 or b.over_budget for b in real)
                assert all(len(ev.micros_for(b.rank)) == 1 and b.loss_tokens == 0
                           for b in fillers)
                ids = {s for b in real for s in b.samples}
                assert all(b.samples[0] in ids for b in fillers), "a filler copies a sample"
            total = sum(b.cost for b in real)
            assert total <= g or (len(real) == 1 and real[0].over_budget) or any(
                b.over_budget for b in real), f"step cost {total} over G={g}"
            assert ev.info.step_samples == sum(len(b.samples) for b in real)
            assert ev.info.step_tokens == sum(b.num_tokens for b in real)
            assert ev.info.step_loss_tokens == sum(b.loss_tokens for b in real)
            samples = Counter(s.sample_id for b in real for s in b.samples)
            emitted.update(samples)
            by_opt[ev.info.optimizer_step] = (ev.epoch, samples, ev.info.step_samples,
                                              ev.info.step_tokens, ev.info.step_loss_tokens)
            last = ev.step
        elif isinstance(ev, Quarantined):
            quarantined[ev.sample.sample_id] += 1
        elif isinstance(ev, EpochEnd):
            assert ev.carried_over == (), "every rank runs every step: nothing to carry"
            assert len(set(ev.final_step)) == 1 and len(ev.final_step) == world
            assert ev.final_step[0] == last
            fed = Counter(s.sample_id for s in job["epochs"][epoch])
            assert emitted + quarantined == fed, "every sample exactly once per epoch"
            epoch, emitted, quarantined, last = epoch + 1, Counter(), Counter(), None
    assert epoch == len(job["epochs"])
    return by_opt


@SETTINGS
@given(jobs())
def test_a_step_holds_the_same_samples_at_any_world_size(job):
    plans = {w: check_global_plan(plan(job, w), job, w) for w in (1, 2, 3, 4, job["other_w"])}
    reference = plans[1]
    for w, got in plans.items():
        assert got == reference, f"W={w} planned other steps than W=1"


@st.composite
def switches(draw):
    job = draw(jobs())
    ops = sum(len(e) + 1 for e in job["epochs"])
    a = draw(st.integers(0, ops - 1))
    b = draw(st.integers(a, ops - 1))
    return {**job, "at": (a, b), "voided": (draw(st.integers(0, 4)), draw(st.integers(0, 4))),
            "gap": draw(st.integers(0, 2)),
            "snapshot": draw(st.sampled_from(["none", "before", "after"]))}


def _roundtrip(p: StepPlanner, job: dict, world: int) -> StepPlanner:
    state = PlannerState.from_dict(json.loads(json.dumps(p.snapshot().to_dict())))
    return StepPlanner.restore(state, job["policy"], world, job["mode"], job["seed"],
                               generation=p.world.generation)


@SETTINGS
@given(switches())
def test_four_then_two_then_three_ranks_train_the_steps_of_the_run_that_never_moved(sc):
    """Each switch voids the newest published steps after the last END (the boundary never
    takes back an END: docs/elastic.md) and hands them back whole."""
    check_switches(sc)


def test_a_switch_while_the_window_ramps_up_keeps_the_steps():
    """The window's ramp counts the epoch's global steps, not step numbers (a switch skips
    numbers): switched after the first step, while the window still grows."""
    policy = BatchingPolicy(100, lookahead_tokens=6400, max_window_samples=10_000,
                            global_token_budget=300)
    samples = [MeasuredSample(i, 20 + (i * 37) % 80, 0, 5) for i in range(400)]
    for at in (30, 60, 120):
        check_switches({"policy": policy, "epochs": [samples], "mode": "join", "seed": 1,
                        "compute_model": None, "at": (at, at + 40), "voided": (1, 2), "gap": 2,
                        "snapshot": "none"})


def check_switches(sc: dict) -> None:
    reference = check_global_plan(plan(sc, 4), sc, 4)
    p = StepPlanner(sc["policy"], 4, sc["mode"], sc["seed"], compute_model=sc["compute_model"])
    ops = [(e, s) for e, samples in enumerate(sc["epochs"]) for s in [*samples, None]]
    last_epoch = len(sc["epochs"]) - 1
    trained: list[Step] = []  # steps some world ran, in step order
    pending: list = []  # events of the current world not yet "run"
    done = 0

    def run_ops(upto: int) -> None:
        nonlocal done
        for e, s in ops[done:upto]:
            pending.extend(p.feed(s) if s is not None
                           else p.end_epoch(last_epoch=e == last_epoch))
        done = upto

    for (at, voided), world in zip(zip(sc["at"], sc["voided"], strict=True), (2, 3),
                                   strict=True):
        run_ops(at)
        ends = [i for i, ev in enumerate(pending) if isinstance(ev, EpochEnd)]
        tail = [ev for ev in pending[(ends[-1] + 1 if ends else 0):] if isinstance(ev, Step)]
        back = tail[len(tail) - min(voided, len(tail)):]
        trained += [ev for ev in pending if isinstance(ev, Step) and ev not in back]
        pending.clear()
        if sc["snapshot"] == "before":
            p = _roundtrip(p, sc, p.world_size)
        first = p.next_step + sc["gap"]
        pending += p.reconfigure(world, [], first_step=first, voided=back)
        if sc["snapshot"] == "after":
            p = _roundtrip(p, sc, world)
        again = [ev for ev in pending if isinstance(ev, Step)][:len(back)]
        assert [s.info.optimizer_step for s in again] == [s.info.optimizer_step for s in back]
        assert all(s.step >= first and s.world.size == world for s in again)
    run_ops(len(ops))
    trained += [ev for ev in pending if isinstance(ev, Step)]
    numbers = [s.step for s in trained]
    assert numbers == sorted(set(numbers)), "step numbers are write-once"
    opts = [s.info.optimizer_step for s in trained]
    assert opts == list(range(len(reference))), "every optimizer step once, in order"
    for s in trained:
        assert s.ranks() == list(range(s.world.size))
        real = [b for b in s.batches if not b.filler]
        assert all(b.over_budget or b.cost <= sc["policy"].token_budget for b in real)
        _, samples, n, tokens, loss = reference[s.info.optimizer_step]
        assert Counter(x.sample_id for b in real for x in b.samples) == samples
        assert (s.info.step_samples, s.info.step_tokens, s.info.step_loss_tokens) == (
            n, tokens, loss), "the loss scale is the uninterrupted step's"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=1, max_size=12),
       st.integers(1, 9), st.integers(0, 2**31), st.booleans())
def test_micro_split_places_every_formed_batch_once_and_balances_loads(sizes, world, seed,
                                                                      over):
    ids = iter(range(10_000))
    units = [PendingBatch(tuple(MeasuredSample(next(ids), n) for n in sorted(lens)),
                          over_budget=over and len(lens) == 1) for lens in sizes]
    cost = lambda u: sum(u.lengths())  # noqa: E731 (packed cost)
    placed = split_step(units, world, cost, seed=seed, key=7)
    assert len(placed) == world and all(placed), "every rank gets at least one micro-batch"
    real = [u for mine in placed for u, filler in mine if not filler]
    assert Counter(s for u in real for s in u.samples) == Counter(
        s for u in units for s in u.samples), "every sample placed exactly once"
    samples = sum(len(u.samples) for u in units)
    unsplittable = sum(1 for u in units if u.over_budget) + sum(
        len(u.samples) for u in units if not u.over_budget)
    fillers = [u for mine in placed for u, filler in mine if filler]
    assert len(fillers) == max(0, world - min(samples, unsplittable))
    for mine in placed:
        assert not any(f for _, f in mine) or len(mine) == 1, "a filler is a rank's only one"
    loads = [sum(cost(u) for u, f in mine if not f) for mine in placed]
    if not fillers:
        assert max(loads) - min(loads) <= max(cost(u) for u in real), "LPT: within one batch"
    assert split_step(units, world, cost, seed=seed, key=7) == placed, "deterministic"


def test_a_snapshot_planned_with_another_batching_is_refused():
    plain = BatchingPolicy(64)
    glob = BatchingPolicy(64, global_token_budget=256)
    samples = [MeasuredSample(i, 10 + i % 40) for i in range(300)]
    for old, new in ((plain, glob), (glob, plain)):
        p = StepPlanner(old, 2)
        p.feed_many(samples)
        with pytest.raises(ValueError, match="global_token_budget"):
            StepPlanner.restore(p.snapshot(), new, 2)


def test_a_global_token_budget_below_the_token_budget_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"global_token_budget \(1000\) is below "
                                         r"token_budget \(4096\)"):
        BatchingPolicy(4096, global_token_budget=1000)
    with pytest.raises(ValueError) as err:
        TrainingJobConfig.model_validate({
            "job_id": "j", "world_size": 2, "source": {"paths": ["x.jsonl"]},
            "batching": {"token_budget": 4096, "global_token_budget": 1000}})
    text = str(err.value)
    assert "batching" in text and "global_token_budget (1000)" in text
    assert "token_budget (4096)" in text and "raise global_token_budget" in text


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_a_step_whose_batches_do_not_divide_by_the_world_is_balanced_by_pieces(world):
    """8 equal formed batches on 5 ranks: whole batches leave two ranks at half the others'
    load (max/mean 1.25); pieces of batches move to the light ranks until the step's slowest
    rank is within a few percent of the mean, every sample still placed once."""
    ids = iter(range(10_000))
    units = [PendingBatch(tuple(MeasuredSample(next(ids), 100) for _ in range(16)))
             for _ in range(8)]
    cost = lambda u: len(u.samples) * max(u.lengths())  # noqa: E731 (padded cost)
    placed = split_step(units, world, cost, seed=3, key=1)
    loads = [sum(cost(u) for u, f in mine if not f) for mine in placed]
    assert sum(loads) == 8 * 16 * 100
    assert max(loads) / (sum(loads) / world) <= 1.05, loads
    assert Counter(s for mine in placed for u, _ in mine for s in u.samples) == Counter(
        s for u in units for s in u.samples)
