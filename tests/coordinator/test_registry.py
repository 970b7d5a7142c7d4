"""Job registry, operator reads, delete/expire, schema version, every key under the prefix."""

from __future__ import annotations

import time

import pytest
from jobstate.builders import make_end, make_step, publication, steps

from pipeline.coordinator import RedisJobState, job_summary, keys, list_jobs, registry
from pipeline.errors import JobMismatch, SchemaMismatch, UnknownJob, UserError
from pipeline.jobstate import QuarantineEntry, ScaleRequest
from pipeline.modes import JobMode


def test_resume_matching_job_and_refuse_mismatches(new_state, redis_url):
    st = new_state(job_id="j", world_size=4, mode="join", seed=3)
    assert st.created
    again = RedisJobState(redis_url, "j", config_hash="cfg-1", world_size=4, seed=3)
    assert not again.created
    with pytest.raises(JobMismatch, match=r"job 'j' exists in Redis with another config "
                                          r"\(which fields differ is unknown"):
        RedisJobState(redis_url, "j", config_hash="cfg-2", world_size=4)
    with pytest.raises(JobMismatch, match=r"world_size=4.*world_size=8"):
        RedisJobState(redis_url, "j", config_hash="cfg-1", world_size=8)
    with pytest.raises(JobMismatch, match="mode"):
        RedisJobState(redis_url, "j", config_hash="cfg-1", world_size=4, mode="quota")
    assert issubclass(JobMismatch, UserError)  # the CLI prints it as one line
    again.close()


def test_a_changed_config_is_refused_naming_the_fields_that_differ(redis_url):
    """#42: the refusal named two hashes; it names each field that changed, both values."""
    from pipeline.config import parse_job

    base = {"job_id": "sft", "world_size": 2, "source": {"paths": ["a.jsonl"]},
            "batching": {"token_budget": 1024}}
    RedisJobState.connect(redis_url, parse_job(base)).close()
    changed = parse_job({**base, "batching": {"token_budget": 2048}, "seed": 7,
                         "token_env": "T"})  # (who may call a job is no part of its plan)
    with pytest.raises(JobMismatch) as err:
        RedisJobState.connect(redis_url, changed)
    assert str(err.value) == (
        "job 'sft' exists in Redis with another config: batching.token_budget (1024 in Redis, "
        "2048 here), seed (0 in Redis, 7 here): refused (its plan was made for the config in "
        "Redis)")
    assert err.value.job_id == "sft"


def test_schema_version_mismatch_refused(new_state, redis_client, redis_url):
    new_state(job_id="a")
    assert redis_client.get(keys.SCHEMA_VERSION_KEY) == b"1"
    redis_client.set(keys.SCHEMA_VERSION_KEY, "2")
    with pytest.raises(SchemaMismatch, match=r"v2.*v1"):
        RedisJobState(redis_url, "b", config_hash="c", world_size=1)


def test_list_jobs_summary_delete_and_expire(new_state, redis_client):
    st = new_state(job_id="alpha", world_size=2)
    new_state(job_id="beta", world_size=1)
    assert list_jobs(redis_client) == ["alpha", "beta"]
    gen = st.claim_producer("producer-1", 60)
    st.publish(publication(steps(0, 3, 2), rows=12, samples_in=11,
                           quarantined=(QuarantineEntry("rows:3", "parse", "bad json"),),
                           ends=(make_end(0, (3, 3), 4),)), fence=gen)
    st.publish(publication(steps(4, 5, 2, epoch=1), epoch=1, rows=4, samples_in=4), fence=gen)
    st.claim_rank(0, "c0", 30)
    st.ack(0, 5)
    st.ack(1, 4)  # both ranks in epoch 1: epoch 0 is the one before, kept
    s = job_summary(redis_client, "alpha")
    assert (s.job.state, s.job.published_through, s.job.trimmed_through) == ("planning", 5, -1)
    assert (s.job.epoch, s.job.checkpoint_next_step, s.job.world_size) == (1, 6, 2)
    assert s.retained_steps == 6 and s.min_acked == 4 and s.lapsed_ranks == []
    assert [r.acked for r in s.ranks] == [5, 4] and s.ranks[0].client_id == "c0"
    assert (s.counters.samples_in, s.counters.quarantined) == (15, 1)
    assert s.counters.samples_planned == sum(x.info.step_samples for x in steps(0, 5, 2))
    assert (s.producer.generation, s.producer.holder) == (gen, "producer-1")
    assert s.error is None and s.epoch_ends == 1
    assert job_summary(redis_client, "nope") is None
    with pytest.raises(UnknownJob):
        RedisJobState.attach(redis_client, "nope")
    view = RedisJobState.attach(redis_client, "alpha")
    assert (view.world_size, view.mode) == (2, "join") and not view.created
    assert view.get_step(3) == make_step(3, 2)
    st.publish(publication(epoch=2, rows=0, next_step=6, done=True), fence=gen)
    assert job_summary(redis_client, "alpha").job.state == "done"
    registry.expire_job(redis_client, "alpha", 100)
    assert 0 < redis_client.ttl(st.keys.meta) <= 100
    assert 0 < redis_client.ttl(st.keys.step(3)) <= 100
    assert 0 < redis_client.ttl(st.keys.quarantine_ids) <= 100
    registry.delete_job(redis_client, "beta")
    assert list_jobs(redis_client) == ["alpha"]
    assert not list(redis_client.scan_iter(match=keys.PREFIX + ":{beta}*"))
    with pytest.raises(UnknownJob):
        RedisJobState.attach(redis_client, "beta").published_through()


