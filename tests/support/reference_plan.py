"""The plan a job gets on a fresh state, made in this process: what every served run of the
job must deliver at each (epoch, step, rank), whatever happened to it (Guarantee 11: a producer
or `serve` killed and restarted, a second run on fresh state).

The bootstrap producer's feed reads the job's order and preprocesses in this process; the Ray
feed of `serve` reads the same order (tests/order/test_feeds.py), so the plans are equal."""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.config import TrainingJobConfig
from pipeline.jobstate import MemoryJobState
from pipeline.planner.types import Step
from pipeline.producer.local_feed import LocalFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings

_SETTINGS = ProducerSettings(lease_seconds=30.0, max_ahead=10**9, linger_seconds=0.0,
                             poll_seconds=0.01)


def reference_steps(job: TrainingJobConfig | dict) -> list[Step]:
    """The job's published steps, planned on a fresh state without interruption."""
    if isinstance(job, dict):
        job = TrainingJobConfig.model_validate(job)
    state = MemoryJobState(job.job_id, job.world_size, job.mode)
    outcome = Producer(job, state, LocalFeed(job), holder="reference", settings=_SETTINGS).run()
    assert outcome is Outcome.DONE, outcome
    return [state.get_step(n) for n in range(state.published_through() + 1)]


def reference_plan(job: TrainingJobConfig | dict) -> dict[tuple[int, int, int], list[str]]:
    """(epoch, step, rank) -> the sample ids of that rank's batch (fillers included)."""
    return {(step.epoch, step.step, b.rank): [str(i) for i in b.sample_ids]
            for step in reference_steps(job) for b in step.batches}


def assert_same_plan(plan: dict[tuple[int, int, int], list[str]],
                     delivered: Iterable[tuple[int, int, int, list[str]]]) -> int:
    """Every delivered (epoch, step, rank, ids) is the plan's; returns how many were checked."""
    n = 0
    for epoch, step, rank, ids in delivered:
        assert plan.get((epoch, step, rank)) == list(ids), (epoch, step, rank)
        n += 1
    return n
