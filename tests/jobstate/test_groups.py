"""The model-parallel group part of the `JobState` contract (`interface.Member`) on every
implementation: the group's one lease, its acks counted once, a lost or absent member as a lost
rank, seats held, released and taken over, group sizes that disagree, a group draining an ended
world. Each test tries to break one promise; a refusal must change nothing."""

from __future__ import annotations

import pytest

from pipeline.errors import (
    AckAheadOfPlan,
    AckNotDelivered,
    GroupRefused,
    RankHeld,
    ScaleInProgress,
)
from pipeline.jobstate import RankAck, ScaleRequest
from pipeline.jobstate.interface import Member, group_holder

from .builders import publication, steps
from .conftest import LAPSE, LONG, SHORT, Env

M0, M1 = Member(0, 2), Member(1, 2)


def _seen(env: Env) -> dict:
    """What a refused member call must leave as it was."""
    st = env.state
    return {"health": [(h.client_id, h.lease_expires_at, h.acked) for h in st.rank_health()],
            "groups": [(g.rank, g.group_size, [(m.client_id, m.lease_expires_at, m.acked)
                                               for m in g.members]) for g in st.group_health()],
            "counters": st.counters(), "lapsed": st.lapsed_ranks()}


def _published(env: Env, through: int = 4) -> None:
    gen = env.producer()
    env.state.publish(publication(steps(0, through)), fence=gen)
    env.state.grant([(0, r, through) for r in range(env.state.world_size)])


def test_the_members_of_a_rank_hold_its_one_lease(env: Env):
    st = env.state
    a = st.claim_rank(1, "A", LONG, member=M0)
    b = st.claim_rank(1, "B", SHORT, member=M1)
    assert (a.client_id, b.client_id) == ("A", "B")
    h = st.rank_health()[1]
    assert h.client_id == group_holder(2) and not h.lapsed
    # The group's lease expires with its first seat.
    assert h.lease_expires_at == pytest.approx(b.expires_at)
    (g,) = st.group_health()
    assert (g.rank, g.group_size) == (1, 2)
    assert [(m.index, m.client_id) for m in g.members] == [(0, "A"), (1, "B")]
    assert all(m.acked == -1 and not m.released for m in g.members)
    assert st.claim_rank(1, "A", LONG, member=M0).client_id == "A"  # a member renews its own seat
    assert st.heartbeat(1, "B", LONG, member=M1) is True
    assert st.rank_health()[1].lease_expires_at > b.expires_at  # renewed with its first seat


def test_acks_count_once_the_rank_moves_with_its_slowest_member(env: Env):
    """The rank's cursor (what releases payloads and where a member resuming alone starts) is
    the lowest of its seats; a seat nobody took holds it where the group began."""
    _published(env)
    st = env.state
    st.ack(2, 0)  # the rank's cursor before its group formed
    st.claim_rank(2, "A", LONG, member=Member(0, 3))
    st.claim_rank(2, "B", LONG, member=Member(1, 3))
    assert st.ack_many([RankAck(2, "A", 3, member=Member(0, 3))], LONG) == [None]
    assert st.acked(2) == 0  # B and the empty seat 2 are at the group's start
    assert st.ack_many([RankAck(2, "B", 2, member=Member(1, 3))], LONG) == [None]
    assert st.acked(2) == 0  # seat 2, never taken, holds it
    st.claim_rank(2, "C", LONG, member=Member(2, 3))
    assert st.ack_many([RankAck(2, "C", 4, member=Member(2, 3))], LONG) == [None]
    assert st.acked(2) == 2  # now B is the slowest
    assert st.ack_many([RankAck(2, "B", 1, member=Member(1, 3))], LONG) == [None]
    assert st.acked(2) == 2  # a member's ack never goes back
    st.ack_many([RankAck(2, "B", 4, member=Member(1, 3))], LONG)
    assert st.acked(2) == 3 and st.acked_all() == [-1, -1, 3, -1]
    assert [m.acked for m in st.group_health()[0].members] == [3, 4, 4]


def test_a_members_ack_is_checked_like_a_ranks(env: Env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 2)), fence=gen)
    st.grant([(0, 0, 1)])
    st.claim_rank(0, "A", LONG, member=M0)
    seen = _seen(env)
    out = st.ack_many([RankAck(0, "A", 3, member=M0), RankAck(0, "A", 2, member=M0)], LONG)
    assert isinstance(out[0], AckAheadOfPlan) and isinstance(out[1], AckNotDelivered)
    assert _seen(env) == seen
    assert st.ack_many([RankAck(0, "B", 1, member=M1), RankAck(0, "A", 1, member=M0)],
                       LONG) == [None, None]
    assert st.acked(0) == 1


