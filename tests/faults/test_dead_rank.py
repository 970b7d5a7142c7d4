"""Guarantee 4: a trainer rank killed with SIGKILL must not make the others hang.

rank_failure_policy=fail: once the dead rank's lease (2 s) has been lapsed for
rank_timeout_seconds (2 s), the other ranks' streams end with ABORTED naming the rank, within a
bound, and GetJob reports it. rank_failure_policy=wait: they keep waiting (no error), and when
the rank is restarted from its state_dict everything finishes with exact coverage.
(A rank restarted *before* the timeout is tests/service/test_trainer_processes.py.)"""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from fault_helpers import (
    RankThread,
    assert_aborted_for,
    assert_join_coverage,
    job_dict,
    rank_proc,
    read_log,
)
from support.waiting import wait_for

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import start_service
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

# Asserts time bounds: these modules run on one xdist worker, one test at a time (docs/ci.md).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("time-bounds")]
W, N, LEASE, TIMEOUT = 3, 900, 2.0, 2.0


def serve(redis_url: str, policy: str):
    cfg = ServiceConfig.model_validate({
        "redis_url": redis_url, "lease_seconds": LEASE, "rank_timeout_seconds": TIMEOUT,
        "rank_failure_policy": policy, "metrics_port": None, "grpc": {"port": 0},
        "jobs": [job_dict("dead", W, seed=1, batching={"token_budget": 1024})]})
    samples = synthetic_samples(N, max_len=400, seed=1)
    return start_service(cfg, sample_sources={"dead": ArraySource(samples)}), samples


def get_job(address: str) -> pb.JobStatus:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DataServiceStub(ch).GetJob(pb.GetJobRequest(job_id="dead"), timeout=10)


def start_and_kill_rank0(svc, tmp_path):
    log, state = tmp_path / "rank0.jsonl", tmp_path / "rank0.state.json"
    proc = rank_proc(svc.address, "dead", 0, W, log, state, sleep=0.1)
    # The others start as soon as rank 0 holds its lease: a rank that has not connected yet
    # counts as gone from the job's first claim on, and rank 0's slow process start must not be
    # mistaken for that (the threads connect within milliseconds).
    steps0 = lambda: len([x for x in read_log(log) if "step" in x])  # noqa: E731
    job_state = svc.runtimes["dead"].state
    try:
        wait_for(lambda: job_state.lease(0) is not None, 60, "rank 0's lease")
    except AssertionError:
        proc.kill()
        raise AssertionError(f"rank 0: {read_log(log)[-1:]}") from None
    others = [RankThread(svc.address, "dead", r, W, sleep=0.01).start() for r in (1, 2)]
    try:
        wait_for(lambda: steps0() >= 3, 60, "rank 0 to take 3 steps")
    except AssertionError:
        proc.kill()
        raise AssertionError(f"rank 0: {read_log(log)[-1:]}") from None
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    return time.monotonic(), others, log, state


def test_fail_policy_aborts_the_other_ranks_naming_the_dead_one(redis_client, redis_url,
                                                                tmp_path):
    svc, _ = serve(redis_url, "fail")
    try:
        killed_at, others, _, _ = start_and_kill_rank0(svc, tmp_path)
        # not before the lease lapsed + the timeout, and within the bound (+ polling slack)
        assert_aborted_for(others, 0, killed_at, TIMEOUT, LEASE + TIMEOUT + 5.0)
        status = get_job(svc.address)
        assert 0 in status.lapsed_ranks
        assert "rank 0 has been gone for" in status.error
    finally:
        svc.stop(grace=0.5)


def test_wait_policy_keeps_waiting_then_finishes_when_the_rank_returns(redis_client, redis_url,
                                                                       tmp_path):
    svc, samples = serve(redis_url, "wait")
    try:
        _, others, log, state = start_and_kill_rank0(svc, tmp_path)
        time.sleep(LEASE + TIMEOUT + 2.5)  # well past the point where `fail` would abort
        for r in others:
            assert r.error is None and not r.finished.is_set(), (r.rank, r.error)
        status = get_job(svc.address)
        assert 0 in status.lapsed_ranks and status.error == ""
        stalled = [len(r.records) for r in others]
        time.sleep(0.5)
        assert [len(r.records) for r in others] == stalled  # held by back-pressure, not lost
        # rank 0 restarted from its state_dict
        again = rank_proc(svc.address, "dead", 0, W, log, state, sleep=0.0)
        out, _ = again.communicate(timeout=60)
        assert again.returncode == 0, out.decode()[-2000:]
        for r in others:
            r.join(60)
            r.check()
    finally:
        svc.stop(grace=0.5)
    recs0 = [rec for rec in read_log(log) if "step" in rec]
    assert read_log(log)[-1] == {"done": True}
    # the restarted rank 0 redelivers at most the step in progress, byte-identical; the live
    # ranks never get a step twice
    assert_join_coverage([recs0, others[0].records, others[1].records],
                         [s.sample_id for s in samples], 1, max_redelivered=[1, 0, 0])


def test_a_rank_that_never_connects_is_treated_as_a_dead_one(redis_client, redis_url):
    """Guarantee 4's other half: rank 0 never opens a stream. Its absence counts from the job's
    first claim; after rank_timeout_seconds the live ranks get the fail policy's ABORTED naming
    it, within the bound (before the fix they waited for it forever)."""
    svc, _ = serve(redis_url, "fail")
    try:
        started = time.monotonic()
        others = [RankThread(svc.address, "dead", r, W, sleep=0.01).start() for r in (1, 2)]
        assert_aborted_for(others, 0, started, TIMEOUT, TIMEOUT + 10)
        assert "rank 0 has been gone for" in get_job(svc.address).error
    finally:
        svc.stop(grace=0.5)
