"""Guarantee 5 across a *Redis* crash: the coordinator's redis-server (AOF on, fsync every
second) is SIGKILLed twice mid-epoch and restarted on the same port and directory while three
ranks consume, once briefly and once for longer than the Redis client's retries. The server
rides it out (client retries; broken streams reconnect; a producer that lost Redis, or finds the
plan rolled back to the AOF's last fsync, replays from the checkpoint stored with the plan) and
every sample of every epoch is delivered exactly once, byte-identical where a step is delivered
again."""

from __future__ import annotations

import time

import pytest
from fault_helpers import RankThread, assert_join_coverage, job_dict
from support.waiting import wait_for

from pipeline.config import ServiceConfig
from pipeline.coordinator import RedisJobState
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.redis_server import LocalRedis, free_port
from pipeline.service.server import start_service

pytestmark = pytest.mark.slow
W, N, EPOCHS = 3, 700, 2


def test_redis_restarted_from_aof_mid_epoch_keeps_coverage_exact(tmp_path):
    (tmp_path / "redis").mkdir()
    redis = LocalRedis(port=free_port(), data_dir=tmp_path / "redis", appendonly=True).start()
    svc = None
    try:
        cfg = ServiceConfig.model_validate({
            "redis_url": redis.url, "lease_seconds": 5.0, "metrics_port": None,
            "grpc": {"port": 0}, "jobs": [job_dict("aof", W, epochs=EPOCHS, seed=9)]})
        samples = synthetic_samples(N, max_len=600, seed=9)
        svc = start_service(cfg, sample_sources={"aof": ArraySource(samples)})
        ranks = [RankThread(svc.address, "aof", r, W, epochs=EPOCHS, sleep=0.03).start()
                 for r in range(W)]
        # 0.5 s down: within the client's retries; 3 s down: past them, so streams break
        # (the ranks reconnect) and the producer resumes from its checkpoint.
        for at, down in ((4, 0.5), (12, 3.0)):
            wait_for(lambda at=at: min(len(r.records) for r in ranks) >= at, 60,
                     f"{at} steps on every rank")
            assert not any(r.finished.is_set() for r in ranks), "ended before the crash"
            redis.kill()  # SIGKILL: whatever was not fsynced yet is gone
            time.sleep(down)
            redis.start()
        for r in ranks:
            r.join(90)
            r.check()
        st = RedisJobState.attach(redis.url, "aof")
        assert st.is_done() and len(st.epoch_ends()) == EPOCHS
        assert st.error() is None
    finally:
        if svc is not None:
            svc.stop(grace=0.5)
        redis.cleanup()
    assert_join_coverage([r.records for r in ranks], [s.sample_id for s in samples], EPOCHS)
