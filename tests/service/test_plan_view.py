"""A replica's shared reads of a job state (`PlanView`), grouped calls (`Coalescer`), and the
job-sized Redis pool."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import redis
from service_helpers import job_dict, service_config

from pipeline.coordinator import RedisJobState
from pipeline.coordinator.connection import unavailable_as_error
from pipeline.coordinator.redis_job_state import pool_size_for
from pipeline.errors import AckAheadOfPlan, StateUnavailable
from pipeline.jobstate import MemoryJobState, PlannerCheckpoint, Publication, RankAck
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, Step, StepInfo, WorldStamp
from pipeline.service.coalescer import Coalescer
from pipeline.service.plan_view import PlanView


class CountingState:
    """Forwards to a JobState and counts the reads the streams make."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def counted(*a, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **kw)
        return counted


def _step(n: int, epoch: int = 0, ranks: tuple[int, ...] = (0,)) -> Step:
    batches = tuple(Batch(rank=r, samples=(MeasuredSample(f"s{n}:{r}", 10),), cost=10)
                    for r in ranks)
    return Step(epoch=epoch, step=n, info=StepInfo(len(ranks), 10 * len(ranks)),
                batches=batches, world=WorldStamp(0, 8))


def _publish(st, *steps: Step, ends: tuple[EpochEnd, ...] = ()) -> None:
    gen = st.producer_lease().generation if st.producer_lease() else st.claim_producer("p", 60)
    nxt = max((s.step for s in steps), default=st.published_through()) + 1
    cp = PlannerCheckpoint(0, nxt, nxt)
    st.publish(Publication(checkpoint=cp, steps=steps, ends=ends), fence=gen)


def test_reads_shared_state_once_per_interval_and_step():
    inner = MemoryJobState("j", 2)
    view = PlanView(CountingState(inner), refresh_seconds=0.2)
    calls = view.state.calls
    assert view.published_through() == -1
    _publish(inner, _step(0))
    assert view.published_through() == -1  # stale by at most the refresh interval
    time.sleep(0.25)
    assert view.published_through() == 0
    for _ in range(50):  # many streams, one interval: one read
        view.published_through()
    assert calls["head"] == 2  # the plan's head: published_through and the world, together
    assert view.fresh_published_through() == 0 and calls["head"] == 3

    got = [view.step_for(0, 0) for _ in range(20)]
    assert all(g == inner.get_step(0) for g in got)
    assert calls["get_steps_for"] == 1  # fetched once, shared
    assert view.step_for(5, 0) is None  # not published: not cached, never invented
    _publish(inner, _step(1))
    assert view.step_for(1, 0) == inner.get_step(1)

    assert view.epoch_end(0) is None
    _publish(inner, ends=(EpochEnd(epoch=0, steps=2, final_step=(1, None),
                                   world=WorldStamp(0, 2)),))
    time.sleep(0.25)
    end = view.epoch_end(0)
    assert end is not None and end.epoch == 0
    n = calls["epoch_ends"]
    for _ in range(10):
        assert view.epoch_end(0) == end
    assert calls["epoch_ends"] == n  # write-once: kept


def test_a_rank_reads_only_its_own_batch_and_concurrent_reads_go_together():
    inner = MemoryJobState("j", 4)
    _publish(inner, *(_step(n, ranks=(0, 1, 2, 3)) for n in range(6)))

    class Remote(CountingState):  # a read costs a round trip, as with Redis
        def get_steps_for(self, wanted):
            self.calls["get_steps_for"] = self.calls.get("get_steps_for", 0) + 1
            time.sleep(0.1)
            return self.inner.get_steps_for(wanted)

    view = PlanView(Remote(inner), cache_size=8)
    calls = view.state.calls
    barrier = threading.Barrier(16, timeout=30)
    got: dict[int, object] = {}  # reader -> what it read (checked here, in the test's thread)

    def read(i: int) -> None:
        barrier.wait()
        got[i] = view.step_for(4, i % 4)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and sorted(got) == list(range(16))
    for i, step in got.items():
        assert [b.rank for b in step.batches] == [i % 4]
        assert step.info == inner.get_step(4).info  # all-rank totals kept
    assert calls["get_steps_for"] == 2  # the leader's, then one for all who waited meanwhile
    for n in range(6):
        assert view.step_for(n, 1).step == n
    assert len(view._steps) <= 8  # bounded


