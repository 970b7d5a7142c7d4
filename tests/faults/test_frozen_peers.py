"""Peers that stop answering without closing their sockets (issue #27): a frozen trainer
(SIGSTOP), a frozen replica (SIGSTOP), a replica cut from Redis, and a trainer quiet for longer
than its reconnect timeout when its replica goes away. With the contract's test settings
(keepalive 1 s + 1 s, lease 3 s, rank timeout 3 s) each is noticed within seconds, and nothing
is lost or repeated.

Before the fixes: a frozen rank's stream renewed its lease while merely connected, so the
others waited for ever; a frozen replica held its clients for ever (no keepalive); a trainer
quiet for longer than `reconnect_timeout` gave up at the first error after its pause."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from fault_helpers import (
    RankThread,
    ServerProc,
    assert_aborted_for,
    assert_join_coverage,
    fault_samples,
    job_dict,
    rank_proc,
    read_log,
)
from support.tcp_proxy import TcpProxy
from support.waiting import wait_for

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.redis_server import free_port
from pipeline.service.server import start_service
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

# Asserts time bounds: these modules run on one xdist worker, one test at a time (docs/ci.md).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("time-bounds")]
KEEPALIVE = {"keepalive_time_s": 1.0, "keepalive_timeout_s": 1.0}
LEASE, TIMEOUT = 3.0, 3.0


def test_a_frozen_trainer_loses_its_lease_and_the_fail_policy_aborts_the_others(
        redis_client, redis_url, tmp_path):
    """SIGSTOP of rank 0's process: its sockets stay open, its heartbeats stop. The server's
    keepalive drops its connection within keepalive_time_s + keepalive_timeout_s; its lease
    lapses `lease_seconds` after its last sign of life, and `rank_timeout_seconds` later the
    other ranks get ABORTED naming it."""
    cfg = ServiceConfig.model_validate({
        "redis_url": redis_url, "lease_seconds": LEASE, "rank_timeout_seconds": TIMEOUT,
        "metrics_port": None, "grpc": {"port": 0, **KEEPALIVE, "min_client_ping_interval_s": 0.5},
        "jobs": [job_dict("frozen", 3, seed=1, batching={"token_budget": 1024})]})
    svc = start_service(cfg, sample_sources={"frozen": ArraySource(
        synthetic_samples(900, max_len=400, seed=1))})
    log = tmp_path / "rank0.jsonl"
    # (Made first, started once rank 0 holds its lease: a rank that has not connected counts as
    # gone from the job's first claim on, and making a stream may import torch, slowly.)
    others = [RankThread(svc.address, "frozen", r, 3, sleep=0.01, **KEEPALIVE) for r in (1, 2)]
    proc = rank_proc(svc.address, "frozen", 0, 3, log, tmp_path / "rank0.json", sleep=0.1)
    try:
        wait_for(lambda: svc.runtimes["frozen"].state.rank_health()[0].client_id is not None,
                 60, "rank 0's lease")
        for r in others:
            r.start()
        wait_for(lambda: len([x for x in read_log(log) if "step" in x]) >= 3, 60,
                 "rank 0 to take 3 steps")
        proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        # The server's keepalive drops the frozen client's connection (its handler ends) ...
        wait_for(lambda: not svc.runtimes["frozen"].ranks[0].connected, 1.0 + 1.0 + 4.0,
                 "the server to drop the frozen client")
        # ... and its lease lapses a lease after its last heartbeat: the policy applies
        # (within the bound, plus the checks' polling on a loaded machine).
        assert_aborted_for(others, 0, frozen_at, TIMEOUT, LEASE + TIMEOUT + 5.0)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        svc.stop(grace=0.5)


def test_a_frozen_replica_is_left_within_the_keepalive_bound_and_nothing_is_lost(
        redis_client, redis_url):
    """Two replicas; the rank's target names both. SIGSTOP of the one it streams from (its
    listening socket still accepts TCP): the client's keepalive drops the connection within
    keepalive_time_s + keepalive_timeout_s, it reconnects to the other (the handshake bound
    gives up on the frozen one) and resumes after the last batch it received, byte-identical,
    exactly once."""
    job = job_dict("fz", 1, seed=3)
    a_port, b_port = free_port(), free_port()
    a = ServerProc(redis_url, a_port, job, 500, seed=3).wait_ready()
    b = ServerProc(redis_url, b_port, job, 500, seed=3).wait_ready()
    rank = RankThread(f"ipv4:127.0.0.1:{a_port},127.0.0.1:{b_port}", "fz", 0, 1, sleep=0.05,
                      **KEEPALIVE)
    try:
        rank.start()
        wait_for(lambda: len(rank.records) >= 5, 60, "5 batches")
        serving = next(p for p in (a, b) if serves_rank(p.address, "fz"))
        serving.proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        wait_for(lambda: rank.stream.reconnects >= 1, 2.0 + 6.0, "the client to notice")
        noticed = time.monotonic() - frozen_at
        rank.join(120)
        rank.check()
    finally:
        for p in (a, b):
            p.proc.send_signal(signal.SIGCONT)
            p.kill()
    assert noticed <= 2.0 + 6.0  # keepalive 1 + 1 s, plus slack for a loaded machine
    assert_join_coverage([rank.records], [s.sample_id for s in fault_samples(500, 3)], 1)


def serves_rank(address: str, job: str) -> bool:
    """Whether the replica at `address` has rank 0's stream (GetJob: what it sees itself)."""
    with grpc.insecure_channel(address) as ch:
        status = pb_grpc.DataServiceStub(ch).GetJob(pb.GetJobRequest(job_id=job), timeout=10)
    return status.ranks[0].connected


