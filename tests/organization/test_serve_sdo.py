"""SDO served for real: a `serve` process (real gRPC) on the test session's Ray and a real Redis
serves an SDO job on shipped chats to W=2 ranks for 2 epochs. Its producer actor embeds the
records, builds the graph and plans each epoch as visits; the ranks must receive every planned
visit exactly once, DGAP must hold (every rank its END, exact loss-scale totals), the coverage
floor must hold, redelivery must be byte-identical, `status` must show the ledger, and a
producer killed with SIGKILL mid-epoch must leave the ledger and the plan as they were."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scaleout"))
sys.path.insert(0, str(HERE.parent / "faults"))
from fault_helpers import RankThread, ids_by_epoch  # noqa: E402
from replica_procs import ReplicaProc, service_config  # noqa: E402
from support.waiting import wait_for  # noqa: E402

from pipeline.coordinator import RedisJobState, keys  # noqa: E402
from pipeline.coordinator.redis_ledger_store import RedisLedgerStore  # noqa: E402
from pipeline.organization.epoch_visits import split_visit_id  # noqa: E402
from pipeline.producer.actor import find_producer, stop_producer  # noqa: E402
from pipeline.sample_data import IMAGES_DIR, SAMPLE_CHATS  # noqa: E402

pytestmark = pytest.mark.slow

FIRST, ROWS = 50, 60  # rows 53 (no assistant turn) and 89 (not UTF-8) are bad records
W, EPOCHS = 2, 2


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sdo-serve")
    lines = SAMPLE_CHATS.read_bytes().split(b"\n")[FIRST:FIRST + ROWS]
    path = folder / "chats.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    (folder / "images").symlink_to(IMAGES_DIR)
    return path


@pytest.fixture
def cluster(ray_session, redis_client, redis_url):
    return ray.get_runtime_context().gcs_address, redis_url


def _job(job_id: str, chats: Path, budget: int) -> dict:
    return {"job_id": job_id, "world_size": W, "epochs": EPOCHS, "seed": 5,
            "source": {"paths": [str(chats)]},
            "batching": {"token_budget": budget, "pool_steps": 1, "max_window_samples": 32},
            "organization": {"kind": "sdo", "knn_k": 4, "locality": 1.0, "coverage_epochs": 2,
                             "embedding": {"cache_dir": str(chats.parent / "embeddings")}}}


def _serve(tmp_path: Path, cluster, job: dict) -> ReplicaProc:
    gcs, redis_url = cluster
    # prefetch 1: the producer may run at most 4 steps ahead of a rank (back-pressure).
    cfg = service_config(tmp_path, redis_url, gcs, job, grpc={"host": "127.0.0.1", "port": 0,
                                                              "prefetch_steps": 1})
    return ReplicaProc(cfg, job["job_id"]).wait_ready()


def _planned(store: RedisLedgerStore, job: str) -> dict[int, Counter]:
    return {e: Counter(store.visits(job, e)["visits"]) for e in range(EPOCHS)}


def _check_dgap(ranks: list[RankThread], state: RedisJobState) -> None:
    """Every rank got each epoch's END, its last batch is the END's final step, and every batch
    carries its step's exact all-rank totals (samples, tokens, loss tokens)."""
    ends = {e.epoch: e for e in state.epoch_ends()}
    assert sorted(ends) == list(range(EPOCHS))
    by_step: dict[int, list[tuple]] = defaultdict(list)
    for r in ranks:
        assert [e.epoch for e in r.ends] == list(range(EPOCHS)), f"rank {r.rank}: {r.ends}"
        assert r.ends[-1].job_done
        for e in r.ends:
            mine = [x["step"] for x in r.records if x["epoch"] == e.epoch]
            published = ends[e.epoch].final_step[r.rank]
            assert e.final_step == (max(mine) if mine else -1)
            assert e.final_step == (-1 if published is None else published)
        for x in r.records:
            by_step[x["step"]].append(x["scale"])
    for step, scales in by_step.items():
        assert len({s[:3] for s in scales}) == 1, f"step {step}: ranks disagree on its totals"
        total = scales[0][:3]
        assert total == tuple(sum(s[3 + i] for s in scales) for i in range(3)), (
            f"step {step}: totals {total} are not the sum of the ranks' batches")


