"""Guarantees 4 and 8 against a frozen trainer rank (issue #27): a rank process SIGSTOPped
mid-epoch keeps its stream's socket open, so only the evidence of its client (acks,
heartbeats, answered pings) may keep its lease; once it lapses for `rank_timeout_seconds` the
job's `rank_failure_policy` applies.

Each scenario: three rank processes on a replica of its own (in this process: the boundary
under test is the rank's), real Redis, the contract's test settings
(tests/liveness/contract.py). All ranks hold their third batch (busy); then rank 0 is frozen,
and ranks 1 and 2 go on until back-pressure holds them.
- busy (no freeze): ranks not reading their stream for longer than lease + rank timeout keep
  their leases;
- fail: ranks 1, 2 get ABORTED naming rank 0 within lease + rank timeout + slack;
- wait: they keep waiting (rank 0's lease lapsed, no error); thawed, rank 0 resumes and the
  epoch ends exactly once;
- shrink: they finish the epoch in a world of 2; thawed, rank 0 gets a clear end; exactly once
  overall, rank 0's batch in progress at the freeze coming back to the others.
The scenarios are mostly waiting on leases and timeouts, so they run at once, each driven by a
thread of its own that records what happened (`Run.seen`); each test then checks its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.freeze import frozen
from support.waiting import wait_until

from liveness.contract import KEEPALIVE_BOUND_S, LEASE_S, RANK_TIMEOUT_S, service_settings
from liveness.rank_process import RankProcess
from liveness.scenario import (
    assert_done,
    assert_exactly_once,
    delivered_ids,
    kill_all,
    release,
    start_ranks,
    wait_paused,
)
from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.redis_server import LocalRedis
from pipeline.service.server import RunningService, start_service

# Asserts time bounds: these modules run on one xdist worker, one test at a time (docs/ci.md).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("time-bounds")]
W, N = 3, 600
SLACK_S = 4.0  # the replica's failure checks and the streams' reactions, on 2 loaded cores
EPOCH_S = 60.0  # the rest of the epoch, however slow the machine: only a hang exceeds it
POLICY_BOUND_S = LEASE_S + RANK_TIMEOUT_S + SLACK_S  # from the freeze to the policy's effect


@dataclass
class Run:
    """One scenario: its replica, job and ranks, and what its driver saw (event -> time)."""

    svc: RunningService
    job: str
    ids: set[str]
    ranks: list[RankProcess]
    seen: dict[str, Any] = field(default_factory=dict)
    failure: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __repr__(self) -> str:
        return f"Run({self.job}, seen={self.seen})"

    @property
    def state(self):
        return self.svc.runtimes[self.job].state

    def ended(self, ranks: list[RankProcess], timeout: float) -> bool:
        return wait_until(lambda: all(r.finished() for r in ranks), timeout, 0.05)

    def drive(self, script: Callable[[Run], None]) -> None:
        try:
            wait_paused(self.ranks, 60)
            script(self)
        except BaseException as exc:
            self.failure = exc
        finally:
            self.done.set()

    def result(self) -> Run:
        """Once its driver is done (re-raising what failed in it)."""
        assert self.done.wait(2 * EPOCH_S), f"the {self.job} scenario did not end"
        if self.failure is not None:
            raise self.failure
        return self


def busy(run: Run) -> None:
    run.seen["lapsed"] = wait_until(lambda: bool(run.state.lapsed_ranks()),
                                    LEASE_S + RANK_TIMEOUT_S + 1.0, 0.1)
    release(run.ranks)
    run.ended(run.ranks, EPOCH_S)


def fail(run: Run) -> None:
    with frozen(run.ranks[0].pid) as ice:
        run.seen["frozen"] = ice.frozen_at
        release(run.ranks)
        run.ended(run.ranks[1:], ice.frozen_at + POLICY_BOUND_S - time.time())


def wait(run: Run) -> None:
    with frozen(run.ranks[0].pid) as ice:
        release(run.ranks)
        if not wait_until(lambda: 0 in run.state.lapsed_ranks(), LEASE_S + SLACK_S, 0.1):
            return
        run.seen["lapsed"] = time.time() - ice.frozen_at
        # Past the point where `fail` would have aborted them: still waiting, no error?
        time.sleep(max(0.0, ice.frozen_at + LEASE_S + RANK_TIMEOUT_S + 1.0 - time.time()))
        run.seen["waiting"] = [not r.finished() for r in run.ranks[1:]]
        run.seen["error"] = run.svc.runtimes[run.job].error()
    run.ended(run.ranks, EPOCH_S)


def shrink(run: Run) -> None:
    def reconfigured() -> bool:
        return all(any(e.get("reason") == "reconfigure" for e in r.records())
                   for r in run.ranks[1:])

    with frozen(run.ranks[0].pid) as ice:
        run.seen["frozen"] = ice.frozen_at
        release(run.ranks)
        if not wait_until(reconfigured, POLICY_BOUND_S, 0.05):
            return
        run.seen["reconfigured"] = time.time() - ice.frozen_at
        run.ended(run.ranks[1:], EPOCH_S)
    run.seen["thaw_ended"] = run.ended(run.ranks[:1], KEEPALIVE_BOUND_S + SLACK_S)


SCENARIOS = {"busy": ("fail", busy), "fail": ("fail", fail), "wait": ("wait", wait),
             "shrink": ("shrink", shrink)}


def _replica(redis_url: str, job: str, policy: str) -> tuple[RunningService, set[str]]:
    cfg = ServiceConfig.model_validate({
        "redis_url": redis_url, "metrics_port": None,
        **service_settings(rank_failure_policy=policy, grpc={"port": 0}),
        "jobs": [{"job_id": job, "world_size": W, "seed": 1, "source": {"paths": ["arrays"]},
                  "batching": {"token_budget": 1024, "max_window_samples": 64,
                               "pool_steps": 2}}]})
    samples = synthetic_samples(N, max_len=400, seed=1)
    svc = start_service(cfg, sample_sources={job: ArraySource(samples)})
    return svc, {s.sample_id for s in samples}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[dict[str, Run]]:
    tmp: Path = tmp_path_factory.mktemp("frozen-rank")
    redis = LocalRedis().start()
    out: dict[str, Run] = {}
    try:
        for name, (policy, _) in SCENARIOS.items():
            job = f"rank-{name}"
            svc, ids = _replica(redis.url, job, policy)
            ranks = start_ranks(tmp, job, dict.fromkeys(range(W), svc.address), W, sleep=0.02,
                                next_ranks={1: 0, 2: 1} if name == "shrink" else None)
            out[name] = Run(svc, job, ids, ranks)
        for name, (_, script) in SCENARIOS.items():
            threading.Thread(target=out[name].drive, args=(script,), daemon=True).start()
        yield out
    finally:
        for run in out.values():
            run.done.wait(2 * EPOCH_S)
            kill_all(run.ranks)
            run.svc.stop(grace=0.5)
        redis.cleanup()


def test_a_busy_rank_keeps_its_lease(runs):
    """The other side of the coin: ranks busy in a long step (an eval, a checkpoint) for longer
    than lease + rank timeout are not taken for dead ones; their clients keep their leases
    from gRPC's own thread while the training loop does not read."""
    run = runs["busy"].result()
    assert not run.seen["lapsed"], f"lapsed while busy: {run.state.lapsed_ranks()}"
    assert_done(run.ranks)
    assert_exactly_once(delivered_ids(run.ranks), run.ids)


