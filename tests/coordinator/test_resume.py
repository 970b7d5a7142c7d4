"""What Redis keeps when a process forgets: scripts reloaded after NOSCRIPT (Redis restarted or
SCRIPT FLUSH), and a new process attaching to a running job finds cursors and leases."""

from __future__ import annotations

import time

import pytest
from jobstate.builders import make_step, publication, steps

from pipeline.coordinator import RedisJobState
from pipeline.errors import Fenced, RankHeld
from pipeline.jobstate import RankAck


def test_every_call_reloads_its_script_after_noscript(new_state, redis_client):
    st = new_state(world_size=4)
    calls = [
        lambda: st.claim_producer("p", 60),
        lambda: st.renew_producer(1, 60),
        lambda: st.publish(publication(steps(0, 1)), fence=1),
        lambda: st.set_error("x", fence=1),
        lambda: st.claim_rank(0, "c0", 60),
        lambda: st.heartbeat(1, "c1", 60),
        lambda: st.ack(0, 1),
        lambda: st.grant([(0, r, 1) for r in range(4)]),
        lambda: st.ack_many([RankAck(r, f"c{r}", r % 2) for r in range(4)], 60),
        lambda: st.release_rank(1, "c1"),
        st.lapsed_ranks,
        lambda: st.timed_out_ranks(1),
        st.rank_health,
        lambda: st.release_producer(1),
    ]
    for call in calls:
        redis_client.script_flush()  # as after a Redis restart: the scripts are gone
        call()
    assert st.published_through() == 1 and st.error() == "x"
    assert st.acked_all() == [1, 1, 0, 1]
    assert [h.client_id for h in st.rank_health()] == ["c0", None, "c2", "c3"]
    assert st.producer_lease().expires_at == 0  # released


def test_a_new_process_resumes_cursors_and_leases(new_state, redis_url):
    st = new_state(world_size=2, job_id="restart")
    gen = st.claim_producer("actor", 60)
    st.publish(publication(steps(0, 3, 2)), fence=gen)
    st.claim_rank(0, "srv1:r0", 0.3)
    st.ack(0, 2)
    st.claim_rank(1, "srv1:r1", 30)
    st.ack(1, 1)
    st.close()
    st2 = RedisJobState(redis_url, "restart", config_hash="cfg-1", world_size=2)
    assert not st2.created
    assert (st2.published_through(), st2.acked_all()) == (3, [2, 1])
    st2.claim_rank(1, "srv1:r1", 30)  # the same client id: at once
    with pytest.raises(RankHeld):
        st2.claim_rank(0, "srv2:r0", 30)
    time.sleep(0.35)
    st2.claim_rank(0, "srv2:r0", 30)  # after the lapse
    assert st2.lapsed_ranks() == [0] and st2.counters().lease_lapses == 1
    assert st2.get_step(st2.acked(0) + 1) == make_step(3, 2)
    # The producer lease survived too: its holder's generation still publishes, others wait.
    assert st2.claim_producer("other", 60) is None
    assert st2.publish(publication(steps(4, 4, 2)), fence=gen) == 1
    assert st2.claim_producer("actor", 60) == gen + 1  # a restarted actor takes over at once
    with pytest.raises(Fenced):
        st2.publish(publication(steps(5, 5, 2)), fence=gen)
