"""A real producer (thread host, real feeds, RedisJobState) under failures: transient ones are
retried with backoff from the checkpoint and the job ends with the same plan and no error; a
permanent one fails the job once, with a message naming the cause and what to do, and no host
runs the producer again until a replica starts (the operator's act), which retries it once;
streams wait through trouble and end with a status naming a permanent cause."""

from __future__ import annotations

import errno
import shutil
import time
from pathlib import Path

import grpc
import pytest
from support.waiting import wait_for

from pipeline.config import ServiceConfig, TrainingJobConfig
from pipeline.coordinator import RedisJobState
from pipeline.jobstate import MemoryJobState
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.hosting import ActorHost, ThreadHost, needs_producer, retry_failed_job
from pipeline.producer.local_feed import LocalFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings
from pipeline.service.server import start_service
from trainer_client import BatchStream, StreamError

REPO = Path(__file__).resolve().parents[2]
FAST = ProducerSettings(lease_seconds=5.0, max_ahead=10**6, linger_seconds=0.0,
                        poll_seconds=0.01, retry_first_seconds=0.02, retry_cap_seconds=0.1)


def array_job(job_id: str, world_size: int = 2) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({
        "job_id": job_id, "world_size": world_size, "seed": 1, "epochs": 2,
        "source": {"paths": ["arrays"]},
        "batching": {"token_budget": 1024, "max_window_samples": 32, "pool_steps": 1}})


class FlakySource(ArraySource):
    """Raises `error` at row `at` of epoch 1 the first `times` times it is read there; records
    the job's failure record at each read (what a retry sees)."""

    def __init__(self, items, error: BaseException, times: int, at: int = 30,
                 state=None) -> None:
        super().__init__(items)
        self.error, self.left, self.at, self.state = error, times, at, state
        self.seen: list = []

    def iter_epoch(self, epoch: int, start_row: int = 0):
        if self.state is not None:
            self.seen.append(self.state.producer_failure())
        for i, item in enumerate(super().iter_epoch(epoch, start_row), start_row):
            if epoch == 1 and i == self.at and self.left > 0:
                self.left -= 1
                raise self.error
            yield item


def plan_of(state) -> list:
    return [state.get_step(n) for n in range(state.published_through() + 1)]


def reference_plan(items) -> list:
    st = MemoryJobState("ref", 2)
    Producer(array_job("ref"), st, ArrayFeed(ArraySource(items), "padded"), holder="ref",
             settings=FAST).run()
    return plan_of(st)


def test_transient_failures_are_retried_and_cleared_with_the_same_plan(redis_client, redis_url):
    items = synthetic_samples(120, max_len=400, seed=4)
    job = array_job("flaky")
    st = RedisJobState.connect(redis_url, job)
    src = FlakySource(items, OSError(errno.EIO, "Input/output error"), times=3, state=st)
    p = Producer(job, st, ArrayFeed(src, "padded"), holder="p", settings=FAST)
    assert p.run() is Outcome.DONE
    # Each retry saw the trouble of the failures before it (one streak: attempts count up).
    trouble = [f for f in src.seen if f is not None]
    assert [(f.cause, f.permanent, f.attempts) for f in trouble] == [
        ("source_unreadable", False, n) for n in (1, 2, 3)]
    assert "OSError" in trouble[0].message
    assert st.producer_failure() is None and st.error() is None and st.is_done()
    assert st.producer_lease().generation == 1  # the same producer retried: none re-created
    assert plan_of(st) == reference_plan(items)


def test_a_streak_longer_than_the_bound_fails_the_job(redis_client, redis_url):
    job = array_job("gives-up")
    st = RedisJobState.connect(redis_url, job)
    src = FlakySource(synthetic_samples(80, seed=5), TimeoutError("read timed out"),
                      times=10**6)
    settings = ProducerSettings(**{**FAST.__dict__, "give_up_seconds": 0.3})
    t0 = time.monotonic()
    assert Producer(job, st, ArrayFeed(src, "padded"), holder="p",
                    settings=settings).run() is Outcome.FAILED
    assert time.monotonic() - t0 < 10.0
    f = st.producer_failure()
    assert f.permanent and f.cause == "source_unreadable"
    assert "TimeoutError: read timed out" in f.message and "retry bound" in f.message


def _chat_job(job_id: str, source: Path) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({
        "job_id": job_id, "world_size": 2, "epochs": 1, "source": {"paths": [str(source)]},
        "batching": {"token_budget": 2048, "pool_steps": 1}})


