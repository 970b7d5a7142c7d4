"""The SDO state in Redis (`RedisLedgerStore`) keeps the `LedgerStore` contract of the memory store
(write-once, in order, replays read back) and is fenced like a publication: only the producer
holding the lease, at its generation, can record an epoch or the organization."""

from __future__ import annotations

import pytest
from sdo_cases import graph_of

from pipeline.coordinator import RedisJobState, job_summary, keys, registry
from pipeline.coordinator.redis_ledger_store import RedisLedgerStore
from pipeline.errors import Fenced
from pipeline.organization.epoch_visits import plan_epoch_visits
from pipeline.organization.exposure_ledger import ExposureLedger
from pipeline.organization.ledger_store import MemoryLedgerStore, epoch_visits_for
from pipeline.organization.organizer import Organization

JOB = "sdo-store"


@pytest.fixture
def state(redis_client, redis_url):
    st = RedisJobState(redis_url, JOB, config_hash="h", world_size=2)
    yield st
    st.close()


@pytest.fixture(params=["memory", "redis"])
def store(request, state, redis_url):
    if request.param == "memory":
        return MemoryLedgerStore()
    gen = state.claim_producer("p", 60)
    return RedisLedgerStore(redis_url).fenced(gen)


def _epochs(g, n: int, seed: int = 0):
    ledger = ExposureLedger.initial(g.digest, g.size)
    out = []
    for e in range(n):
        v, ledger = plan_epoch_visits(g, ledger, e, seed=seed, coverage_epochs=2)
        out.append((v.to_dict(), ledger.to_dict()))
    return out


def test_contract_write_once_in_order_and_replayed(store):
    g, _ = graph_of(30, k=4)
    (v0, l1), (v1, l2), (v2, l3) = _epochs(g, 3)
    assert store.latest(JOB) is None and store.visits(JOB, 0) is None
    assert store.summary(JOB) is None
    store.save(JOB, v0, l1)
    store.save(JOB, v0, l1)  # identical again: a no-op
    (other, _), = _epochs(g, 1, seed=9)
    assert other != v0
    with pytest.raises(ValueError, match="differently"):
        store.save(JOB, other, l1)
    with pytest.raises(ValueError, match="out of order"):
        store.save(JOB, v2, l3)
    store.save(JOB, v1, l2)
    assert store.visits(JOB, 0) == v0 and store.visits(JOB, 1) == v1
    assert store.latest(JOB) == l2
    assert store.summary(JOB) == ExposureLedger.from_dict(l2).summary()
    # A producer that restarts on this store replays epochs 0 and 1, then plans epoch 2 alike.
    kw = {"seed": 0, "coverage_epochs": 2}
    assert epoch_visits_for(store, JOB, g, 1, **kw).to_dict() == v1
    assert epoch_visits_for(store, JOB, g, 2, **kw).to_dict() == v2


def test_contract_the_organization_is_recorded_once(store):
    g, _ = graph_of(12, k=3)
    rec = Organization(g, 8192, 40, 1).record()
    assert store.organization(JOB) is None
    store.save_organization(JOB, rec)
    store.save_organization(JOB, dict(rec))  # identical: a no-op
    assert store.organization(JOB) == rec
    with pytest.raises(ValueError, match="organization was already recorded differently"):
        store.save_organization(JOB, {**rec, "repeat_gap": 41})


def test_only_the_current_producer_generation_writes(state, redis_url, redis_client):
    g, _ = graph_of(20, k=4)
    (v0, l1), (v1, l2) = _epochs(g, 2)
    base = RedisLedgerStore(redis_url)
    with pytest.raises(ValueError, match="only reads"):
        base.save(JOB, v0, l1)
    old = state.claim_producer("a", 60)
    base.fenced(old).save(JOB, v0, l1)
    new = state.claim_producer("a", 60)  # the same holder again: a new generation
    assert new > old
    before = redis_client.hgetall(keys.JobKeys(JOB).sdo)
    with pytest.raises(Fenced):
        base.fenced(old).save(JOB, v1, l2)  # a zombie of the first generation
    with pytest.raises(Fenced):
        base.fenced(old).save_organization(JOB, {"version": 1})
    assert redis_client.hgetall(keys.JobKeys(JOB).sdo) == before  # refused = unchanged
    assert base.visits(JOB, 1) is None
    base.fenced(new).save(JOB, v1, l2)
    # What `status` reads: the summary after the last planned epoch, from Redis alone.
    summary = job_summary(redis_client, JOB)
    assert summary.exposure == ExposureLedger.from_dict(l2).summary()
    assert summary.exposure["epochs"] == 2
    registry.delete_job(redis_client, JOB)  # the operator's delete takes the SDO keys too
    assert not [k for k in redis_client.keys("*") if JOB.encode() in k]
