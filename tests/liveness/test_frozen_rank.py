"""Guarantees 4 and 8 against a frozen trainer rank (issue #27): a rank process SIGSTOPped
mid-epoch keeps its stream's socket open, so only the evidence of its client (acks,
heartbeats, answered pings) may keep its lease; once it lapses for `rank_timeout_seconds` the
job's `rank_failure_policy` applies.

Three rank processes on one replica (in this process: the boundary under test is the rank's),
real Redis, the contract's test settings (tests/liveness/contract.py). Ranks busy (not reading
their stream) keep their leases; rank 0 frozen while it holds its third batch loses its own,
and ranks 1 and 2 go on until back-pressure holds them.
- fail: they get ABORTED naming rank 0 within lease + rank timeout + slack;
- wait: they keep waiting (rank 0's lease lapsed, no error); thawed, rank 0 resumes and the
  epoch ends exactly once;
- shrink: they finish the epoch in a world of 2; thawed, rank 0 gets a clear end; exactly once
  overall, rank 0's batch in progress at the freeze coming back to the others.
"""

from __future__ import annotations

import time

import pytest
from contract import KEEPALIVE_BOUND_S, LEASE_S, RANK_TIMEOUT_S, service_settings
from scenario import (
    assert_done,
    assert_exactly_once,
    delivered_ids,
    kill_all,
    release,
    start_ranks,
    wait_ended,
    wait_paused,
)
from support.freeze import frozen
from support.waiting import wait_for, wait_until

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import start_service

pytestmark = pytest.mark.slow
W, N = 3, 600
SLACK_S = 4.0  # the replica's failure checks and the streams' reactions, on 2 loaded cores
EPOCH_S = 60.0  # the rest of the epoch, however slow the machine: only a hang exceeds it


@pytest.fixture
def service(redis_client, redis_url, request):
    """A replica under the policy the test is parametrized with, and its job's samples."""
    policy = request.param
    cfg = ServiceConfig.model_validate({
        "redis_url": redis_url, "metrics_port": None,
        **service_settings(rank_failure_policy=policy, grpc={"port": 0}),
        "jobs": [{"job_id": f"frozen-{policy}", "world_size": W, "seed": 1,
                  "source": {"paths": ["arrays"]},
                  "batching": {"token_budget": 1024, "max_window_samples": 64,
                               "pool_steps": 2}}]})
    samples = synthetic_samples(N, max_len=400, seed=1)
    svc = start_service(cfg, sample_sources={f"frozen-{policy}": ArraySource(samples)})
    try:
        yield svc, f"frozen-{policy}", {s.sample_id for s in samples}
    finally:
        svc.stop(grace=0.5)


def _three_ranks(tmp_path, svc, job: str, **kw) -> list:
    ranks = start_ranks(tmp_path, job, dict.fromkeys(range(W), svc.address), W, sleep=0.02,
                        **kw)
    try:
        wait_paused(ranks, 60)
    except BaseException:
        kill_all(ranks)
        raise
    return ranks


@pytest.mark.parametrize("service", ["fail"], indirect=True)
def test_a_busy_rank_keeps_its_lease(service, tmp_path):
    """The other side of the coin: ranks busy in a long step (an eval, a checkpoint) for longer
    than lease + rank timeout are not taken for dead ones; their clients keep their leases
    from gRPC's own thread while the training loop does not read."""
    svc, job, ids = service
    state = svc.runtimes[job].state
    ranks = _three_ranks(tmp_path, svc, job)  # each holds its third batch: busy
    try:
        assert not wait_until(lambda: bool(state.lapsed_ranks()),
                              LEASE_S + RANK_TIMEOUT_S + 1.0, interval=0.1), (
            f"lapsed while busy: {state.lapsed_ranks()}")
        release(ranks)
        wait_ended(ranks, EPOCH_S)
        assert_done(ranks)
        assert_exactly_once(delivered_ids(ranks), ids)
    finally:
        kill_all(ranks)


@pytest.mark.xfail(strict=True, reason="#27: the replica renews a connected rank's lease "
                   "itself: a frozen rank's lease never lapses, `fail` never fires")
