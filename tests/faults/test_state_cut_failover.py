"""A replica cut off from the job's state behind one DNS name (#40 item 2), the way the shipped
Kubernetes trainer dials the service (`dns:///odb-pipeline-headless:50051`, each ready
replica an address of the name).

Two in-process replicas on 127.0.0.1:P and 127.0.0.2:P behind one name (a DNS server of the
test's own, `support/dns_server.py`: gRPC's own resolver asks it), each reaching Redis through
a black-holing proxy, and ranks on the client's defaults. A replica that cannot reach the state
must say so (gRPC health and /healthz NOT_SERVING, SERVING again once it can), and its ranks
must move to the other address although their connection to it stays up; a rank whose only
replica stays cut off must get its error once `reconnect_timeout` has passed since the outage
began, however long each failed call takes.

Before the fix: the client's `pick_first` chose the cut replica again and again (its connection
was READY, its health was never set to anything but SERVING), and a failed call that took
longer than the keepalive bound restarted the outage's clock: the rank retried for ever.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
import pytest
from fault_helpers import RankThread, assert_join_coverage, fault_samples, job_dict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.dns_server import DnsServer
from support.tcp_proxy import TcpProxy
from support.waiting import wait_for

from pipeline.config import ServiceConfig
from pipeline.observability.http_server import start_metrics_server
from pipeline.preprocess.array_source import ArraySource
from pipeline.redis_server import free_port
from pipeline.service.server import RunningService, start_service

# Asserts time bounds: these modules run on one xdist worker, one test at a time (docs/ci.md).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("time-bounds")]
KEEPALIVE = {"keepalive_time_s": 1.0, "keepalive_timeout_s": 1.0}
LEASE = 3.0
STATE_TIMEOUT = 2.0
# A cut replica goes NOT_SERVING within its state timeout and the probe's period (0.5 s), plus
# slack for a loaded machine.
NOT_SERVING_BOUND = STATE_TIMEOUT + 1.0 + 3.0
# Its streams end within the state timeout; a reconnection may meet it once more before its
# NOT_SERVING is out (an Open there fails after the state timeout and the resume grace, 2 s);
# plus slack for a loaded machine.
MOVE_BOUND = 2 * STATE_TIMEOUT + 2.0 + 4.0
# Healed, it serves again once a ping answers: a ping held in the partition, or the Redis
# client's reconnection and its retries (no bound is promised: a hang bound).
HEALED_BOUND = 30.0
SAMPLES, SEED, W = 600, 7, 2
A_HOST, B_HOST = "127.0.0.1", "127.0.0.2"  # the name's two addresses


def _replica(job: dict, redis: TcpProxy, host: str, port: int, **settings: float
             ) -> RunningService:
    cfg = ServiceConfig.model_validate({
        "redis_url": f"redis://{redis.address}/0", "lease_seconds": LEASE,
        "state_timeout_seconds": STATE_TIMEOUT, "metrics_port": None,
        "grpc": {"host": host, "port": port, **KEEPALIVE, "min_client_ping_interval_s": 0.5},
        "jobs": [job], **settings})
    return start_service(cfg, sample_sources={job["job_id"]: ArraySource(
        fault_samples(SAMPLES, SEED))})


def _health(host: str, port: int) -> int:
    """A replica's gRPC health for the whole server, asked over gRPC."""
    with grpc.insecure_channel(f"{host}:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING)


def test_ranks_on_a_dns_name_leave_a_replica_cut_from_redis_and_finish_exactly_once(
        redis_client, redis_server):
    """Replica B is cut from Redis first: it reports NOT_SERVING, so the ranks (dialling the
    name with the client's defaults) all start on A; B heals and serves again. Then A is cut
    mid-epoch: it reports NOT_SERVING (gRPC health and /healthz 503), ends its streams, and
    every rank is served by B within two state timeouts and the resume grace, though its
    connection to A stays up. The epoch ends with every sample exactly once."""
    job = job_dict("dns-cut", W, seed=SEED)
    proxies = [TcpProxy(("127.0.0.1", redis_server.port)).start() for _ in range(2)]
    port = free_port()
    a = _replica(job, proxies[0], A_HOST, port)
    b = _replica(job, proxies[1], B_HOST, port)
    _, healthz = start_metrics_server(0, a)
    dns = DnsServer({"odb-replicas": [A_HOST, B_HOST]}).start()
    ranks: list[RankThread] = []
    try:
        assert _health(A_HOST, port) == _health(B_HOST, port) == SERVING
        assert _healthz(healthz) == 200
        proxies[1].black_hole()
        wait_for(lambda: _health(B_HOST, port) == NOT_SERVING, NOT_SERVING_BOUND,
                 "B to report NOT_SERVING")
        ranks = [RankThread(dns.target("odb-replicas", port), "dns-cut", r, W, sleep=0.05,
                            **KEEPALIVE).start() for r in range(W)]
        wait_for(lambda: all(len(r.records) >= 3 for r in ranks), 60, "3 batches per rank")
        assert all(a.runtimes["dns-cut"].ranks[r].connected for r in range(W)), (
            "a rank went to B while it reported NOT_SERVING")
        proxies[1].heal()
        wait_for(lambda: _health(B_HOST, port) == SERVING, HEALED_BOUND, "B to serve again")

        proxies[0].black_hole()
        cut_at = time.monotonic()
        wait_for(lambda: _health(A_HOST, port) == NOT_SERVING and _healthz(healthz) == 503,
                 NOT_SERVING_BOUND, "A to report NOT_SERVING (gRPC health and /healthz)")
        # (B served nothing before the cut; a rank that moved may finish before the other.)
        wait_for(lambda: all(b.runtimes["dns-cut"].payloads.fetched_by_rank().get(r)
                             for r in range(W)), MOVE_BOUND, "every rank to be served by B")
        moved = time.monotonic() - cut_at
        proxies[0].heal()
        wait_for(lambda: _health(A_HOST, port) == SERVING and _healthz(healthz) == 200,
                 HEALED_BOUND, "A to serve again once it reaches Redis")
        for r in ranks:
            r.join(120)
            r.check()
    finally:
        for p in proxies:
            p.heal()
        for r in ranks:
            r.stream.close()
        for svc in (a, b):
            svc.stop(grace=0.5)
        for p in proxies:
            p.close()
        dns.close()
    assert moved <= MOVE_BOUND
    assert_join_coverage([r.records for r in ranks],
                         [s.sample_id for s in fault_samples(SAMPLES, SEED)], 1)


def test_a_rank_whose_only_replica_stays_cut_off_gets_its_error_after_reconnect_timeout(
        redis_client, redis_server):
    """Every call to a replica cut from Redis fails after the state timeout (3 s, longer than
    the client's 2 s keepalive bound). None of those failed calls is a working connection: the
    outage runs from the first failure, and the rank gets UNAVAILABLE once `reconnect_timeout`
    (4 s) has passed, within one more failed call."""
    job = job_dict("one-cut", 1, seed=SEED)
    proxy = TcpProxy(("127.0.0.1", redis_server.port)).start()
    svc = _replica(job, proxy, "127.0.0.1", free_port(), state_timeout_seconds=3.0)
    rank = RankThread(svc.address, "one-cut", 0, 1, sleep=0.05, reconnect_timeout=4.0,
                      **KEEPALIVE)
    try:
        rank.start()
        wait_for(lambda: len(rank.records) >= 3, 60, "3 batches")
        proxy.black_hole()
        cut_at = time.monotonic()
        rank.join(4.0 + 3 * 3.0 + 5.0)  # the outage, the calls in it, slack
        assert isinstance(rank.error, Exception) and "UNAVAILABLE" in str(rank.error), (
            f"the rank ended with {rank.error!r}")
        assert rank.error_at is not None and rank.error_at - cut_at <= 4.0 + 2 * 3.0 + 3.0
    finally:
        proxy.heal()
        rank.stream.close()
        svc.stop(grace=0.5)
        proxy.close()
