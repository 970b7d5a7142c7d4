"""Leases, cursors, trimming and the failure-policy reads."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_
from pipeline.service.job_state import RankHeld

from pipeline.coordinator import AckAheadOfPlan, RedisJobState

from .helpers import make_step


def test_lease_held_refused_then_taken_after_lapse(new_state):
    st = new_state()
    lease = st.claim_rank(1, "A", 0.6)
    assert lease.client_id == "A" and lease.expires_at > time.time() - 1
    st.claim_rank(1, "A", 0.6)  # renew by the holder (e.g. a restarted server, same client)
    with pytest.raises(RankHeld, match="'A'"):
        st.claim_rank(1, "B", 5)
    # A heartbeat of a client that does not hold the rank changes nothing (MemoryJobState too).
    assert st.heartbeat(1, "B", 5) is False
    assert st.lease(1).client_id == "A"
    assert st.lapsed_ranks() == []
    time.sleep(0.7)
    assert st.lapsed_ranks() == [1]
    assert list(st.timed_out_ranks(0.05)) == [1] and st.timed_out_ranks(30) == {}
    h = st.rank_health()[1]
    assert h.client_id == "A" and h.lapsed and h.lapsed_for >= 0.05 and h.heartbeat_age >= 0.6
    assert st.lease(1).expires_at < time.time()
    assert st.claim_rank(1, "B", 5).client_id == "B"  # allowed after the lapse
    # Still reported (the lapse happened), but no longer timed out: B holds it live.
    assert st.lapsed_ranks() == [1] and st.timed_out_ranks(0) == {}
    assert st.counters()["lease_lapses"] == 1
    with pytest.raises(RankHeld, match="'B'"):
        st.ack_heartbeat(1, "A", -1, 5)  # the old client comes back: refused
    assert st.heartbeat(1, "A", 5) is False and st.heartbeat(1, "B", 5) is True


def test_release_only_by_holder_and_not_reported_as_lapsed(new_state):
    st = new_state()
    st.claim_rank(0, "A", 0.1)
    st.release_rank(0, "B")  # not the holder: ignored
    with pytest.raises(RankHeld):
        st.claim_rank(0, "B", 1)
    st.release_rank(0, "A")
    assert st.lease(0) is None
    time.sleep(0.15)
    assert st.lapsed_ranks() == []
    assert st.claim_rank(0, "B", 1).client_id == "B"
    assert st.rank_health()[0].client_id == "B"


def test_rank_bounds_and_ack_ahead(new_state):
    st = new_state(world_size=2)
    with pytest.raises(ValueError):
        st.claim_rank(2, "x", 1)
    with pytest.raises(ValueError):
        st.ack(-1 + 3, 0)
    with pytest.raises(AckAheadOfPlan):
        st.ack(0, 0)  # nothing published
    st.publish_step(make_step(0, world_size=2))
    st.ack(0, 0)
    assert st.acked(0) == 0 and st.acked(1) == -1


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=st_.lists(st_.tuples(st_.integers(0, 2), st_.integers(-1, 19)), max_size=60),
       history=st_.integers(0, 4))
def test_cursors_monotonic_and_trim_never_drops_unacked(new_state, seq, history):
    """Random acks (incl. going backwards): cursor = running max; trimmed steps were acked by
    every rank and are older than the retained history; everything else is still readable."""
    st = new_state(world_size=3, history_steps=history)
    st.publish_steps([make_step(n, world_size=3) for n in range(20)])
    best = [-1, -1, -1]
    for rank, step in seq:
        st.ack_heartbeat(rank, f"c{rank}", step, 30) if step >= 0 else st.ack(rank, step)
        best[rank] = max(best[rank], step)
        assert [st.acked(r) for r in range(3)] == best
        tt = st.trimmed_through()
        assert tt == max(-1, min(best) - history)
        assert st.get_step(tt + 1) is not None or tt == 19
        if tt >= 0:
            assert st.get_step(tt) is None
    assert st.min_acked() == min(best) and st.acked_all() == best
    # The trimmed steps are gone from Redis, the rest are there.
    tt = st.trimmed_through()
    assert st.trimmed_through() == max(-1, min(best) - history)
    assert all(st.get_step(n) is None for n in range(tt + 1))
    assert all(st.get_step(n) is not None for n in range(tt + 1, 20))


def test_trim_keeps_history_bounded_over_a_long_run(new_state):
    st = new_state(world_size=2, history_steps=5)
    for n in range(200):
        st.publish_step(make_step(n, world_size=2))
        st.ack_heartbeat(0, "a", n, 30)
        if n % 3 == 0:
            st.ack_heartbeat(1, "b", n, 30)
    assert st.trimmed_through() == 198 - 5
    live = [k for k in st.client.scan_iter(match=st.keys.base + "step:*")]
    assert len(live) == 200 - 194  # retained: history 5 + the unacked step 199
    # A trimmed step can still be republished identically, never differently (digest kept).
    st.publish_step(make_step(3, world_size=2))
    with pytest.raises(Exception, match="different content"):
        st.publish_step(make_step(3, world_size=2, salt="q"))


def test_ack_heartbeat_many_one_round_trip_and_script_reload(new_state, redis_client):
    st = new_state(world_size=8)
    st.publish_steps([make_step(n, world_size=8) for n in range(3)])
    redis_client.script_flush()  # as after a Redis restart: NOSCRIPT must reload
    st.ack_heartbeat_many([(r, f"c{r}", r % 3) for r in range(8)], 30)
    assert [st.acked(r) for r in range(8)] == [r % 3 for r in range(8)]
    assert all(h.client_id == f"c{h.rank}" for h in st.rank_health())
    with pytest.raises(RankHeld):
        st.ack_heartbeat_many([(0, "c0", 1), (1, "intruder", 2)], 30)
    assert st.acked(0) == 1 and st.acked(1) == 1  # the valid one still applied


def test_restarted_server_sees_acks_and_reclaims(new_state, redis_url):
    st = new_state(world_size=2, job_id="restart")
    st.publish_steps([make_step(n, world_size=2) for n in range(4)])
    st.ack_heartbeat(0, "srv1:r0", 2, 1.0)
    st.ack_heartbeat(1, "srv1:r1", 1, 30)
    st.close()
    st2 = RedisJobState(redis_url, "restart", config_hash="cfg-1", world_size=2)
    assert not st2.created
    assert (st2.published_through(), st2.acked(0), st2.acked(1)) == (3, 2, 1)
    st2.claim_rank(1, "srv1:r1", 30)  # same client id: immediate
    with pytest.raises(RankHeld):
        st2.claim_rank(0, "srv2:r0", 30)
    time.sleep(1.05)
    st2.claim_rank(0, "srv2:r0", 30)  # after the lapse
    assert st2.get_step(st2.acked(0) + 1) == make_step(3, world_size=2)


def test_random_interleaving_of_many_clients(new_state):
    """Clients contend for 4 ranks with short leases; at no time do two hold one rank live."""
    st = new_state(world_size=4)
    rng = random.Random(7)
    holder: dict[int, tuple[str, float]] = {}
    for _ in range(300):
        r, c = rng.randrange(4), f"c{rng.randrange(3)}"
        now = time.time()
        try:
            st.claim_rank(r, c, 0.02)
        except RankHeld:
            h = holder.get(r)
            assert h is not None and h[0] != c
            continue
        h = holder.get(r)
        # Granted: no other client held a lease that was surely still live.
        assert h is None or h[0] == c or h[1] < time.time() + 0.005
        holder[r] = (c, now + 0.02)