def test_fail_aborts_the_others_naming_the_frozen_rank_in_bound(runs):
    run = runs["fail"].result()
    for r in run.ranks[1:]:
        err = r.last("error")
        assert err is not None and err["error"] == "ABORTED", (
            f"rank {r.rank} was not aborted within {POLICY_BOUND_S:g}s of the freeze: "
            f"{r.records()[-1:]}")
        assert "rank 0 has been gone for" in err["details"]
        assert "rank_failure_policy=fail" in err["details"]
        # The lease lapses lease_seconds after rank 0's last sign of life (a heartbeat at most
        # heartbeat_s before the freeze), then the timeout runs.
        took = err["t"] - run.seen["frozen"]
        assert RANK_TIMEOUT_S <= took <= POLICY_BOUND_S, took


def test_wait_keeps_the_others_waiting_and_the_thawed_rank_resumes(runs):
    run = runs["wait"].result()
    assert "lapsed" in run.seen, "rank 0's lease did not lapse while it was frozen"
    assert run.seen["waiting"] == [True, True] and run.seen["error"] is None
    assert_done(run.ranks)
    assert run.ranks[0].last("done")["reconnects"] >= 1  # its stream was closed meanwhile
    assert_exactly_once(delivered_ids(run.ranks), run.ids)


def test_shrink_finishes_the_epoch_without_the_frozen_rank_exactly_once(runs):
    run = runs["shrink"].result()
    assert "reconfigured" in run.seen, "ranks 1, 2 never left the world of 3"
    frozen_rank, others = run.ranks[0], run.ranks[1:]
    assert_done(others)
    assert run.seen["thaw_ended"], f"the thawed rank 0 did not end: {frozen_rank.records()[-3:]}"
    end = frozen_rank.last("left") or frozen_rank.last("error")
    assert end is not None and not frozen_rank.last("done"), frozen_rank.records()[-3:]
    # END(reconfigure) with no rank for it in the next world, or a refusal that is no outage
    assert "left" in end or end["error"] in ("FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE"), end
    # Rank 0's batches count up to the freeze, less the one it held "in training" then (not
    # acknowledged: it comes back to the new world); what it took once thawed is trained by
    # nobody (its world is gone).
    before = [b for b in frozen_rank.batches() if b["t"] < run.seen["frozen"]][:-1]
    got = delivered_ids(others)
    got.update(i for b in before for i in b["ids"])
    assert_exactly_once(got, run.ids)
