"""Scale-out with real processes: N `serve` replicas on one Redis and one Ray cluster are one
service, with exactly one producer per job (a Ray actor), payloads fetched by reference and only
for the ranks a replica serves; a replica or the producer can die without losing or repeating a
sample."""

from __future__ import annotations

import os
import signal

import pytest
import ray
from replica_procs import CHATS, ReplicaProc, free_port, service_config
from support.reference_plan import assert_same_plan, reference_plan
from support.waiting import wait_for

from pipeline.coordinator import RedisJobState
from pipeline.producer.actor import find_producer, stop_producer

pytestmark = pytest.mark.slow
sys_path = os.path.dirname(__file__)
ROWS_PAIR, ROWS_FAULTS = 120, 300  # rows of the shipped chats each job reads


def _job(job_id: str, tmp_path, rows: int, epochs: int, budget: int = 4096) -> dict:
    chats = tmp_path / "chats.jsonl"  # real chats with pictures and a few bad records
    chats.write_bytes(b"".join(CHATS.read_bytes().splitlines(keepends=True)[:rows]))
    return {"job_id": job_id, "world_size": 4, "epochs": epochs, "seed": 3,
            "source": {"paths": [str(chats)]},
            "batching": {"token_budget": budget, "pool_steps": 2, "max_window_samples": 32}}


def _ranks(endpoints: dict[int, str], job: str, epochs: int, sleep: float = 0.0) -> list:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(sys_path), "faults"))
    from fault_helpers import RankThread

    # pick_first: each rank on the first address of its list (the default, round_robin,
    # would spread them), so the test knows which replica serves it.
    return [RankThread(endpoints[r], job, r, 4, epochs=epochs, sleep=sleep,
                       load_balancing="pick_first").start() for r in sorted(endpoints)]


def _coverage(ranks, state, epochs: int, tmp_path, rows: int) -> None:
    """Every sample of the input (each row of the job's file but the quarantined ones, not what
    the service counted: a successor that skipped rows would lower its counts too) delivered
    exactly once in every epoch; no live client ever got a step twice (a failover resumes
    after the last step received)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(sys_path), "faults"))
    from fault_helpers import assert_join_coverage

    rows_ids = {f"{tmp_path / 'chats.jsonl'}:{row}" for row in range(rows)}
    bad = {q.sample_id for q in state.quarantine()}
    assert bad < rows_ids and len(bad) == state.counters().quarantined
    assert_join_coverage([r.records for r in ranks], sorted(rows_ids - bad), epochs)


@pytest.fixture
def cluster(ray_session, redis_client, redis_url):
    return ray.get_runtime_context().gcs_address, redis_url


def test_two_replicas_started_together_one_producer_each_fetches_only_its_ranks(
        cluster, tmp_path):
    gcs, redis_url = cluster
    job = _job("pair", tmp_path, rows=ROWS_PAIR, epochs=2)
    cfg = service_config(tmp_path, redis_url, gcs, job)
    a, b = ReplicaProc(cfg, "a"), ReplicaProc(cfg, "b")  # the same instant
    try:
        a.wait_ready()
        b.wait_ready()
        wait_for(lambda: find_producer("pair") is not None, 60, "the producer actor")
        names = [n for n in ray.util.list_named_actors(all_namespaces=True)
                 if n["name"] == "producer:pair"]
        assert len(names) == 1  # exactly one producer for the job
        ranks = _ranks({0: a.address, 1: a.address, 2: b.address, 3: b.address}, "pair", 2)
        for r in ranks:
            r.join(240)
            r.check()
        state = RedisJobState.attach(redis_url, "pair")
        assert state.is_done() and state.producer_lease().generation == 1  # never replaced
        _coverage(ranks, state, 2, tmp_path, ROWS_PAIR)
        # A replica holds payloads only of the ranks it serves (its payload accounting).
        assert a.fetched_ranks("pair") == {0, 1}
        assert b.fetched_ranks("pair") == {2, 3}
        assert state.counters().quarantined_by_reason  # the bad records, counted once
    finally:
        for p in (a, b):
            p.stop()
        stop_producer("pair")


def test_late_replica_replica_kill_and_producer_kill_lose_and_repeat_nothing(
        cluster, tmp_path):
    gcs, redis_url = cluster
    job = _job("faults", tmp_path, rows=ROWS_FAULTS, epochs=1, budget=1024)  # ~60 steps
    cfg = service_config(tmp_path, redis_url, gcs, job)
    pa, pb = free_port(), free_port()
    # Any gRPC target works as an endpoint; pick_first fails over to the next address.
    a_first, b_first = f"ipv4:127.0.0.1:{pa},127.0.0.1:{pb}", f"ipv4:127.0.0.1:{pb},127.0.0.1:{pa}"
    a = ReplicaProc(cfg, "a", pa).wait_ready()
    b = None
    try:
        first = _ranks({0: a_first, 1: a_first}, "faults", 1, sleep=0.15)
        wait_for(lambda: min(len(r.records) for r in first) >= 1, 120, "the first batches")
        state = RedisJobState.attach(redis_url, "faults")
        # Planning is held mid-epoch by back-pressure (ranks 2 and 3 have not come yet): kill -9
        # the producer actor's process. Ray restarts it; it resumes from its checkpoint under a
        # new lease generation, and no published step ever changes.
        before = {n: state.get_step(n) for n in range(state.published_through() + 1)}
        info = ray.get(find_producer("faults").info.remote(), timeout=30)
        assert info["outcome"] is None and not state.is_done()  # really mid-plan
        os.kill(info["pid"], signal.SIGKILL)
        wait_for(lambda: (state.producer_lease() is not None
                          and state.producer_lease().generation > info["generation"]),
                 90, "the restarted producer")
        # A replica started after the job began serves the other ranks at once.
        b = ReplicaProc(cfg, "b", pb).wait_ready()
        late = _ranks({2: b_first, 3: b_first}, "faults", 1, sleep=0.15)
        wait_for(lambda: min(len(r.records) for r in late) >= 2, 60, "b serving ranks 2, 3")
        assert b.fetched_ranks("faults") == {2, 3}
        wait_for(lambda: state.published_through() > max(before), 60, "steps of the new producer")
        assert all(state.get_step(n) == s for n, s in before.items())
        # kill -9 of replica b mid-epoch: ranks 2 and 3 fail over to replica a.
        assert not any(r.finished.is_set() for r in late), "b was not killed mid-epoch"
        b.kill()
        ranks = first + late
        for r in ranks:
            r.join(240)
            r.check()
        assert all(r.stream.reconnects >= 1 for r in late)
        assert state.is_done() and state.error() is None
        assert state.producer_lease().generation == info["generation"] + 1
        _coverage(ranks, state, 1, tmp_path, ROWS_FAULTS)
        # The same samples at every (epoch, step, rank) as a run on a fresh state: the killed
        # producer's successor read the job's order on from its checkpoint (Guarantee 11).
        plan = reference_plan(job)
        assert assert_same_plan(plan, [(x["epoch"], x["step"], r.rank, x["ids"])
                                       for r in ranks for x in r.records]) > 0
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()
        stop_producer("faults")