def test_a_lost_member_is_a_lost_rank_until_a_client_takes_its_seat(env: Env):
    _published(env)
    st = env.state
    st.claim_rank(0, "A", SHORT, member=M0)
    st.claim_rank(0, "B", SHORT, member=M1)
    st.ack_many([RankAck(0, "A", 2, member=M0), RankAck(0, "B", 1, member=M1)], SHORT)
    env.sleep(LAPSE)
    st.heartbeat(0, "A", LONG, member=M0)  # A lives on; B went silent
    assert st.lapsed_ranks() == [0] and st.rank_health()[0].lapsed
    assert list(st.timed_out_ranks(0)) == [0, 1, 2, 3]  # 1-3 never claimed
    seats = st.group_health()[0].members
    assert seats[0].lapsed_for == 0.0 and seats[1].lapsed_for > 0.0
    with pytest.raises(RankHeld, match="member 0 of rank 0's group is held by client 'A'"):
        st.claim_rank(0, "C", LONG, member=M0)  # a live seat is never taken
    assert st.counters().lease_lapses == 0
    st.claim_rank(0, "C", LONG, member=M1)  # the lost member's seat: taken over, a lapse
    assert st.counters().lease_lapses == 1 and not st.rank_health()[0].lapsed
    assert st.acked(0) == 1  # the group's position: where the lost member left it
    g = st.group_health()[0]
    assert [(m.client_id, m.acked) for m in g.members] == [("A", 2), ("C", 1)]
    assert st.heartbeat(0, "B", LONG, member=M1) is False  # B came back late: its seat is C's
    with pytest.raises(RankHeld):
        st.claim_rank(0, "B", LONG, member=M1)


def test_a_member_that_never_connects_lapses_its_rank_a_lease_after_the_group_formed(env: Env):
    st = env.state
    st.claim_rank(3, "A", SHORT, member=M0)
    st.heartbeat(3, "A", LONG, member=M0)
    assert not st.rank_health()[3].lapsed
    env.sleep(LAPSE)
    st.heartbeat(3, "A", LONG, member=M0)
    assert st.rank_health()[3].lapsed and 3 in st.timed_out_ranks(0)
    st.claim_rank(3, "B", LONG, member=M1)  # it arrives: nothing was taken over
    assert not st.rank_health()[3].lapsed and st.counters().lease_lapses == 0


def test_clients_disagreeing_on_a_ranks_group_size_are_refused_naming_both(env: Env):
    st = env.state
    st.claim_rank(0, "A", SHORT, member=M0)
    st.claim_rank(1, "solo", SHORT)
    seen = _seen(env)
    with pytest.raises(GroupRefused, match=r"group of 2, member 0 \(client 'A'\); client 'X' "
                                           r"opened it with group_size 4"):
        st.claim_rank(0, "X", LONG, member=Member(3, 4))
    with pytest.raises(GroupRefused, match=r"group of 2.*client 'Y' opened it with group_size 1"):
        st.claim_rank(0, "Y", LONG)
    (plain,) = st.ack_many([RankAck(0, "Y")], LONG)
    assert isinstance(plain, GroupRefused)
    with pytest.raises(GroupRefused, match=r"alone \(group_size 1\), client 'solo'; client 'Z' "
                                           r"opened it with group_size 2"):
        st.claim_rank(1, "Z", LONG, member=M1)
    assert _seen(env) == seen
    env.sleep(LAPSE)  # every seat lapsed: a group of another size may form (a lapse each)
    st.claim_rank(0, "X", LONG, member=Member(3, 4))
    st.claim_rank(1, "Z", SHORT, member=M1)
    assert st.counters().lease_lapses == 2
    assert [(g.rank, g.group_size) for g in st.group_health()] == [(0, 4), (1, 2)]
    assert st.rank_health()[0].client_id == group_holder(4)
    env.sleep(LAPSE)  # the same for a client alone after a group
    st.claim_rank(1, "solo", LONG)
    assert st.rank_health()[1].client_id == "solo" and [g.rank for g in st.group_health()] == [0]


