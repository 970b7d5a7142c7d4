"""The seam: the same server over the coordinator's RedisJobState (make_job_state picks it)."""

from __future__ import annotations

from service_helpers import consume_all, job_dict, service_config, serving

from pipeline.config import ServiceConfig
from pipeline.jobstate import MemoryJobState
from pipeline.preprocess.array_source import synthetic_samples
from pipeline.service.state_factory import make_job_state
from trainer_client import EpochEndInfo


def test_make_job_state_picks_memory_without_redis_url():
    cfg = service_config(job_dict())
    assert isinstance(make_job_state(cfg, cfg.jobs[0])[0], MemoryJobState)


def test_data_plane_over_redis_job_state_matches_memory(redis_url, redis_client):
    samples = synthetic_samples(120, max_len=500, seed=6)
    base = service_config(job_dict(epochs=2))
    cfg = ServiceConfig.model_validate({**base.model_dump(), "redis_url": redis_url})
    state, _ = make_job_state(cfg, cfg.jobs[0])
    assert type(state).__name__ == "RedisJobState"
    with serving(base, {"j": samples}) as svc:
        ref = consume_all(svc.address, "j", 2, epochs=2)
    with serving(cfg, {"j": samples}, job_states={"j": state}) as svc:
        got = consume_all(svc.address, "j", 2, epochs=2)
        assert state.is_done() and len(state.epoch_ends()) == 2

    def digests(items):
        return [b.digest() if not isinstance(b, EpochEndInfo) else (b.epoch, b.final_step)
                for b in items]

    for r in range(2):
        assert digests(got[r]) == digests(ref[r])
