"""Guarantee 4 for model-parallel groups: W=2 data-parallel ranks x 2 members, member 1 of
rank 0 a process of its own. Killed (SIGKILL) or frozen (SIGSTOP), its seat's lease lapses and
with it its group's: under `fail` every other stream, its own group's peer included, ends
ABORTED naming rank 0 within lease + rank timeout. Under `wait` the others wait, and the member
restarted alone (without a state) gets its group's position: every member of a rank receives
the same batches at every step, and every sample arrives once across the DP ranks."""

from __future__ import annotations

import signal
import time

import pytest
from fault_helpers import (
    RankThread,
    assert_aborted_for,
    assert_join_coverage,
    job_dict,
    rank_proc,
    read_log,
    unique_steps,
)
from support.waiting import wait_for

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import start_service

# Asserts time bounds: these modules run on one xdist worker, one test at a time (docs/ci.md).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("time-bounds")]
W, K, N, LEASE, TIMEOUT = 2, 2, 600, 2.0, 2.0
GROUP = {"group_size": K}


def serve(redis_url: str, policy: str):
    cfg = ServiceConfig.model_validate({
        "redis_url": redis_url, "lease_seconds": LEASE, "rank_timeout_seconds": TIMEOUT,
        "rank_failure_policy": policy, "metrics_port": None,
        "grpc": {"port": 0, "keepalive_time_s": 1.0, "keepalive_timeout_s": 1.0,
                 "min_client_ping_interval_s": 0.5},
        "jobs": [job_dict("group", W, seed=1, batching={"token_budget": 1024,
                                                        "pad_to_multiple": 8})]})
    samples = synthetic_samples(N, max_len=400, seed=1)
    return start_service(cfg, sample_sources={"group": ArraySource(samples)}), samples


def start_group(svc, tmp_path, state_name: str = "member.state.json"):
    """Member 1 of rank 0 as a process; once it holds its seat, the other three members as
    threads; returns when the process took 3 steps."""
    log = tmp_path / "member.jsonl"
    proc = rank_proc(svc.address, "group", 0, W, log, tmp_path / state_name, sleep=0.1,
                     group_size=K, group_rank=1)
    job_state = svc.runtimes["group"].state
    try:
        wait_for(lambda: any(m.client_id for g in job_state.group_health() if g.rank == 0
                             for m in g.members if m.index == 1), 60, "member 1's seat")
        others = {(r, j): RankThread(svc.address, "group", r, W, sleep=0.01, group_rank=j,
                                     keepalive_time_s=1.0, keepalive_timeout_s=1.0,
                                     **GROUP).start()
                  for r in range(W) for j in range(K) if (r, j) != (0, 1)}
        wait_for(lambda: len([x for x in read_log(log) if "step" in x]) >= 3, 60,
                 "member 1 to take 3 steps")
    except AssertionError:
        proc.kill()
        raise AssertionError(f"member 1: {read_log(log)[-1:]}") from None
    return proc, others, log


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_member_fires_fail_for_its_rank_within_the_bound(redis_client, redis_url,
                                                                  tmp_path, how):
    svc, _ = serve(redis_url, "fail")
    proc = None
    try:
        proc, others, _ = start_group(svc, tmp_path)
        proc.send_signal(how)
        lost_at = time.monotonic()
        # Every other stream, member 0 of rank 0 included: not before the seat's lease lapsed
        # and the timeout ran, and within the bound (+ the checks' polling on a loaded machine).
        assert_aborted_for(others.values(), 0, lost_at, TIMEOUT, LEASE + TIMEOUT + 5.0)
        (g,) = [g for g in svc.runtimes["group"].state.group_health() if g.rank == 0]
        assert g.members[1].lapsed_for > 0 and g.members[1].client_id is not None
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        svc.stop(grace=0.5)


def test_a_member_restarted_alone_gets_its_groups_position(redis_client, redis_url, tmp_path):
    """`wait`: member 1 of rank 0 is killed and restarted without a state: it opens at the
    group's position (its slowest member's next step, here its own), its peer never passes the
    producer's back-pressure meanwhile, and in the end each rank's members got byte-identical
    batches at every step, every sample once across the ranks."""
    svc, samples = serve(redis_url, "wait")
    try:
        proc, others, log = start_group(svc, tmp_path)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = [x for x in read_log(log) if "step" in x]
        position = svc.runtimes["group"].state.acked(0) + 1
        again = rank_proc(svc.address, "group", 0, W, log, tmp_path / "fresh.state.json",
                          sleep=0.0, group_size=K, group_rank=1)
        out, _ = again.communicate(timeout=90)
        assert again.returncode == 0, out.decode()[-2000:]
        for t in others.values():
            t.join(90)
            t.check()
    finally:
        svc.stop(grace=0.5)
    recs = [x for x in read_log(log) if "step" in x]
    resumed = recs[len(killed):]
    assert resumed[0]["step"] == position <= killed[-1]["step"] + 1, "the group's position"
    assert read_log(log)[-1] == {"done": True}
    member1 = unique_steps(recs, max_redelivered=1)  # at most the batch in progress, again
    for r in range(W):
        mine = [others[(r, j)].records for j in range(K) if (r, j) in others]
        steps = [unique_steps(m) for m in mine] + ([member1] if r == 0 else [])
        assert all(s.keys() == steps[0].keys() for s in steps), f"rank {r}: the same steps"
        for n, first in steps[0].items():
            assert all(s[n]["digest"] == first["digest"] for s in steps), (r, n)
    assert_join_coverage([others[(0, 0)].records, others[(1, 0)].records],
                         [s.sample_id for s in samples], 1)
