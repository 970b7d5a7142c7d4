"""Guarantee 5 across a pipeline *server* crash: SIGKILL the server process mid-epoch, start a
new one on the same port over the same Redis; the ranks (BatchStream) reconnect by themselves
and the epoch's coverage is exact (join) / aligned with every carried sample accounted (quota)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from fault_helpers import (
    RankThread,
    ServerProc,
    assert_join_coverage,
    fault_samples,
    ids_by_epoch,
    job_dict,
    unique_steps,
)
from support.waiting import wait_for

from pipeline.coordinator import RedisJobState
from pipeline.redis_server import free_port

pytestmark = pytest.mark.slow
W, EPOCHS = 3, 2


# quota: samples that each fill the budget (unsplittable), 151 of them for 3 ranks, so the
# first epoch carries samples over into the next and the last closes with filler batches.
@pytest.mark.parametrize(("mode", "n", "full_len"), [("join", 700, 0), ("quota", 151, 512)])
def test_server_sigkill_mid_epoch_then_restart_loses_and_duplicates_nothing(
        redis_client, redis_url, mode, n, full_len):
    batching = {"token_budget": full_len} if full_len else {}
    job = job_dict("kill", W, mode=mode, epochs=EPOCHS, seed=5, batching=batching)
    port = free_port()
    server = ServerProc(redis_url, port, job, n, seed=5, full_len=full_len).wait_ready()
    ranks = [RankThread(server.address, "kill", r, W, epochs=EPOCHS, sleep=0.03).start()
             for r in range(W)]
    second = None
    try:
        wait_for(lambda: min(len(r.records) for r in ranks) >= 5, 60, "5 steps on every rank")
        server.kill()  # SIGKILL: no drain, no release, leases left in Redis
        at_kill = [len(r.records) for r in ranks]
        time.sleep(0.3)
        second = ServerProc(redis_url, port, job, n, seed=5, full_len=full_len).wait_ready()
        for r in ranks:
            r.join(90)
            r.check()
        assert all(r.stream.reconnects >= 1 for r in ranks)  # they really lost the server
    finally:
        for p in (server, second):
            if p is not None:
                p.kill()

    per_rank = [r.records for r in ranks]
    steps_e0 = max(len([s for s in unique_steps(rec).values() if s["epoch"] == 0])
                   for rec in per_rank)
    assert max(at_kill) < steps_e0, "the kill was not mid-epoch"
    all_ids = [s.sample_id for s in fault_samples(n, 5, full_len=full_len)]
    if mode == "join":
        assert_join_coverage(per_rank, all_ids, EPOCHS)
        return
    # Quota: every rank the same steps each epoch; carried samples reappear next epoch.
    for e in range(EPOCHS):
        counts = {len([s for s in unique_steps(rec).values() if s["epoch"] == e])
                  for rec in per_rank}
        assert len(counts) == 1, f"epoch {e}: ranks got different step counts {counts}"
        assert len({r.ends[e].final_step for r in ranks}) == 1
    st = RedisJobState.attach(redis_url, "kill")
    carried = [Counter(str(s.sample_id) for s in end.carried_over) for end in st.epoch_ends()]
    assert sum(sum(c.values()) for c in carried) > 0  # the carry-over path really ran
    assert not carried[-1]  # nothing is left over after the last epoch
    assert any(rec["filler"] for rec in per_rank[0] + per_rank[1] + per_rank[2])
    got = ids_by_epoch(per_rank)
    want = Counter(all_ids)
    prev = Counter()
    for e in range(EPOCHS):
        # this epoch's samples + what the previous epoch carried == delivered + carried on
        assert got[e] + carried[e] == want + prev, f"epoch {e}: samples lost or duplicated"
        assert not (prev - got[e]), f"epoch {e}: a carried sample did not reappear"
        prev = carried[e]