def test_failed_refresh_is_reraised_within_interval():
    inner = MemoryJobState("j", 2)

    class Failing(CountingState):
        def head(self):
            self.calls["head"] = self.calls.get("head", 0) + 1
            raise StateUnavailable("down")

    st = Failing(inner)
    view = PlanView(st, refresh_seconds=5.0)
    for _ in range(5):
        with pytest.raises(StateUnavailable):
            view.published_through()
    assert st.calls["head"] == 1


def gated_call_many(seen: list[list[int]], gate: threading.Event):
    """A grouped call for coalescer tests: records each group, holds until `gate` is set, and
    answers key k with k * 10 (key 5 with its own ValueError)."""

    def call_many(keys):
        seen.append(list(keys))
        gate.wait(2)
        return [ValueError(k) if k == 5 else k * 10 for k in keys]

    return call_many


def test_coalescer_groups_calls_and_keeps_errors_per_caller():
    seen: list[list[int]] = []
    gate = threading.Event()
    c = Coalescer(gated_call_many(seen, gate))
    out: dict[int, object] = {}

    def call(k: int) -> None:
        try:
            out[k] = c(k)
        except ValueError as exc:
            out[k] = exc

    threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    threads[0].start()
    time.sleep(0.1)  # the leader's round trip is in flight: the others queue behind it
    for t in threads[1:]:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join()
    assert seen[0] == [0] and sorted(k for batch in seen[1:] for k in batch) == list(range(1, 8))
    assert len(seen) == 2  # the seven waiting callers went together
    assert isinstance(out[5], ValueError) and out[3] == 30 and c.idle


def test_grouped_acks_match_single_acks_and_errors_stay_per_caller(redis_url, redis_client):
    st = RedisJobState(redis_url, "acks", config_hash="x", world_size=8)
    try:
        _publish(st, *(_step(n) for n in range(3)))
        st.grant([(0, r, 2) for r in range(8)])
        acks = Coalescer(functools.partial(st.ack_many, lease_seconds=60))
        errors: dict[int, BaseException] = {}

        def ack(rank: int, step: int) -> None:
            try:
                acks(RankAck(rank, f"c{rank}", step))
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
        assert acks.idle
    finally:
        st.close()


def test_connect_sizes_a_blocking_pool_for_the_job(redis_url, redis_client):
    # Sized for the largest world the job may be reconfigured to (docs/elastic.md).
    job = service_config(job_dict(world_size=64, max_world_size=256)).jobs[0]
    assert job.world_size_cap() == 256
    assert service_config(job_dict(world_size=64)).jobs[0].world_size_cap() == 1024
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
        with (pytest.raises(StateUnavailable, match="connection pool exhausted"),
              unavailable_as_error("test")):
            client.ping()
    finally:
        client.connection_pool.release(held)
        client.close()


def test_a_rank_reading_in_order_reads_its_next_published_steps_ahead():
    inner = MemoryJobState("j", 2)
    _publish(inner, *(_step(n, ranks=(0, 1)) for n in range(8)))
    view = PlanView(CountingState(inner), refresh_seconds=60.0, read_ahead=4)
    calls = view.state.calls
    assert view.published_through() == 7
    got = [view.step_for(n, 1) for n in range(8)]
    assert [[b.rank for b in g.batches] for g in got] == [[1]] * 8
    assert [g.step for g in got] == list(range(8))
    assert calls["get_steps_for"] == 2  # steps 0-4, then 5-7: never past the published head
    assert view.step_for(8, 1) is None  # not published: not cached
    _publish(inner, _step(8, ranks=(0, 1)))
    assert view.step_for(8, 1).step == 8
    assert view.step_for(0, 0).batches[0].rank == 0  # rank 0 read nothing ahead for rank 1
