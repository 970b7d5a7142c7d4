"""The senders' per-job read cache over a Redis JobState, and the job-sized Redis pool."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from service_helpers import job_dict, service_config

from pipeline.coordinator import RedisJobState
from pipeline.coordinator.connection import unavailable_as_error
from pipeline.coordinator.redis_job_state import pool_size_for
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, Step, StepInfo
from pipeline.redis_client import RedisUnavailable
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.memory_state import MemoryJobState
from pipeline.service.sources import ArraySource


class CountingState:
    """Forwards to a JobState and counts the reads the senders make."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.job_id = inner.job_id

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def counted(*a, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **kw)
        return counted


def _step(n: int, epoch: int = 0) -> Step:
    s = MeasuredSample(sample_id=f"s{n}", num_tokens=10)
    return Step(epoch=epoch, step=n, info=StepInfo(1, 10),
                batches=(Batch(rank=0, samples=(s,), cost=10),))


def _runtime(state, world_size: int | None = None, **kw) -> JobRuntime:
    w = world_size or (state.world_size if isinstance(state, RedisJobState) else 2)
    job = service_config(job_dict(world_size=w)).jobs[0]
    return JobRuntime(job, state, ArraySource([]), **kw)


def test_cache_reads_shared_state_once_per_interval_and_step():
    inner = MemoryJobState("j")
    st = CountingState(inner)
    rt = _runtime(st, shared_cache=True, refresh_seconds=0.2)
    assert rt.cached_published_through() == -1
    inner.publish_step(_step(0))
    assert rt.cached_published_through() == -1  # stale by at most the refresh interval
    time.sleep(0.25)
    assert rt.cached_published_through() == 0
    for _ in range(50):  # many streams, one interval: one read
        rt.cached_published_through()
    assert st.calls["published_through"] == 2
    rt._push_published(1)  # this process's producer published step 1 (after the state did)
    assert rt.cached_published_through() == 1

    got = [rt.cached_step(0) for _ in range(20)]
    assert all(g == inner.get_step(0) for g in got)
    assert st.calls["get_step"] == 1  # fetched once, shared
    assert rt.cached_step(5) is None  # not published: not cached, never invented
    inner.publish_step(_step(1))
    assert rt.cached_step(1) == inner.get_step(1)

    assert rt.cached_epoch_end(0) is None
    inner.publish_epoch_end(EpochEnd(epoch=0, steps=2, final_step=(1, None)))
    time.sleep(0.25)
    end = rt.cached_epoch_end(0)
    assert end is not None and end.epoch == 0
    n = st.calls["epoch_ends"]
    for _ in range(10):
        assert rt.cached_epoch_end(0) == end
    assert st.calls["epoch_ends"] == n  # write-once: kept


def test_cache_bounded_and_concurrent_fetch_is_single():
    inner = MemoryJobState("j")
    st = CountingState(inner)
    rt = _runtime(st, shared_cache=True, step_cache_size=3)
    for n in range(6):
        inner.publish_step(_step(n))
    threads = [threading.Thread(target=rt.cached_step, args=(4,)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert st.calls["get_step"] == 1
    for n in range(6):
        assert rt.cached_step(n).step == n
    assert len(rt._steps) == 3


def test_cache_failed_refresh_is_reraised_within_interval():
    inner = MemoryJobState("j")

    class Failing(CountingState):
        def published_through(self):
            self.calls["published_through"] = self.calls.get("published_through", 0) + 1
            raise RedisUnavailable("down")

    st = Failing(inner)
    rt = _runtime(st, shared_cache=True, refresh_seconds=5.0)
    for _ in range(5):
        with pytest.raises(RedisUnavailable):
            rt.cached_published_through()
    assert st.calls["published_through"] == 1


def test_memory_state_reads_directly():
    rt = _runtime(MemoryJobState("j"))
    assert not rt.shared_cache
    rt.state.publish_step(_step(0))
    assert rt.cached_published_through() == 0


def test_connect_sizes_a_blocking_pool_for_the_job(redis_url, redis_client):
    job = service_config(job_dict(world_size=256)).jobs[0]
    st = RedisJobState.connect(redis_url, job)
    try:
        pool = st.client.connection_pool
        assert isinstance(pool, redis.BlockingConnectionPool)
        assert pool.max_connections == pool_size_for(256) == 528
        assert pool_size_for(2) == 64
    finally:
        st.close()


def test_exhausted_pool_error_names_the_cause(redis_url):
    from pipeline.redis_client import connect

    client = connect(redis_url, max_connections=1, pool_timeout=0.1)
    held = client.connection_pool.get_connection()
    try:
        with (pytest.raises(RedisUnavailable, match="connection pool exhausted"),
              unavailable_as_error("test")):
            client.ping()
    finally:
        client.connection_pool.release(held)
        client.close()


def test_grouped_acks_match_single_acks_and_errors_stay_per_caller(redis_url, redis_client):
    from pipeline.coordinator.errors import AckAheadOfPlan

    st = RedisJobState(redis_url, "acks", config_hash="x", world_size=8)
    try:
        for n in range(3):
            st.publish_step(_step(n))
        rt = _runtime(st, shared_cache=True)
        errors: dict[int, BaseException] = {}

        def ack(rank: int, step: int) -> None:
            try:
                rt.ack(rank, step)
            except BaseException as exc:
                errors[rank] = exc

        threads = [threading.Thread(target=ack, args=(r, 9 if r == 5 else r % 3))
                   for r in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(errors) == {5} and isinstance(errors[5], AckAheadOfPlan)
        assert st.acked_all() == [0, 1, 2, 0, 1, -1, 0, 1]
        assert not rt._ack_flushing and not rt._ack_queue
    finally:
        st.close()