def test_the_reconnect_deadline_counts_from_the_start_of_the_outage(redis_client, redis_url):
    """A trainer quiet for longer than `reconnect_timeout` (a long eval), then its replica is
    killed and restarted: the outage is short, so the stream reconnects and finishes."""
    job = job_dict("quiet", 1, seed=4)
    port = free_port()
    server = ServerProc(redis_url, port, job, 300, seed=4).wait_ready()
    again = None
    rank = RankThread(server.address, "quiet", 0, 1, reconnect_timeout=3.0, **KEEPALIVE)
    try:
        it = iter(rank.stream)
        first = next(it)
        time.sleep(4.0)  # quiet longer than reconnect_timeout; the stream stays up meanwhile
        server.kill()
        again = ServerProc(redis_url, port, job, 300, seed=4).wait_ready()
        rest = list(it)  # reconnects and finishes the epoch
    finally:
        rank.stream.close()
        for p in (server, again):
            if p is not None:
                p.kill()
    assert rank.stream.reconnects >= 1 and rank.stream.done
    ids = [i for b in [first, *rest] for i in b.info.sample_ids]
    assert sorted(ids) == sorted(s.sample_id for s in fault_samples(300, 4))


def test_a_replica_cut_from_redis_ends_its_streams_and_its_ranks_fail_over(redis_client,
                                                                          redis_url):
    """Replica A loses Redis (a black hole both ways, its sockets open): within
    `state_timeout_seconds` it ends its streams UNAVAILABLE (it cannot vouch for a step without
    a recorded grant), and the rank, though still connected to A, reconnects through the
    target's next address (B) and finishes exactly once. The link heals later: nothing A held
    back changes anything. (`pick_first` over a list of addresses, which the client rotates;
    the default policy and a DNS name: test_state_cut_failover.py.)"""
    job = job_dict("cut", 1, seed=6)
    host, port = redis_url.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    proxy = TcpProxy((host, int(port))).start()

    def replica(url: str):
        cfg = ServiceConfig.model_validate({
            "redis_url": url, "lease_seconds": LEASE, "state_timeout_seconds": 2.0,
            "metrics_port": None, "grpc": {"port": 0, **KEEPALIVE}, "jobs": [job]})
        return start_service(cfg, sample_sources={"cut": ArraySource(fault_samples(400, 6))})

    a = replica(f"redis://{proxy.address}/0")
    b = replica(redis_url)
    rank = RankThread(f"ipv4:{a.address},{b.address}", "cut", 0, 1, sleep=0.05,
                      load_balancing="pick_first", **KEEPALIVE)
    try:
        rank.start()
        wait_for(lambda: len(rank.records) >= 5, 60, "5 batches from replica A")
        assert a.runtimes["cut"].ranks[0].connected  # pick_first: A, the first address
        proxy.black_hole()
        cut_at = time.monotonic()
        wait_for(lambda: b.runtimes["cut"].ranks[0].connected, 2.0 + 6.0,
                 "the rank to be served by replica B")
        failed_over = time.monotonic() - cut_at
        proxy.heal()
        rank.join(120)
        rank.check()
    finally:
        proxy.heal()
        for svc in (a, b):
            svc.stop(grace=0.5)
        proxy.close()
    assert failed_over <= 2.0 + 6.0  # the state timeout, plus slack for a loaded machine
    assert_join_coverage([rank.records], [s.sample_id for s in fault_samples(400, 6)], 1)