def test_delete_removes_every_key_of_a_job(new_state, redis_client):
    st = new_state(job_id="gone", world_size=2)
    other = new_state(job_id="kept", world_size=2)
    gen = st.claim_producer("p", 60)
    st.publish(publication(steps(0, 2, 2), quarantined=(QuarantineEntry("x", "parse"),)),
               fence=gen)
    st.claim_rank(1, "c", 30)
    st.ack(1, 2)
    registry.delete_job(redis_client, "gone")
    left = {k.decode() for k in redis_client.keys("*")}
    assert not [k for k in left if "{gone}" in k]
    assert other.keys.meta in left
    assert list_jobs(redis_client) == ["kept"]


def test_every_key_is_under_the_versioned_job_prefix(new_state, redis_client):
    st = new_state(job_id="p", world_size=2)
    gen = st.claim_producer("p", 60)
    st.publish(publication([make_step(0, 2)], samples_in=2,
                           quarantined=(QuarantineEntry("s:1", "parse"),),
                           ends=(make_end(0, (0, 0), 1),)), fence=gen)
    st.claim_rank(0, "c", 0.01)
    st.ack(0, 0)
    st.set_error("boom", fence=gen)
    time.sleep(0.02)
    st.claim_rank(0, "d", 30)  # a lapse: the lapsed set and the counter
    st.scale(ScaleRequest(1))  # worlds, draining (rank 0 is live), world_times
    st.publish(publication([make_step(1, 1)], world=1), fence=gen)
    st.grant([(1, 0, 1)])  # grants
    found = {k.decode() for k in redis_client.keys("*")}
    # Every key in Redis is a declared one (SCALE dropped the lapse and claim history: they are
    # the ended world's).
    assert found <= {keys.SCHEMA_VERSION_KEY, keys.JOBS_KEY, st.keys.step(0),
                     st.keys.step(1)} | set(st.keys.fixed())
    assert {st.keys.worlds, st.keys.grants, st.keys.draining, st.keys.meta} <= found
    assert all(k.startswith("odb:") for k in found)


def test_connect_from_job_config(redis_client, redis_url):
    from pipeline.config import TrainingJobConfig

    job = TrainingJobConfig(job_id="cfgjob", world_size=2, mode="quota", seed=5,
                            source={"paths": ["data/a.jsonl"]})
    st = RedisJobState.connect(redis_url, job)
    rec = registry.read_job(st.client, "cfgjob")
    assert (rec.world_size, rec.mode, rec.seed) == (2, "quota", 5)
    assert rec.config_hash == registry.config_hash(job)
    # Resume with the same config (the token's env var name may differ): accepted.
    RedisJobState.connect(redis_url, job.model_copy(update={"token_env": "OTHER"}))
    # A changed plan-relevant setting: refused.
    with pytest.raises(JobMismatch, match=r"seed \(5 in Redis, 6 here\)"):
        RedisJobState.connect(redis_url, job.model_copy(update={"seed": 6}))
    with pytest.raises(JobMismatch, match="world_size"):
        RedisJobState.connect(redis_url, job.model_copy(update={"world_size": 4}))


