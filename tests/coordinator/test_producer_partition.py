"""A producer cut off from Redis (its link partitioned: calls hang, nothing is closed) while its
lease runs out, with a publication sent into the cut: it is fenced, a successor (another
replica's producer, waiting for the lease) takes over from the checkpoint and finishes the job,
and when the link heals the late publication and everything after it is refused. No step is
published twice or differently: the plan, the checkpoint and the counters are exactly what one
producer alone makes. The cut producer never starts a publication it cannot vouch for: past its
local lease deadline it renews first, and that renewal cannot get through."""

from __future__ import annotations

import contextlib
import threading
import time
from urllib.parse import urlparse

import redis
from support.waiting import wait_for

from pipeline.config import TrainingJobConfig
from pipeline.coordinator import RedisJobState, scripts
from pipeline.jobstate import MemoryJobState
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings

from .partition_proxy import PartitionProxy

LEASE_S = 1.5
SETTINGS = ProducerSettings(lease_seconds=LEASE_S, max_ahead=10**6, linger_seconds=0.0,
                            poll_seconds=0.01, retry_first_seconds=0.05, retry_cap_seconds=0.2)


def _job() -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({
        "job_id": "cut", "world_size": 2, "seed": 3, "epochs": 2,
        "source": {"paths": ["arrays"]},
        "batching": {"token_budget": 1024, "max_window_samples": 16, "pool_steps": 1}})


class CutAt(ArraySource):
    """Cuts the proxy when epoch 1's row `at` is read (the producer plans on: its next
    publication goes into the cut)."""

    def __init__(self, items, proxy: PartitionProxy, at: int) -> None:
        super().__init__(items)
        self.proxy, self.at = proxy, at
        self.cut_at: float | None = None

    def iter_epoch(self, epoch: int, start_row: int = 0):
        for i, item in enumerate(super().iter_epoch(epoch, start_row), start_row):
            if epoch == 1 and i == self.at and self.cut_at is None:
                self.cut_at = time.monotonic()
                self.proxy.cut()
            yield item


def _recording(state: RedisJobState) -> list:
    """Wrap `state.publish`: every call's (start, end, exception or None)."""
    calls: list = []
    publish = state.publish

    def wrapped(pub, *, fence):
        start = time.monotonic()
        try:
            out = publish(pub, fence=fence)
        except Exception as exc:
            calls.append((start, time.monotonic(), exc))
            raise
        calls.append((start, time.monotonic(), None))
        return out

    state.publish = wrapped
    return calls


class Monitor:
    """Redis MONITOR in a thread: the commands Redis runs from now on (split on spaces)."""

    def __init__(self, url: str) -> None:
        self.commands: list[list[str]] = []
        self._ready = threading.Event()
        self._client = redis.Redis.from_url(url)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        with self._client.monitor() as m:
            self._m = m
            self._ready.set()
            with contextlib.suppress(Exception):  # ends when stop() drops the connection
                for c in m.listen():
                    if c["client_type"] == "tcp":
                        self.commands.append(c["command"].split(" "))

    def stop(self) -> list[list[str]]:
        time.sleep(0.2)  # the last commands reach the monitor
        self._m.connection.disconnect()
        self._thread.join(5)
        self._client.close()
        return self.commands


def test_a_producer_cut_from_redis_is_fenced_and_a_successor_finishes(redis_client, redis_url):
    items = synthetic_samples(150, max_len=400, seed=8)
    job = _job()
    u = urlparse(redis_url)
    proxy = PartitionProxy((u.hostname, u.port))
    try:
        cut_state = RedisJobState.connect(proxy.url(int(u.path.strip("/") or 0)), job,
                                          retries=1, socket_timeout=0.5)
        calls = _recording(cut_state)
        source = CutAt(items, proxy, at=40)
        a = Producer(job, cut_state, ArrayFeed(source, "padded"), holder="replica-a",
                     settings=SETTINGS)
        out_a: list = []
        ta = threading.Thread(target=lambda: out_a.append(a.run()), daemon=True)
        ta.start()
        st = RedisJobState.connect(redis_url, job)
        wait_for(lambda: (lease := st.producer_lease()) is not None
                 and lease.holder == "replica-a", 10, "producer a to hold the lease")
        b = Producer(job, st, ArrayFeed(ArraySource(items), "padded"), holder="replica-b",
                     settings=SETTINGS)
        out_b: list = []
        tb = threading.Thread(target=lambda: out_b.append(b.run()), daemon=True)
        tb.start()
        wait_for(lambda: source.cut_at is not None, 30, "the cut")
        wait_for(lambda: bool(out_b), 60, "producer b to take over and finish")
        assert out_b == [Outcome.DONE] and b.generation > a.generation and st.is_done()
        assert not out_a, "a learnt nothing through the cut"
        monitor = Monitor(redis_url)
        proxy.heal()  # what a sent into the cut arrives now, long after its lease expired
        ta.join(30)
        assert out_a == [Outcome.FENCED]
        sent_into_cut = [c for c in calls if c[0] >= source.cut_at]
        assert sent_into_cut, "a publication went into the cut"
        assert all(exc is not None for _, _, exc in sent_into_cut)  # none landed
        # Past its lease (renewed last before the cut) a started no publication at all.
        assert not [c for c in calls if c[0] > source.cut_at + LEASE_S]
        # Redis ran a's late publications (its client had given up on them): refused, since
        # the plan below is exactly one producer's.
        late = [c for c in monitor.stop() if c[:2] == ["EVALSHA", scripts.publish.sha]]
        assert late and all(c[13] == str(a.generation) for c in late)
        # The plan is exactly one producer's: nothing published twice or differently.
        ref = MemoryJobState("ref", 2)
        Producer(job, ref, ArrayFeed(ArraySource(items), "padded"), holder="ref",
                 settings=SETTINGS).run()
        assert st.published_through() == ref.published_through()
        assert [st.get_step(n) for n in range(st.published_through() + 1)] == [
            ref.get_step(n) for n in range(ref.published_through() + 1)]
        assert st.epoch_ends() == ref.epoch_ends()
        assert st.counters().samples_in == ref.counters().samples_in == 2 * len(items)
        assert st.counters().samples_planned == ref.counters().samples_planned
        assert st.error() is None
    finally:
        proxy.close()