def test_a_missing_source_fails_once_and_a_replica_start_retries_it(redis_client, redis_url,
                                                                     tmp_path):
    """No restart loop: the failed job's producer is not run again by its host (the lease
    generation stays), nor by another replica's host that was waiting for the lease; the
    operator restores the file and starts a replica: one more try, and the job is planned."""
    source = tmp_path / "chat.jsonl"
    job = _chat_job("missing", source)
    st = RedisJobState.connect(redis_url, job)
    settings = FAST
    hosts = [ThreadHost(job, st, LocalFeed(job), holder=f"replica:{i}", settings=settings,
                        check_seconds=0.05) for i in range(2)]
    # Both replicas start before either producer runs (a replica that starts after the failure
    # was recorded would give the job its one more try: that is the end of this test).
    for _ in hosts:
        retry_failed_job(st)  # each replica's start: nothing has failed yet
    for h in hosts:
        h.supervise()
    wait_for(lambda: st.error() is not None, 30, "the producer's failure")
    f = st.producer_failure()
    assert f.cause == "source_missing" and f.permanent
    assert str(source) in f.message and "Restore the missing source" in f.message
    assert "restart the serve replicas" in f.message
    # The other replica's producer, waiting for the lease, sees the failure and ends too.
    wait_for(lambda: all(h.producer.outcome is Outcome.FAILED for h in hosts), 10,
             "both replicas' producers to end")
    time.sleep(0.5)  # ten check periods of both hosts: neither runs a producer again
    assert st.producer_lease().generation == 1
    for h in hosts:
        h.stop()
    shutil.copy(REPO / "deploy" / "example-data" / "chat.jsonl", source)
    again = ThreadHost(job, st, LocalFeed(job), holder="replica:2", settings=settings,
                       check_seconds=0.05)
    again.start()  # a replica starts: the failure is cleared and the producer tries again
    try:
        wait_for(st.is_done, 60, "the job to be planned after the fix")
        assert st.error() is None and st.producer_lease().generation == 2
        assert st.counters().samples_in == 96
    finally:
        again.stop()


class BrokenSource(ArraySource):
    """Raises `error` from `left` reads of epoch 0 (then reads normally)."""

    def __init__(self, items, error: BaseException, left: int) -> None:
        super().__init__(items)
        self.error, self.left = error, left

    def iter_epoch(self, epoch: int, start_row: int = 0):
        if self.left > 0:
            self.left -= 1
            raise self.error
        return super().iter_epoch(epoch, start_row)


def _serve(job_id: str, source: ArraySource, **kw):
    cfg = ServiceConfig.model_validate({
        "metrics_port": None, "grpc": {"port": 0}, "lease_seconds": 5.0,
        "jobs": [{"job_id": job_id, "world_size": 1, "source": {"paths": ["arrays"]},
                  "batching": {"token_budget": 1024, "pool_steps": 1}}], **kw})
    return start_service(cfg, sample_sources={job_id: source})


def test_streams_wait_through_trouble_and_end_on_a_permanent_failure_naming_it(monkeypatch):
    monkeypatch.setattr("pipeline.service.server.producer_settings",
                        lambda config: FAST)
    items = synthetic_samples(60, max_len=300, seed=6)
    svc = _serve("trouble", BrokenSource(items, ConnectionResetError("peer reset"), left=4))
    try:
        with BatchStream(svc.address, "trouble", 0, 1, reconnect_timeout=2.0) as stream:
            got = [i for b in stream for i in b.info.sample_ids]
        assert sorted(got) == sorted(s.sample_id for s in items)
    finally:
        svc.stop(grace=0.5)
    svc = _serve("denied", BrokenSource(items, PermissionError(13, "Permission denied",
                                                                "data.jsonl"), left=1))
    try:
        # A job failed for good ends the stream at once (#42), not after reconnect_timeout.
        with pytest.raises(StreamError) as err, \
                BatchStream(svc.address, "denied", 0, 1, reconnect_timeout=60.0) as stream:
            list(stream)
        assert stream.reconnects == 0
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "source_forbidden" in err.value.details
        assert "Let the producer read the source" in err.value.details
    finally:
        svc.stop(grace=0.5)


def test_no_actor_host_recreates_the_producer_of_a_failed_job(redis_client, redis_url):
    """The actor host's check (every 2 s on every replica) creates nothing for a job that failed
    for good: before, it re-created the producer actor, which redid the preprocessing, forever."""
    job = array_job("failed")
    st = RedisJobState.connect(redis_url, job)
    gen = st.claim_producer("actor:1", 5.0)
    st.set_error("job 'failed': ... (config)", fence=gen, cause="config")
    st.release_producer(gen)
    assert not needs_producer(st)
    assert ActorHost(job, st, redis_url, settings=FAST).ensure() is False  # Ray not touched
    retry_failed_job(st)  # a replica starts
    assert st.error() is None and needs_producer(st)