def test_an_sdo_job_is_served_exactly_once_per_visit(cluster, chats, tmp_path):
    job_id = "sdo-served"
    replica = _serve(tmp_path, cluster, _job(job_id, chats, budget=2048))
    try:
        ranks = [RankThread(replica.address, job_id, r, W, epochs=EPOCHS).start()
                 for r in range(W)]
        for r in ranks:
            r.join(180)
            r.check()
        _, redis_url = cluster
        state = RedisJobState.attach(redis_url, job_id)
        assert state.is_done() and state.error() is None
        store = RedisLedgerStore(redis_url)
        org = store.organization(job_id)
        members = set(org["members"])
        assert len(members) == ROWS - 2  # the two bad records never enter the graph

        # Every planned visit delivered exactly once (a redelivery would fail ids_by_epoch).
        got = ids_by_epoch([r.records for r in ranks])
        planned = _planned(store, job_id)
        for e in range(EPOCHS):
            assert got[e] == planned[e], f"epoch {e}: delivered != planned visits"
            assert sum(planned[e].values()) == len(members)  # V = the dataset size
        assert state.counters().samples_in == sum(sum(c.values()) for c in got.values())
        assert any(split_visit_id(v)[1] > 0 for c in planned.values() for v in c)  # repeats
        # The coverage floor (C = 2): every sample trained at least once in the 2 epochs.
        seen = {split_visit_id(v)[0] for c in got.values() for v in c}
        assert seen == members
        _check_dgap(ranks, state)
        assert set(state.counters().quarantined_by_reason) == {"bad_utf8", "missing_roles"}

        # `status` (from Redis) shows the ledger after the planned epochs.
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--redis-url",
                              redis_url, "--job", job_id, "--json"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": ""})
        assert out.returncode == 0, out.stderr[-2000:]
        shown = json.loads(out.stdout)["jobs"][0]["exposure"]
        exposure = Counter(split_visit_id(v)[0] for c in got.values() for v in c)
        assert shown == store.summary(job_id)
        assert shown["epochs"] == EPOCHS and shown["max_epochs_unseen"] <= 1
        assert (shown["min"], shown["max"]) == (min(exposure.values()), max(exposure.values()))

        # Redelivery after the producer is gone (payloads rebuilt by id in the replica):
        # byte-identical batches, repeated visits included.
        from trainer_client import BatchStream

        first = {x["step"]: x for x in ranks[0].records if x["epoch"] == 0}
        again = BatchStream(replica.address, job_id, 0, W, prefetch=2)
        again.load_state_dict({**again.state_dict(), "next_step": 0, "epoch": 0,
                               "done": False, "epoch_first_step": 0})
        try:
            replayed = [(b.info.step, b.digest()) for b in again]
        finally:
            again.close()
        assert replayed == [(s, first[s]["digest"]) for s in sorted(first)]
    finally:
        replica.stop()
        stop_producer(job_id)


def test_a_producer_killed_mid_epoch_keeps_the_ledger_and_the_plan(cluster, chats, tmp_path):
    job_id = "sdo-restart"
    _, redis_url = cluster
    replica = _serve(tmp_path, cluster, _job(job_id, chats, budget=1024))
    try:
        ranks = [RankThread(replica.address, job_id, r, W, epochs=EPOCHS, sleep=0.2).start()
                 for r in range(W)]
        wait_for(lambda: min(len(r.records) for r in ranks) >= 1, 120, "the first batches")
        state = RedisJobState.attach(redis_url, job_id)
        k = keys.JobKeys(job_id)
        sdo_before = state.client.hgetall(k.sdo)
        visits_before = state.client.hgetall(k.sdo_visits)
        steps_before = {n: state.get_step(n) for n in range(state.published_through() + 1)}
        info = ray.get(find_producer(job_id).info.remote(), timeout=30)
        assert info["outcome"] is None and not state.is_done()  # really mid-plan
        assert list(visits_before) == [b"0"] and not ranks[0].ends  # mid-epoch 0
        os.kill(info["pid"], signal.SIGKILL)
        wait_for(lambda: state.producer_lease().generation > info["generation"], 90,
                 "the restarted producer")
        for r in ranks:  # (slow only so that the kill lands mid-plan: the rest at full speed)
            r.sleep = 0.0
        for r in ranks:
            r.join(240)
            r.check()
        assert state.is_done() and state.error() is None
        assert state.producer_lease().generation == info["generation"] + 1
        # The plan and the SDO state from before the kill are unchanged: the restarted
        # producer read epoch 0's visits back and planned on the same graph.
        assert all(state.get_step(n) == s for n, s in steps_before.items())
        assert state.client.hget(k.sdo_visits, "0") == visits_before[b"0"]
        assert state.client.hget(k.sdo, "organization") == sdo_before[b"organization"]
        store = RedisLedgerStore(redis_url)
        got = ids_by_epoch([r.records for r in ranks])
        planned = _planned(store, job_id)
        for e in range(EPOCHS):
            assert got[e] == planned[e], f"epoch {e}: delivered != planned visits"
        assert store.summary(job_id)["epochs"] == EPOCHS
        _check_dgap(ranks, state)
    finally:
        replica.stop()
        stop_producer(job_id)
