"""Job registry, operator reads, counters, schema version."""

from __future__ import annotations

import pytest
from pipeline.coordinator.errors import UnknownJob

from pipeline.coordinator import (
    JobMismatch,
    RedisJobState,
    SchemaMismatch,
    job_summary,
    keys,
    list_jobs,
    registry,
)
from pipeline.errors import UserError
from pipeline.planner.types import EpochEnd

from .helpers import make_step


def test_resume_matching_job_and_refuse_mismatches(new_state, redis_url):
    st = new_state(job_id="j", world_size=4, mode="join", seed=3)
    assert st.created
    again = RedisJobState(redis_url, "j", config_hash="cfg-1", world_size=4, history_steps=9)
    assert not again.created
    assert registry.read_job(again.client, "j").history_steps == 9  # operator knob may change
    with pytest.raises(JobMismatch, match=r"config_hash=cfg-1.*config_hash=cfg-2.*stale"):
        RedisJobState(redis_url, "j", config_hash="cfg-2", world_size=4)
    with pytest.raises(JobMismatch, match=r"world_size=4.*world_size=8"):
        RedisJobState(redis_url, "j", config_hash="cfg-1", world_size=8)
    with pytest.raises(JobMismatch, match="mode"):
        RedisJobState(redis_url, "j", config_hash="cfg-1", world_size=4, mode="quota")
    assert issubclass(JobMismatch, UserError)  # the CLI prints it as one line
    again.close()


def test_schema_version_mismatch_refused(new_state, redis_client, redis_url):
    new_state(job_id="a")
    assert redis_client.get(keys.SCHEMA_VERSION_KEY) == b"1"
    redis_client.set(keys.SCHEMA_VERSION_KEY, "2")
    with pytest.raises(SchemaMismatch, match=r"v2.*v1"):
        RedisJobState(redis_url, "b", config_hash="c", world_size=1)


def test_list_jobs_summary_counters_delete_expire(new_state, redis_client):
    st = new_state(job_id="alpha", world_size=2, history_steps=1)
    new_state(job_id="beta", world_size=1)
    assert list_jobs(redis_client) == ["alpha", "beta"]
    st.publish_steps([make_step(n, world_size=2) for n in range(4)])
    st.ack_heartbeat(0, "c0", 3, 30)
    st.ack_heartbeat(1, "c1", 2, 30)
    st.add_counters(samples=10, tokens=300, quarantined={"parse": 2})
    st.add_counters(samples=1, quarantined={"parse": 1, "decode": 1})
    s = job_summary(redis_client, "alpha")
    assert (s.job.state, s.job.published_through, s.job.trimmed_through) == ("planning", 3, 1)
    assert s.retained_steps == 2 and s.min_acked == 2 and s.lapsed_ranks == []
    assert [r.acked for r in s.ranks] == [3, 2] and s.ranks[0].heartbeat_age < 5
    assert s.counters == {"samples_emitted": 11, "tokens_emitted": 300, "quarantined:parse": 3,
                          "quarantined:decode": 1}
    assert job_summary(redis_client, "nope") is None
    with pytest.raises(UnknownJob):
        RedisJobState.attach(redis_client, "nope")
    view = RedisJobState.attach(redis_client, "alpha")
    assert view.get_step(3) == make_step(3, world_size=2)
    st.mark_done()
    registry.expire_job(redis_client, "alpha", 100)
    assert 0 < redis_client.ttl(st.keys.meta) <= 100
    assert 0 < redis_client.ttl(st.keys.step(3)) <= 100
    registry.delete_job(redis_client, "beta")
    assert list_jobs(redis_client) == ["alpha"]
    assert not [k for k in redis_client.scan_iter(match=keys.PREFIX + ":{beta}*")]


def test_every_key_is_under_the_versioned_job_prefix(new_state, redis_client):
    st = new_state(job_id="p", world_size=2)
    st.publish_steps([make_step(0, world_size=2)])
    st.claim_rank(0, "c", 30)
    st.ack(0, 0)
    st.add_counters(samples=1)
    st.publish_epoch_end(EpochEnd(0, (0, 0), 1))
    found = {k.decode() for k in redis_client.keys("*")}
    assert found <= {keys.SCHEMA_VERSION_KEY, keys.JOBS_KEY} | set(st.keys.fixed()) | {
        st.keys.step(0)}
    assert all(k.startswith("odb:") for k in found)


def test_connect_from_job_config(redis_client, redis_url):
    from pipeline.config import JobConfig

    job = JobConfig(job_id="cfgjob", world_size=2, mode="quota", seed=5,
                    source={"paths": ["data/a.jsonl"]})
    st = RedisJobState.connect(redis_url, job)
    rec = registry.read_job(st.client, "cfgjob")
    assert (rec.world_size, rec.mode, rec.seed) == (2, "quota", 5)
    assert rec.config_hash == registry.config_hash(job)
    # Resume with the same config (the token's env var name may differ): accepted.
    RedisJobState.connect(redis_url, job.model_copy(update={"token_env": "OTHER"}))
    # A changed plan-relevant setting: refused.
    changed = job.model_copy(update={"seed": 6})
    with pytest.raises(JobMismatch, match="config_hash"):
        RedisJobState.connect(redis_url, changed)
    with pytest.raises(JobMismatch, match="world_size"):
        RedisJobState.connect(redis_url, JobConfig(**{**job.model_dump(), "world_size": 4}))