def test_members_release_their_seats_and_the_last_ends_the_group(env: Env):
    _published(env)
    st = env.state
    st.claim_rank(0, "A", LONG, member=M0)
    st.claim_rank(0, "B", SHORT, member=M1)
    st.ack_many([RankAck(0, "A", 3, member=M0), RankAck(0, "B", 3, member=M1, renew=False)],
                LONG)
    st.release_rank(0, "not-the-holder", member=M0)
    st.release_rank(0, "A", member=Member(0, 3))  # not its group's size: nothing
    st.release_rank(0, "A", member=M0)
    g = st.group_health()[0]
    assert g.members[0].released and g.members[0].client_id is None
    # The group's lease now follows B alone; a release is no lapse.
    assert st.rank_health()[0].lease_expires_at == pytest.approx(g.members[1].lease_expires_at)
    env.sleep(LAPSE)
    assert st.rank_health()[0].lapsed  # B, still a member, lapsed
    st.heartbeat(0, "B", LONG, member=M1)
    st.claim_rank(0, "A", LONG, member=M0)  # a released seat is taken back without a lapse
    st.release_rank(0, "A", member=M0)
    st.release_rank(0, "B", member=M1)
    h = st.rank_health()[0]
    assert (h.client_id, h.lease_expires_at, h.lapsed) == (None, None, False)
    assert st.group_health() == [] and st.counters().lease_lapses == 0
    assert st.acked(0) == 3
    st.claim_rank(0, "Z", LONG)  # the rank is free for anyone, alone or in a group


def test_a_group_draining_an_ended_world_is_waited_for_whatever_the_new_size(env: Env):
    """A reconfiguration keeps a live group's lease for its drain: a client of the new world
    that opens the rank is told to wait (RankHeld, retried), never refused for its group size;
    the rank stops draining when its last member left."""
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 5)), fence=gen)
    for r in range(4):
        st.claim_rank(r, f"a{r}", LONG, member=M0)
        st.claim_rank(r, f"b{r}", LONG, member=M1)
    st.scale(ScaleRequest(2))
    st.publish(publication(world=1, rows=7, next_step=6), fence=gen)
    for call in (lambda: st.claim_rank(0, "new", LONG),
                 lambda: st.claim_rank(0, "new", LONG, member=Member(0, 4))):
        with pytest.raises(RankHeld):
            call()
    assert st.heartbeat(3, "b3", LONG, member=M1)  # a draining rank beyond the new world beats on
    for r in (0, 1, 2, 3):
        st.rank_left(0, r, f"a{r}", member=M0)
    with pytest.raises(RankHeld):
        st.claim_rank(0, "new", LONG)  # b0 still drains
    for r in (0, 1, 2):
        st.rank_left(0, r, f"b{r}", member=M1)
    with pytest.raises(ScaleInProgress, match=r"\[3\]"):
        st.scale(ScaleRequest(3))  # rank 3's member b3 still drains
    st.rank_left(0, 3, "b3", member=M1)
    assert set(st.world_timings(1).left_at) == {0, 1, 2, 3}
    st.claim_rank(0, "new", LONG, member=Member(0, 4))
    assert st.scale(ScaleRequest(3)).changed


def test_a_member_seat_is_checked(make_env):
    env = make_env(world_size=2)
    st = env.state
    for bad in (lambda: Member(2, 2), lambda: Member(-1, 2), lambda: Member(0, 0),
                lambda: Member(0, 1025)):
        with pytest.raises(ValueError, match="group_"):
            bad()
    with pytest.raises(ValueError):
        st.claim_rank(2, "x", LONG, member=M0)
    with pytest.raises(ValueError):
        st.claim_rank(0, "", LONG, member=M0)
    # A group of one is the rank's own lease.
    st.claim_rank(1, "solo", LONG, member=Member(0, 1))
    assert st.rank_health()[1].client_id == "solo" and st.group_health() == []


def test_a_group_ends_once_no_seat_is_held(env: Env):
    """Its only member released (END) before its peer ever came: the group ends, and the seat
    nobody took never lapses the rank."""
    st = env.state
    st.claim_rank(2, "A", SHORT, member=M0)
    st.release_rank(2, "A", member=M0)
    env.sleep(LAPSE)
    h = st.rank_health()[2]
    assert (h.client_id, h.lapsed) == (None, False) and st.group_health() == []
    assert 2 not in st.lapsed_ranks() and st.counters().lease_lapses == 0


def test_a_seats_claims_are_counted_and_an_older_claim_releases_nothing(env: Env):
    """As a rank's: a replica releases a vanished member's seat only by that member's latest
    claim of it (a member that claimed its seat again elsewhere is alive)."""
    st = env.state
    first = st.claim_rank(1, "A", LONG, member=M0).claim
    assert st.claim_rank(1, "B", LONG, member=M1).claim == 1  # counted per seat
    again = st.claim_rank(1, "A", LONG, member=M0).claim  # A reconnected (another replica)
    assert again == first + 1
    st.release_rank(1, "A", first, member=M0)  # the older claim: A is alive, nothing changes
    assert st.group_health()[0].members[0].client_id == "A"
    st.release_rank(1, "A", again, member=M0)
    assert st.group_health()[0].members[0].released
