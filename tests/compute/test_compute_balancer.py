"""The producer's half of compute balancing on a real (in-memory) job state: reports are matched
to their batches in the published plan, an ended world's reports are ignored and counted, the
gate's model is the one in force, a checkpoint's model carries over, and no report fails a
producer planning the job."""

from __future__ import annotations

import json
import math
import random

import pytest

from pipeline.config import ComputeBalancingConfig, TrainingJobConfig
from pipeline.jobstate import MemoryJobState, PlannerCheckpoint, Publication, RankCompute
from pipeline.planner.compute_fit import ComputeModel, batch_features
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Collate, MeasuredSample, Step
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.compute_balancing import ComputeBalancer
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings

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


def test_reports_open_the_gate_and_put_the_model_in_force():
    state, _, steps = published_job()
    balancer = ComputeBalancer(state, ComputeBalancingConfig(enabled=True), Collate.PADDED,
                               poll_seconds=0.0)
    reports = [RankCompute(0, s.step, b.rank, seconds(s, b.rank)) for s in steps
               for b in s.batches]
    reports += [RankCompute(1, steps[5].step, 0, 1.0)] * 3  # of a world that is not the job's
    reports += [RankCompute(0, steps[6].step, 1, float("nan"))]  # nonsense
    state.record_compute(reports)
    balancer.update(world=0, world_first_step=0, world_size=W)
    fit = state.compute_fit()
    assert fit.gate_open and fit.error < 1e-6 and balancer.model is not None
    assert (fit.stale, fit.rejected, fit.warmup, fit.fit_failures) == (3, 1, 3 * W, 0)
    assert balancer.model.coefficients == fit.coefficients
    assert [r for _, r in fit.imbalance] == [
        max(seconds(s, 0), seconds(s, 1)) * W / (seconds(s, 0) + seconds(s, 1))
        for s in steps[-len(fit.imbalance):]]
    last = steps[-1]
    assert fit.last_step == last.step  # balanced by tokens: measured, nothing predicted
    assert fit.last_measured == {b.rank: seconds(last, b.rank) for b in last.batches}
    assert fit.last_predicted == {}
    # Nothing new: nothing read again, the model stays.
    before = balancer.model
    balancer.update(world=0, world_first_step=0, world_size=W)
    assert balancer.model is before and state.compute_fit().accepted == fit.accepted


def test_a_checkpoint_model_carries_over_and_a_closed_gate_keeps_tokens():
    state, planner, _ = published_job(300)
    carried = StepPlanner(planner.policy, W, compute_model=PLANTED)
    balancer = ComputeBalancer(state, ComputeBalancingConfig(enabled=True), Collate.PADDED)
    balancer.adopt(carried)
    assert balancer.model == PLANTED and carried.compute_model == PLANTED
    # The same producer starting over from an older checkpoint (balanced by tokens): the fit's
    # model stays in force; the restored planner plans by its checkpoint's until the next one.
    older = StepPlanner(planner.policy, W)
    balancer.adopt(older)
    assert balancer.model == PLANTED and older.compute_model is None
    fresh = ComputeBalancer(state, ComputeBalancingConfig(enabled=True), Collate.PADDED,
                            poll_seconds=0.0)
    fresh.adopt(planner)
    fresh.update(world=0, world_first_step=0, world_size=W)  # no reports yet
    assert fresh.model is None and state.compute_fit() is None


class ReportingSource(ArraySource):
    """Plays the ranks of a compute-balanced job while a real producer plans it: before each
    row the producer reads, every step published since is reported (planted seconds), and the
    steps in `junk` are reported with those seconds as well (what a client may send)."""

    def __init__(self, items, state: MemoryJobState, junk: dict[int, float]) -> None:
        super().__init__(items)
        self.state, self.junk, self.reported = state, junk, -1

    def iter_epoch(self, epoch: int, start_row: int = 0):
        for item in super().iter_epoch(epoch, start_row):
            through = self.state.published_through()
            out = []
            for n in range(self.reported + 1, through + 1):
                step = self.state.get_step(n)
                out += [RankCompute(0, n, b.rank, seconds(step, b.rank)) for b in step.batches]
                if n in self.junk:
                    out.append(RankCompute(0, n, 0, self.junk[n]))
            self.state.record_compute(out)
            self.reported = max(self.reported, through)
            yield item


def compute_job(job_id: str = "cb", epochs: int = 2) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({
        "job_id": job_id, "world_size": W, "seed": 3, "epochs": epochs,
        "source": {"paths": ["arrays"]},
        "batching": {"token_budget": 1024, "max_window_samples": 32, "pool_steps": 2,
                     "compute_balancing": {"enabled": True, "min_reports": 8,
                                           "warmup_steps": 0}}})


def test_no_report_fails_the_job_and_a_restarted_fit_reads_them_again():
    """Subnormal, tiny, huge, negative, NaN and infinite seconds among the good reports of a
    planning producer: the job is planned to its end with no failure recorded, the nonsense is
    rejected and counted, the gate opens; a balancer that starts over (a replica restart reads
    the kept reports again) fits them without raising."""
    junk = {6: 5e-324, 7: 1e-300, 9: 1e-3, 11: -1.0, 12: math.nan, 13: math.inf, 14: 1e308,
            40: 5e-324, 41: 1e-4}
    state = MemoryJobState("cb", W)
    items = synthetic_samples(600, max_len=700, seed=3)
    job = compute_job()
    producer = Producer(job, state, ArrayFeed(ReportingSource(items, state, junk), "padded"),
                        holder="p", settings=ProducerSettings(
                            max_ahead=10**6, linger_seconds=0.0, compute_poll_seconds=0.0))
    assert producer.run() is Outcome.DONE
    assert state.error() is None and state.producer_failure() is None and state.is_done()
    fit = state.compute_fit()
    assert fit.gate_open and fit.rejected == 7  # 1e-3 and 1e-4 are absorbed by the fit
    again = ComputeBalancer(state, job.batching.compute_balancing, Collate.PADDED,
                            poll_seconds=0.0)
    again.update(world=0, world_first_step=0, world_size=W)
    assert again.fitter.rejected == fit.rejected and again.model is not None


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
    balancer.update(world=0, world_first_step=0, world_size=W)
    fit = state.compute_fit()
    assert fit.gate_open and fit.error < 1e-6
    assert fit.coefficients == pytest.approx(PLANTED.coefficients, rel=1e-4, abs=1e-12)
    assert fit.last_measured == {r: step_seconds(steps[-1], r) for r in range(W)}
    planner.set_compute_model(balancer.model)
    more = [e for e in planner.feed_many(MeasuredSample(10_000 + i, rng.randint(8, 900))
                                         for i in range(600)) if isinstance(e, Step)]
    assert more and all(s.compute == balancer.model for s in more)
