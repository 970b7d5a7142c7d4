"""The producer's half of compute balancing on a real (in-memory) job state: reports are matched
to their batches in the published plan, an ended world's reports are ignored and counted, the
gate's model reaches the planner, and a checkpoint's model carries over."""

from __future__ import annotations

import json
import random

import pytest

from pipeline.config import ComputeBalancingConfig
from pipeline.jobstate import MemoryJobState, PlannerCheckpoint, Publication, RankCompute
from pipeline.planner.compute_fit import ComputeModel, batch_features
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Collate, MeasuredSample, Step
from pipeline.producer.compute_balancing import ComputeBalancer

PLANTED = ComputeModel((1e-3, 2e-6, 1e-6, 3e-9, 0.0, 0.0, 5e-4))
W = 2


def published_job(n_samples: int = 2000):
    state = MemoryJobState("j", W)
    gen = state.claim_producer("p", 30.0)
    planner = StepPlanner(BatchingPolicy(token_budget=1024, ramp_up=False), W, pool_steps=4)
    rng = random.Random(0)
    data = [MeasuredSample(i, rng.randint(8, 900)) for i in range(n_samples)]
    steps = [e for e in planner.feed_many(data) if isinstance(e, Step)]
    cp = PlannerCheckpoint(0, n_samples, planner.next_step,
                           json.dumps(planner.snapshot().to_dict()).encode())
    state.publish(Publication(cp, tuple(steps), samples_in=n_samples), fence=gen)
    return state, planner, steps


def seconds(step: Step, rank: int) -> float:
    b = step.batch_for(rank)
    return PLANTED.predict(batch_features(b.samples, [s.num_tokens for s in b.samples],
                                          Collate.PADDED))


def test_reports_open_the_gate_and_the_planner_gets_the_model():
    state, planner, steps = published_job()
    balancer = ComputeBalancer(state, ComputeBalancingConfig(enabled=True), Collate.PADDED,
                               poll_seconds=0.0)
    reports = [RankCompute(0, s.step, b.rank, seconds(s, b.rank)) for s in steps
               for b in s.batches]
    reports += [RankCompute(1, steps[5].step, 0, 1.0)] * 3  # of a world that is not the job's
    reports += [RankCompute(0, steps[6].step, 1, float("nan"))]  # nonsense
    state.record_compute(reports)
    balancer.update(planner, world=0, world_first_step=0)
    fit = state.compute_fit()
    assert fit.gate_open and fit.error < 1e-6 and planner.compute_model is not None
    assert (fit.stale, fit.rejected, fit.warmup) == (3, 1, 3 * W)
    assert planner.compute_model.coefficients == fit.coefficients
    assert [r for _, r in fit.imbalance] == [
        max(seconds(s, 0), seconds(s, 1)) * W / (seconds(s, 0) + seconds(s, 1))
        for s in steps[-len(fit.imbalance):]]
    last = steps[-1]
    assert fit.last_step == last.step  # balanced by tokens: measured, nothing predicted
    assert fit.last_measured == {b.rank: seconds(last, b.rank) for b in last.batches}
    assert fit.last_predicted == {}
    # Nothing new: nothing read again, the model stays.
    before = planner.compute_model
    balancer.update(planner, world=0, world_first_step=0)
    assert planner.compute_model is before and state.compute_fit().accepted == fit.accepted


def test_a_checkpoint_model_carries_over_and_a_closed_gate_keeps_tokens():
    state, planner, _ = published_job(300)
    carried = StepPlanner(planner.policy, W, compute_model=PLANTED)
    balancer = ComputeBalancer(state, ComputeBalancingConfig(enabled=True), Collate.PADDED)
    balancer.adopt(carried)
    assert balancer.fitter.model == PLANTED and carried.compute_model == PLANTED
    fresh = ComputeBalancer(state, ComputeBalancingConfig(enabled=True), Collate.PADDED,
                            poll_seconds=0.0)
    fresh.adopt(planner)
    fresh.update(planner, world=0, world_first_step=0)  # no reports yet
    assert planner.compute_model is None and state.compute_fit() is None


def test_global_steps_a_ranks_report_covers_its_micro_batches():
    """A rank's report of a global step is its micro-batches' compute together: it is fitted
    on their summed features, so the planted per-batch model is found again (not a model of
    whole steps), and the planner then places micro-batches by it."""
    state = MemoryJobState("g", W)
    gen = state.claim_producer("p", 30.0)
    planner = StepPlanner(BatchingPolicy(token_budget=1024, ramp_up=False,
                                         global_token_budget=5 * 1024), W)
    rng = random.Random(1)
    data = [MeasuredSample(i, rng.randint(8, 900)) for i in range(2000)]
    steps = [e for e in planner.feed_many(data) if isinstance(e, Step)]
    assert any(len(s.micros_for(r)) > 1 for s in steps for r in range(W))
    cp = PlannerCheckpoint(0, len(data), planner.next_step,
                           json.dumps(planner.snapshot().to_dict()).encode())
    state.publish(Publication(cp, tuple(steps), samples_in=len(data)), fence=gen)

    def step_seconds(step: Step, rank: int) -> float:
        return sum(PLANTED.predict(batch_features(b.samples, [s.num_tokens for s in b.samples],
                                                  Collate.PADDED))
                   for b in step.micros_for(rank))

    state.record_compute([RankCompute(0, s.step, r, step_seconds(s, r)) for s in steps
                          for r in range(W)])
    balancer = ComputeBalancer(state, ComputeBalancingConfig(enabled=True), Collate.PADDED,
                               poll_seconds=0.0)
    balancer.update(planner, world=0, world_first_step=0)
    fit = state.compute_fit()
    assert fit.gate_open and fit.error < 1e-6
    assert fit.coefficients == pytest.approx(PLANTED.coefficients, rel=1e-4, abs=1e-12)
    assert fit.last_measured == {r: step_seconds(steps[-1], r) for r in range(W)}
    more = [e for e in planner.feed_many(MeasuredSample(10_000 + i, rng.randint(8, 900))
                                         for i in range(600)) if isinstance(e, Step)]
    assert more and all(s.compute == planner.compute_model for s in more)