@pytest.mark.parametrize("service", ["fail"], indirect=True)
def test_fail_aborts_the_others_naming_the_frozen_rank_in_bound(service, tmp_path):
    svc, job, _ = service
    ranks = _three_ranks(tmp_path, svc, job)
    bound = LEASE_S + RANK_TIMEOUT_S + SLACK_S
    try:
        with frozen(ranks[0].pid) as ice:
            release(ranks)
            wait_ended(ranks[1:], ice.frozen_at + bound - time.time(),
                       "ranks 1, 2 to be aborted")
        for r in ranks[1:]:
            err = r.last("error")
            assert err is not None and err["error"] == "ABORTED", r.records()[-2:]
            assert "rank 0 has been gone for" in err["details"]
            assert "rank_failure_policy=fail" in err["details"]
            # The lease lapses lease_seconds after rank 0's last sign of life (a heartbeat at
            # most heartbeat_s before the freeze), then the timeout runs.
            assert RANK_TIMEOUT_S <= err["t"] - ice.frozen_at <= bound, err["t"] - ice.frozen_at
    finally:
        kill_all(ranks)


@pytest.mark.xfail(strict=True, reason="#27: the replica renews a connected rank's lease "
                   "itself: a frozen rank's lease never lapses")
@pytest.mark.parametrize("service", ["wait"], indirect=True)
def test_wait_keeps_the_others_waiting_and_the_thawed_rank_resumes(service, tmp_path):
    svc, job, ids = service
    state = svc.runtimes[job].state
    ranks = _three_ranks(tmp_path, svc, job)
    try:
        with frozen(ranks[0].pid) as ice:
            release(ranks)
            wait_for(lambda: 0 in state.lapsed_ranks(), LEASE_S + SLACK_S,
                     "rank 0's lease to lapse")
            # Past the point where `fail` would have aborted them: still waiting, no error.
            time.sleep(max(0.0, ice.frozen_at + LEASE_S + RANK_TIMEOUT_S + 1.0 - time.time()))
            assert not any(r.finished() for r in ranks[1:]), [r.records()[-1:] for r in ranks]
            assert svc.runtimes[job].error() is None
        wait_ended(ranks, EPOCH_S, "the epoch to end after the thaw")
        assert_done(ranks)
        assert ranks[0].last("done")["reconnects"] >= 1  # its stream was closed meanwhile
        assert_exactly_once(delivered_ids(ranks), ids)
    finally:
        kill_all(ranks)


@pytest.mark.xfail(strict=True, reason="#27: the replica renews a connected rank's lease "
                   "itself: a frozen rank's lease never lapses, `shrink` never fires")
@pytest.mark.parametrize("service", ["shrink"], indirect=True)
def test_shrink_finishes_the_epoch_without_the_frozen_rank_exactly_once(service, tmp_path):
    svc, job, ids = service
    ranks = _three_ranks(tmp_path, svc, job, next_ranks={1: 0, 2: 1})
    bound = LEASE_S + RANK_TIMEOUT_S + SLACK_S
    frozen_rank = ranks[0]
    try:
        with frozen(frozen_rank.pid) as ice:
            release(ranks)
            wait_for(lambda: all(any(e.get("reason") == "reconfigure" for e in r.records())
                                 for r in ranks[1:]),
                     ice.frozen_at + bound - time.time(), "ranks 1, 2 to leave the world of 3")
            wait_ended(ranks[1:], EPOCH_S, "ranks 1, 2 to finish the epoch in a world of 2")
        assert_done(ranks[1:])
        wait_ended([frozen_rank], KEEPALIVE_BOUND_S + SLACK_S, "the thawed rank 0 to end")
        end = frozen_rank.last("left") or frozen_rank.last("error")
        assert end is not None and not frozen_rank.last("done"), frozen_rank.records()[-3:]
        assert "left" in end or end["error"] in ("FAILED_PRECONDITION", "ABORTED"), end
        # Rank 0's batches count up to the freeze, less the one it held "in training" then
        # (not acknowledged: it comes back to the new world); what it took once thawed is
        # trained by nobody (its world is gone).
        before = [b for b in frozen_rank.batches() if b["t"] < ice.frozen_at][:-1]
        got = delivered_ids(ranks[1:])
        got.update(i for b in before for i in b["ids"])
        assert_exactly_once(got, ids)
    finally:
        kill_all(ranks)