@pytest.mark.parametrize(("job", "registered_hash"), [
    ({"job_id": "sft", "world_size": 2, "mode": "quota", "token_env": "T",
      "source": {"paths": ["a.jsonl"]},
      "batching": {"token_budget": 4096, "pool_steps": 2, "over_budget": "alone"}},
     "ddb9876030ffb759"),
    ({"job_id": "d", "world_size": 1, "source": {"paths": ["a.jsonl"]}}, "af91497357320800"),
    ({"job_id": "gen", "mode": "refill", "epochs": 2, "source": {"paths": ["p.jsonl"]},
      "refill": {"generation_tokens": 64, "over_budget": "alone"}}, "4c37b9b0be81ab55"),
])
def test_a_job_registered_by_the_one_job_model_of_earlier_builds_resumes(job, registered_hash):
    """The hashes these configs were registered with before jobs had a type per kind (the
    one JobConfig of earlier builds, which read every source in file order): a stored job
    keeps resuming after the upgrade (a training job in the order it started with)."""
    from pipeline.config import parse_job

    parsed = parse_job(job)
    if parsed.mode is JobMode.REFILL:
        assert registry.config_hash(parsed) == registered_hash
    else:
        assert registry.earlier_hash(parsed) == registered_hash
        assert registry.config_hash(registry.in_file_order(parsed)) == registered_hash
        assert registry.config_hash(parsed) != registered_hash  # shuffled: another plan


def test_a_job_an_earlier_build_registered_keeps_file_order_and_a_new_one_shuffles(redis_url):
    """The service resumes a job stored with the earlier build's hash in file order (its
    steps were planned so), with no change to its stored hash; a new job with the same config
    registers its own hash and is shuffled; options only a later build knows (a mixture) have
    no earlier hash."""
    from pipeline.config import ServiceConfig, parse_job
    from pipeline.service.state_factory import make_job_state

    cfg = ServiceConfig.model_validate({"redis_url": redis_url, "jobs": [
        {"job_id": "old", "world_size": 1, "source": {"paths": ["a.jsonl"]}},
        {"job_id": "new", "world_size": 1, "source": {"paths": ["a.jsonl"]}}]})
    old, new = cfg.jobs
    earlier = registry.earlier_hash(old)
    RedisJobState(redis_url, "old", config_hash=earlier, world_size=1).close()  # the old build
    state, served = make_job_state(cfg, old)
    assert served.source.shuffle is False and state.registered_in_file_order
    assert registry.read_job(state.client, "old").config_hash == earlier
    state.close()
    state, served = make_job_state(cfg, new)
    assert served.source.shuffle is True and not state.registered_in_file_order
    assert registry.read_job(state.client, "new").config_hash == registry.config_hash(new)
    state.close()
    mixed = parse_job({"job_id": "m", "world_size": 1, "source": {"mixture": [
        {"name": "a", "paths": ["a.jsonl"]}, {"name": "b", "paths": ["b.jsonl"]}]}})
    assert registry.earlier_hash(mixed) is None


def test_a_refill_job_is_listed_summarized_expired_and_deleted(redis_client, redis_url):
    """A `mode: refill` job is in the registry like any job: resumed with the same config,
    refused with another, summarized with its counts, its every key expired and deleted."""
    import numpy as np

    from pipeline.config import RefillJobConfig
    from pipeline.coordinator.refill_state import RefillState, RequestPayload, SourcePosition
    from pipeline.refill.request import RefillRequest

    job = RefillJobConfig(job_id="rf", source={"paths": ["p.jsonl"]})
    h = registry.config_hash(job)
    assert registry.register_refill_job(redis_client, "rf", config_hash=h)
    assert not registry.register_refill_job(redis_client, "rf", config_hash=h)  # a resume
    with pytest.raises(JobMismatch, match="another config"):
        registry.register_refill_job(redis_client, "rf", config_hash="other")
    RedisJobState(redis_url, "train", config_hash="c", world_size=1).close()
    with pytest.raises(JobMismatch, match="mode=join"):
        registry.register_refill_job(redis_client, "train", config_hash=h)
    st = RefillState(redis_client, "rf")
    assert st.hold_producer("p", 10_000)
    reqs = [RequestPayload(RefillRequest(f"s:{i}", 3, 3, seq=i), np.arange(3, dtype=np.int32))
            for i in range(3)]
    assert st.enqueue("p", SourcePosition(0, 0), SourcePosition(0, 3), True, reqs,
                      [{"sample_id": "s:3", "reason": "bad_record"}])
    st.refill("c", 6, [], 1)  # a consumer with a held set
    assert list_jobs(redis_client) == ["rf", "train"]
    s = job_summary(redis_client, "rf")
    assert (s.job.mode, s.job.state) == ("refill", "serving")
    assert (s.refill.enqueued, s.refill.in_flight, s.refill.quarantined) == (3, 1, 1)
    assert s.refill_records == [{"sample_id": "s:3", "reason": "bad_record"}]
    mine = {k.decode() for k in redis_client.keys("*{rf}*")}
    assert st.keys.refill_held("c") in mine and st.keys.meta in mine
    registry.expire_job(redis_client, "rf", 100)
    assert all(0 < redis_client.ttl(k) <= 100 for k in mine)
    registry.delete_job(redis_client, "rf")
    assert not redis_client.keys("*{rf}*") and list_jobs(redis_client) == ["train"]
