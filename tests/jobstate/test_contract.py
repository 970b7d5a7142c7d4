"""The `JobState` contract (pipeline/jobstate/interface.py), method by method, on every
implementation: `MemoryJobState` and `RedisJobState` (conftest.py). Each test tries to break one
promise of a docstring; a refusal must leave everything as it was."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from pipeline.errors import (
    AckAheadOfPlan,
    AckNotDelivered,
    CheckpointConflict,
    Fenced,
    RankHeld,
    StateError,
    StepConflict,
    StepGap,
)
from pipeline.jobstate import JobCounters, PlannerCheckpoint, QuarantineEntry, RankAck
from pipeline.planner.types import Batch, Step, StepInfo

from .builders import make_end, make_step, publication, steps
from .conftest import LAPSE, LONG, SHORT, Env


def snapshot(env: Env) -> dict:
    """Everything a publication may change, read back through the interface."""
    st = env.state
    through = st.published_through()
    lease = st.producer_lease()
    return {
        "through": through,
        "steps": [st.get_step(n) for n in range(through + 3)],
        "ends": st.epoch_ends(),
        "done": st.is_done(),
        "checkpoint": st.load_checkpoint(),
        "counters": st.counters(),
        "quarantine": st.quarantine(),
        "error": st.error(),
        "producer": (lease.generation, lease.holder) if lease else None,
    }


Q_A = QuarantineEntry("rows:7", "parse", "line 7: unterminated string")
Q_B = QuarantineEntry("rows:9", "decode", "image 9: truncated PNG")


def test_job_identity_is_fixed_at_registration(make_env):
    env = make_env(world_size=3, mode="quota")
    assert (env.state.world_size, env.state.mode) == (3, "quota")
    assert env.state.job_id.startswith("contract")


# --------------------------------------------------------------------------- the plan
def test_fresh_state_is_empty(env):
    st = env.state
    assert st.published_through() == -1 and st.get_step(0) is None
    assert st.get_step_for(0, [0]) is None
    assert st.epoch_ends() == [] and not st.is_done() and st.load_checkpoint() is None
    assert st.counters() == JobCounters()
    assert st.quarantine() == [] and st.error() is None and st.producer_lease() is None
    assert st.acked_all() == [-1] * 4 and st.trimmed_through() == -1


def test_publish_then_read_back(env):
    st, gen = env.state, env.producer()
    s = steps(0, 2)
    assert st.publish(publication(s, state=b'{"window":[1]}'), fence=gen) == 3
    assert st.published_through() == 2
    assert [st.get_step(n) for n in range(3)] == list(s)
    assert st.get_step(3) is None
    assert st.load_checkpoint() == PlannerCheckpoint(0, 3, 3, b'{"window":[1]}')


def test_identical_republish_is_a_noop_that_counts_nothing(env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 1)), fence=gen)
    planned = st.counters()
    # Published again (a restarted producer replaying), inside a later publication.
    assert st.publish(publication(steps(0, 2), rows=9), fence=gen) == 1
    assert st.publish(publication(steps(1, 2), rows=10), fence=gen) == 0
    c = st.counters()
    s2 = make_step(2)
    assert c.samples_planned == planned.samples_planned + s2.info.step_samples
    assert c.tokens_planned == planned.tokens_planned + s2.info.step_tokens
    assert st.published_through() == 2


def _other_info(s: Step) -> Step:
    return dataclasses.replace(s, info=StepInfo(s.info.step_samples + 1, s.info.step_tokens))


def _swapped_ranks(s: Step) -> Step:
    b0, b1 = s.batches[0], s.batches[1]
    return dataclasses.replace(s, batches=(Batch(b0.rank, b1.samples, b1.cost),
                                           Batch(b1.rank, b0.samples, b0.cost), *s.batches[2:]))


CHANGES = {
    "other samples": lambda s: make_step(s.step, salt="other"),
    "other info only": _other_info,
    "a rank left out": lambda s: make_step(s.step, ranks=[0, 1, 2]),
    "two ranks' batches swapped": _swapped_ranks,
    "other epoch": lambda s: make_step(s.step, epoch=1),
    "flagged over budget": lambda s: dataclasses.replace(
        s, batches=(dataclasses.replace(s.batches[0], over_budget=True), *s.batches[1:])),
}


@pytest.mark.parametrize("change", CHANGES)
def test_different_content_for_a_published_step_conflicts(env, change):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 1)), fence=gen)
    other = CHANGES[change](make_step(1))
    assert other != make_step(1)
    with pytest.raises(StepConflict, match="1"):
        st.publish(publication([other]), fence=gen)
    assert st.get_step(1) == make_step(1)


def test_one_step_twice_with_different_content_in_one_publication_conflicts(env):
    st, gen = env.state, env.producer()
    with pytest.raises(StepConflict):
        st.publish(publication([make_step(0), make_step(0, salt="x")]), fence=gen)
    assert st.published_through() == -1 and st.get_step(0) is None


def test_steps_must_continue_the_plan_contiguously(env):
    st, gen = env.state, env.producer()
    with pytest.raises(StepGap, match="1"):
        st.publish(publication([make_step(1)]), fence=gen)
    st.publish(publication([make_step(0)]), fence=gen)
    with pytest.raises(StepGap, match="2"):
        st.publish(publication([make_step(2)]), fence=gen)
    with pytest.raises(StepGap):  # out of order inside one publication
        st.publish(publication([make_step(2), make_step(1)], next_step=3), fence=gen)
    assert st.published_through() == 0 and st.get_step(1) is None and st.get_step(2) is None


def test_checkpoint_rules(env):
    st, gen = env.state, env.producer()
    with pytest.raises(CheckpointConflict):  # claims step 0, which is not published
        st.publish(publication(next_step=1, rows=5), fence=gen)
    st.publish(publication(steps(0, 1), rows=8, state=b"s1"), fence=gen)
    assert st.load_checkpoint() == PlannerCheckpoint(0, 8, 2, b"s1")
    with pytest.raises(CheckpointConflict):  # the input position goes backwards
        st.publish(publication(rows=4, next_step=2), fence=gen)
    with pytest.raises(CheckpointConflict):  # next_step goes backwards
        st.publish(publication(rows=9, next_step=1), fence=gen)
    with pytest.raises(CheckpointConflict):  # next_step beyond what is published
        st.publish(publication(rows=9, next_step=3), fence=gen)
    assert st.load_checkpoint() == PlannerCheckpoint(0, 8, 2, b"s1")
    # A new epoch at row 0 is later than any row of the previous one; a checkpoint may also
    # stay behind the published steps (they came from the same planner state).
    st.publish(publication(epoch=1, rows=0, next_step=2, state=b"s2"), fence=gen)
    st.publish(publication(steps(2, 3, epoch=1), epoch=1, rows=3, next_step=3), fence=gen)
    assert st.load_checkpoint() == PlannerCheckpoint(1, 3, 3)
    assert st.published_through() == 3


def _published(env: Env) -> int:
    gen = env.producer()
    env.state.publish(publication(steps(0, 1), rows=10, samples_in=10, quarantined=(Q_A,),
                                  ends=(make_end(0, (1, 1, 1, 1), 2),)), fence=gen)
    return gen


def _done(env: Env) -> int:
    gen = _published(env)
    env.state.publish(publication(epoch=1, rows=0, next_step=2, done=True), fence=gen)
    return gen


# Each refusal: (how to reach the state before it, the refused publication, the error).
REFUSALS = {
    "conflicting step": (_published, lambda: publication(
        [make_step(2), make_step(1, salt="y"), make_step(3)], rows=20), StepConflict),
    "gap": (_published, lambda: publication([make_step(3)], rows=20), StepGap),
    "conflicting END": (_published, lambda: publication(
        [make_step(2)], rows=20, ends=(make_end(0, (1, 1, 1, 0), 2),)), StepConflict),
    "position backwards": (_published, lambda: publication([make_step(2)], rows=5),
                           CheckpointConflict),
    "next_step backwards": (_published, lambda: publication(rows=20, next_step=1),
                            CheckpointConflict),
    "next_step unpublished": (_published, lambda: publication([make_step(2)], rows=20,
                                                              next_step=4),
                              CheckpointConflict),
    "new step after done": (_done, lambda: publication([make_step(2, epoch=1)], epoch=1,
                                                       rows=3), StepConflict),
}


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_refused_publication_writes_nothing(env, refusal):
    setup, make_pub, error = REFUSALS[refusal]
    gen = setup(env)
    before = snapshot(env)
    pub = dataclasses.replace(make_pub(), samples_in=5, quarantined=(Q_B,),
                              ends=make_pub().ends or (make_end(1, (2, 2, 2, 2), 1),))
    with pytest.raises(error):
        env.state.publish(pub, fence=gen)
    assert snapshot(env) == before


FENCES = {
    "no producer ever": lambda env: 1,
    "older generation": lambda env: _replaced(env),
    "released": lambda env: _released(env),
    "expired": lambda env: _expired(env),
}


def _replaced(env: Env) -> int:
    old = env.state.claim_producer("a", LONG)
    env.state.claim_producer("a", LONG)
    return old


def _released(env: Env) -> int:
    gen = env.producer()
    env.state.release_producer(gen)
    return gen


def _expired(env: Env) -> int:
    gen = env.producer(lease_seconds=SHORT)
    env.sleep(LAPSE)
    return gen


@pytest.mark.parametrize("fence", FENCES)
def test_a_fenced_publication_writes_nothing(env, fence):
    gen = FENCES[fence](env)
    before = snapshot(env)
    with pytest.raises(Fenced):
        env.state.publish(publication(steps(0, 1), rows=5, samples_in=5, quarantined=(Q_A,),
                                      ends=(make_end(0, (1, 1, 1, 1), 2),), done=True),
                          fence=gen)
    assert snapshot(env) == before


def test_retry_at_the_same_position_does_not_count_twice(env):
    st, gen = env.state, env.producer()
    pub = publication(steps(0, 1), rows=12, samples_in=11, quarantined=(Q_A,))
    assert st.publish(pub, fence=gen) == 2
    first = st.counters()
    assert (first.samples_in, first.quarantined) == (11, 1)
    assert st.publish(pub, fence=gen) == 0  # the reply was lost: the producer sends it again
    assert st.counters() == first and st.quarantine() == [Q_A]
    # Even a retry carrying more steps (the same position) counts its input only once.
    assert st.publish(dataclasses.replace(pub, steps=steps(0, 2), checkpoint=dataclasses.replace(
        pub.checkpoint, next_step=3)), fence=gen) == 1
    c = st.counters()
    assert (c.samples_in, c.quarantined) == (11, 1)
    assert c.samples_planned == sum(s.info.step_samples for s in steps(0, 2))


def test_quarantine_counted_and_listed_once_per_sample(env):
    st, gen = env.state, env.producer()
    q_a2 = QuarantineEntry("rows:7", "parse", "met again in epoch 1")
    q_c = QuarantineEntry("rows:11", "parse", "line 11")
    st.publish(publication(steps(0, 0), rows=12, quarantined=(Q_A, Q_B)), fence=gen)
    st.publish(publication(steps(1, 1), rows=20, quarantined=(Q_A, q_c)), fence=gen)
    # The next epoch meets the same bad records again.
    st.publish(publication(steps(2, 2, epoch=1), epoch=1, rows=12, quarantined=(q_a2, Q_B)),
               fence=gen)
    c = st.counters()
    assert c.quarantined == 3
    assert dict(c.quarantined_by_reason) == {"parse": 2, "decode": 1}
    assert st.quarantine() == [Q_A, Q_B, q_c]  # the first record of each id, in order
    assert st.quarantine(limit=2) == [Q_A, Q_B] and st.quarantine(limit=0) == []


def test_epoch_ends_are_write_once_and_listed_by_epoch(make_env):
    env = make_env(mode="quota")
    st, gen = env.state, env.producer()
    from pipeline.planner.types import MeasuredSample

    end0 = make_end(0, (1, 1, 1, 1), 2, (MeasuredSample("a:9", 40), MeasuredSample(17, 3, 2)))
    end1 = make_end(1, (2, 2, 2, 2), 1)
    st.publish(publication(steps(0, 1), rows=10, ends=(end0,)), fence=gen)
    st.publish(publication(steps(2, 2, epoch=1), epoch=1, rows=10, ends=(end1, end0)),
               fence=gen)  # end0 again, identical: a no-op
    assert st.epoch_ends() == [end0, end1]
    with pytest.raises(StepConflict, match="0"):
        st.publish(publication(epoch=2, rows=0, next_step=3,
                               ends=(make_end(0, (1, 1, 1, None), 2),)), fence=gen)
    with pytest.raises(StepConflict):  # two different ENDs of one epoch in one publication
        st.publish(publication(epoch=2, rows=0, next_step=3,
                               ends=(make_end(2, (2, 2, 2, 2), 0), make_end(2, (2, 2, 2, 1), 0))),
                   fence=gen)
    assert st.epoch_ends() == [end0, end1]


def test_done_refuses_new_steps_but_not_a_replay(env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 1), rows=4), fence=gen)
    assert not st.is_done()
    # The last publication may carry steps and `done` together.
    st.publish(publication(steps(2, 2), rows=6, done=True), fence=gen)
    assert st.is_done()
    assert st.publish(publication(steps(0, 2), rows=7), fence=gen) == 0
    with pytest.raises(StepConflict, match="done"):
        st.publish(publication(steps(3, 3), rows=8), fence=gen)
    assert st.published_through() == 2 and st.is_done()


def test_get_step_for_returns_only_the_asked_ranks(make_env):
    env = make_env(world_size=4)
    st, gen = env.state, env.producer()
    full = make_step(0)
    partial = make_step(1, ranks=[0, 1])  # ranks 2 and 3 are absent (join, end of epoch)
    st.publish(publication([full, partial]), fence=gen)
    got = st.get_step_for(0, [2, 0])
    assert [b.rank for b in got.batches] == [0, 2]
    assert got.batch_for(2) == full.batch_for(2) and got.batch_for(0) == full.batch_for(0)
    assert (got.epoch, got.step, got.info) == (full.epoch, full.step, full.info)  # all ranks
    assert st.get_step_for(0, [3]).batches == (full.batch_for(3),)
    assert st.get_step_for(0, []).batches == () and st.get_step_for(0, []).info == full.info
    assert st.get_step_for(1, [3]).batches == () and st.get_step_for(1, [3]).info == partial.info
    assert st.get_step_for(1, [1, 3]).batches == (partial.batch_for(1),)
    assert st.get_step_for(2, [0]) is None


def test_counters_add_up_over_publications(env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 1), rows=30, samples_in=29, quarantined=(Q_A,)), fence=gen)
    st.publish(publication(steps(2, 2), rows=45, samples_in=15), fence=gen)
    st.publish(publication(epoch=1, rows=0, next_step=3, samples_in=2, quarantined=(Q_B,)),
               fence=gen)
    s = steps(0, 2)
    assert st.counters() == JobCounters(
        samples_in=46, samples_planned=sum(x.info.step_samples for x in s),
        tokens_planned=sum(x.info.step_tokens for x in s), quarantined=2,
        quarantined_by_reason={"decode": 1, "parse": 1}, lease_lapses=0)


def test_every_step_above_trimmed_through_is_readable(env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 5)), fence=gen)
    for r in range(4):
        st.ack(r, 5)
    tt = st.trimmed_through()
    assert -1 <= tt <= 5
    assert all(st.get_step(n) == make_step(n) for n in range(tt + 1, 6))
    assert all(st.get_step(n) is None for n in range(tt + 1))


# ------------------------------------------------------------------- the producer lease
def test_producer_claim_refused_while_another_holds_a_live_lease(env):
    st = env.state
    t0 = env.now()
    gen = st.claim_producer("a", SHORT)
    assert gen is not None
    lease = st.producer_lease()
    assert (lease.generation, lease.holder) == (gen, "a")
    assert t0 + SHORT - 0.01 <= lease.expires_at <= env.now() + SHORT + 0.01
    assert st.claim_producer("b", LONG) is None
    assert st.producer_lease() == lease
    env.sleep(LAPSE)
    gen_b = st.claim_producer("b", LONG)  # the lapsed lease goes to the next holder
    assert gen_b == gen + 1 and st.producer_lease().holder == "b"


def test_same_holder_takes_over_at_once_and_fences_its_old_generation(env):
    st = env.state
    old = st.claim_producer("actor-1", LONG)
    new = st.claim_producer("actor-1", LONG)  # the restarted actor, the old one still alive
    assert new == old + 1 and st.producer_lease().generation == new
    with pytest.raises(Fenced):
        st.publish(publication(steps(0, 0)), fence=old)
    with pytest.raises(Fenced):
        st.renew_producer(old, LONG)
    with pytest.raises(Fenced):
        st.set_error("the old one failed", fence=old)
    assert st.error() is None and st.published_through() == -1
    assert st.publish(publication(steps(0, 0)), fence=new) == 1


def test_an_expired_lease_refuses_publish_until_renewed(env):
    st = env.state
    gen = st.claim_producer("a", SHORT)
    st.publish(publication(steps(0, 0)), fence=gen)
    env.sleep(LAPSE)
    with pytest.raises(Fenced):
        st.publish(publication(steps(1, 1)), fence=gen)
    with pytest.raises(Fenced):
        st.set_error("late", fence=gen)
    st.renew_producer(gen, LONG)  # nobody took over: it is still ours
    assert st.producer_lease().generation == gen
    assert st.publish(publication(steps(1, 1)), fence=gen) == 1
    # Once another holder took the lapsed lease, renewing is refused for good.
    st.renew_producer(gen, SHORT)
    env.sleep(LAPSE)
    gen_b = st.claim_producer("b", LONG)
    with pytest.raises(Fenced):
        st.renew_producer(gen, LONG)
    with pytest.raises(Fenced):
        st.publish(publication(steps(2, 2)), fence=gen)
    assert st.publish(publication(steps(2, 2)), fence=gen_b) == 1


def test_release_lets_another_claim_and_an_old_generation_releases_nothing(env):
    st = env.state
    gen = st.claim_producer("a", LONG)
    st.release_producer(gen - 1)  # not current: a no-op
    assert st.claim_producer("b", LONG) is None
    st.release_producer(gen)
    with pytest.raises(Fenced):  # released means expired: no more publishing on it
        st.publish(publication(steps(0, 0)), fence=gen)
    gen_b = st.claim_producer("b", LONG)
    assert gen_b == gen + 1
    st.release_producer(gen)  # the old holder releasing late must not free b's lease
    assert st.claim_producer("c", LONG) is None
    assert st.producer_lease().holder == "b" and st.producer_lease().expires_at > env.now()


def test_error_is_set_only_by_the_current_producer(env):
    st = env.state
    with pytest.raises(Fenced):
        st.set_error("nobody holds the lease", fence=0)
    gen = env.producer()
    st.set_error("tokenizer missing", fence=gen)
    assert st.error() == "tokenizer missing"
    assert st.claim_producer("x", LONG) is None  # the live holder keeps it
    with pytest.raises(Fenced):
        st.set_error("other", fence=gen + 1)
    assert st.error() == "tokenizer missing"


def test_each_process_of_the_producer_actor_is_restarted_once(env):
    """Replicas that all find process 2 of the actor stuck: one restarts it; a replica that
    judged an older process, or read the count late, restarts nothing; the next process and a
    new actor (its count starts at 0 again) can each be restarted once."""
    st = env.state
    before = snapshot(env)
    assert st.claim_producer_restart("actor-a", 2)
    assert not st.claim_producer_restart("actor-a", 2)
    assert not st.claim_producer_restart("actor-a", 1)
    assert st.claim_producer_restart("actor-a", 3)
    assert st.claim_producer_restart("actor-b", 0)
    assert not st.claim_producer_restart("actor-b", 0)
    assert snapshot(env) == before  # the lease, the plan: nothing else moved


def test_empty_producer_holder_is_refused(env):
    with pytest.raises(ValueError, match="holder"):
        env.state.claim_producer("", LONG)


# ------------------------------------------------------------------------ rank leases
def test_rank_lease_held_is_refused_until_it_lapses(env):
    st = env.state
    t0 = env.now()
    lease = st.claim_rank(1, "A", SHORT)
    assert (lease.rank, lease.client_id) == (1, "A")
    assert t0 + SHORT - 0.01 <= lease.expires_at <= env.now() + SHORT + 0.01
    assert st.claim_rank(1, "A", SHORT).client_id == "A"  # the holder renews
    with pytest.raises(RankHeld, match="'A'"):
        st.claim_rank(1, "B", LONG)
    assert st.rank_health()[1].client_id == "A"
    env.sleep(LAPSE)
    assert st.claim_rank(1, "B", LONG).client_id == "B"
    with pytest.raises(RankHeld, match="'B'"):  # the old client comes back: refused
        st.claim_rank(1, "A", LONG)
    assert st.counters().lease_lapses == 1


def test_heartbeat_renews_retakes_after_a_lapse_and_never_steals(env):
    st = env.state
    assert st.heartbeat(0, "A", SHORT) is True  # no lease yet: taken
    assert st.heartbeat(0, "B", LONG) is False  # A's lease is live: nothing changes
    h = st.rank_health()[0]
    assert h.client_id == "A" and not h.lapsed
    st.heartbeat(0, "A", 0.6)
    env.sleep(0.4)
    assert st.heartbeat(0, "A", 0.6) is True  # renewed: still live past the first term
    env.sleep(0.4)
    assert not st.rank_health()[0].lapsed and st.lapsed_ranks() == []
    env.sleep(0.7)
    assert st.rank_health()[0].lapsed
    assert st.heartbeat(0, "A", LONG) is True  # its own lapsed lease: not reported any more
    assert st.lapsed_ranks() == [] and st.counters().lease_lapses == 0
    st.heartbeat(0, "A", SHORT)
    env.sleep(LAPSE)
    assert st.heartbeat(0, "B", LONG) is True  # another client after a lapse: a lapse
    assert st.rank_health()[0].client_id == "B" and st.counters().lease_lapses == 1
    assert st.lapsed_ranks() == [0]


def test_release_only_by_the_holder_and_it_is_not_a_lapse(env):
    st = env.state
    st.claim_rank(0, "A", SHORT)
    st.release_rank(0, "B")  # not the holder: ignored
    with pytest.raises(RankHeld):
        st.claim_rank(0, "B", LONG)
    st.release_rank(0, "A")
    h = st.rank_health()[0]
    assert (h.client_id, h.lease_expires_at, h.heartbeat_age, h.lapsed) == (None, None, None,
                                                                            False)
    env.sleep(LAPSE)
    # A released lease is no lapse; ranks 1-3 never claimed since rank 0's claim: gone.
    assert st.lapsed_ranks() == [] and sorted(st.timed_out_ranks(0)) == [1, 2, 3]
    st.claim_rank(0, "B", LONG)
    assert st.counters().lease_lapses == 0 and st.lapsed_ranks() == []
    st.release_rank(3, "nobody")  # never claimed: a no-op


def test_a_release_naming_a_claim_holds_only_while_no_claim_came_since(env):
    """A replica releases the lease of a client whose stream vanished from it by that stream's
    claim: once the client claimed the rank again (its stream failed over to another replica)
    it is alive, and the release changes nothing (#40 item 3). Acks and heartbeats are no
    claims."""
    st = env.state
    first = st.claim_rank(0, "A", LONG)
    again = st.claim_rank(0, "A", LONG)  # A's Open on another replica
    assert (first.claim, again.claim) == (1, 2)
    assert st.claim_rank(1, "C", LONG).claim == 1  # counted per rank
    assert st.heartbeat(0, "A", LONG) is True
    st.release_rank(0, "A", claim=first.claim)
    with pytest.raises(RankHeld, match="'A'"):
        st.claim_rank(0, "B", LONG)
    assert st.rank_health()[0].client_id == "A"
    st.release_rank(0, "A", claim=again.claim)
    assert st.rank_health()[0].client_id is None
    assert st.claim_rank(0, "B", LONG).claim == 3
    assert st.counters().lease_lapses == 0


def test_a_lapse_is_reported_by_lapsed_timed_out_and_health(env):
    st = env.state
    st.claim_rank(2, "A", SHORT)
    st.claim_rank(3, "C", LONG)
    assert st.lapsed_ranks() == [] and st.timed_out_ranks(5) == {}
    env.sleep(SHORT + 0.3)
    assert st.lapsed_ranks() == [2]  # never-claimed ranks are not lapses
    out = st.timed_out_ranks(0.1)
    assert list(out) == [0, 1, 2] and 0.1 < out[2] < 5
    assert SHORT + 0.3 - 0.01 <= out[0] == out[1] < 5  # gone since the first claim
    assert st.timed_out_ranks(30) == {}
    health = st.rank_health()
    assert [h.rank for h in health] == [0, 1, 2, 3]
    h2 = health[2]
    assert h2.client_id == "A" and h2.lapsed and 0.1 < h2.lapsed_for < 5
    assert h2.heartbeat_age >= SHORT + 0.3 - 0.01
    assert health[3].client_id == "C" and not health[3].lapsed
    assert health[0].client_id is None and health[0].heartbeat_age is None
    # Taken over: still reported as lapsed (it happened), but no longer timed out.
    st.claim_rank(2, "B", LONG)
    assert st.lapsed_ranks() == [2] and sorted(st.timed_out_ranks(0)) == [0, 1]
    assert not st.rank_health()[2].lapsed


def test_a_rank_that_never_connects_times_out_from_the_first_claim(make_env):
    """Guarantee 4's other half: no lease at all is as gone as a lapsed one, counted from the
    moment the job's first rank claimed (before any claim nobody is waiting)."""
    env = make_env(world_size=3)
    st = env.state
    env.sleep(LAPSE)
    assert st.timed_out_ranks(0) == {}  # nobody connected yet: nothing to time out
    st.claim_rank(0, "A", LONG)
    env.sleep(LAPSE)
    st.claim_rank(2, "C", LONG)  # a late rank: its wait ends when it claims
    out = st.timed_out_ranks(SHORT)
    assert list(out) == [1] and LAPSE - 0.01 <= out[1] < 5
    assert st.timed_out_ranks(30) == {}
    st.claim_rank(1, "B", SHORT)
    assert st.timed_out_ranks(0) == {}
    env.sleep(LAPSE)  # and from now on it is an ordinary lease that may lapse
    assert list(st.timed_out_ranks(0)) == [1]


def test_rank_and_client_id_are_checked(make_env):
    env = make_env(world_size=2)
    st = env.state
    for call in (lambda: st.claim_rank(2, "x", LONG), lambda: st.claim_rank(-1, "x", LONG),
                 lambda: st.heartbeat(2, "x", LONG), lambda: st.release_rank(2, "x"),
                 lambda: st.ack(2, 0), lambda: st.acked(2), lambda: st.ack(-1, 0),
                 lambda: st.ack(5, -1)):
        with pytest.raises(ValueError, match="rank"):
            call()
    with pytest.raises(ValueError, match="client_id"):
        st.claim_rank(0, "", LONG)
    with pytest.raises(ValueError, match="client_id"):
        st.heartbeat(0, "", LONG)
    gen = env.producer()
    with pytest.raises(ValueError, match="rank"):  # a step with a batch for rank 2 of W=2
        st.publish(publication([make_step(0, world_size=3)]), fence=gen)
    with pytest.raises(ValueError, match="rank"):  # one rank twice in one step
        st.publish(publication([make_step(0, 2, ranks=[1, 1])]), fence=gen)
    assert st.published_through() == -1


# ------------------------------------------------------------------------------- acks
def test_acks_are_monotonic_and_never_ahead_of_the_plan(env):
    st, gen = env.state, env.producer()
    with pytest.raises(AckAheadOfPlan):
        st.ack(0, 0)  # nothing published yet
    st.publish(publication(steps(0, 4)), fence=gen)
    st.ack(0, 3)
    st.ack(0, 1)  # lower: ignored
    st.ack(0, -1)  # "none": ignored
    assert st.acked(0) == 3
    with pytest.raises(AckAheadOfPlan, match="5"):
        st.ack(1, 5)
    assert st.acked(1) == -1
    st.ack(1, 4)
    assert st.acked_all() == [3, 4, -1, -1]
    assert [h.acked for h in st.rank_health()] == [3, 4, -1, -1]
    st.ack(1, 4)  # the same again: fine
    assert st.acked(1) == 4


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(acks=hst.lists(hst.tuples(hst.integers(0, 2), hst.integers(-1, 9)), max_size=40))
def test_cursors_are_the_running_maximum_of_valid_acks(make_env, acks):
    env = make_env(world_size=3)
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 7, world_size=3)), fence=gen)
    best = [-1, -1, -1]
    for rank, step in acks:
        if step > 7:
            with pytest.raises(AckAheadOfPlan):
                st.ack(rank, step)
        else:
            st.ack(rank, step)
            best[rank] = max(best[rank], step)
        assert st.acked(rank) == best[rank]
    assert st.acked_all() == best


def test_ack_many_reports_each_acks_error_and_applies_the_rest(env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 2)), fence=gen)
    st.grant([(0, r, 2) for r in range(4)])
    st.ack(3, 2)
    out = st.ack_many([RankAck(0, "a", 1), RankAck(1, "b", 9), RankAck(2, "c", 0),
                       RankAck(7, "x", 0), RankAck(3, "d", 1), RankAck(2, "c", -1),
                       RankAck(1, "", 0)], LONG)
    assert out[0] is None and out[2] is None and out[4] is None and out[5] is None
    assert isinstance(out[1], AckAheadOfPlan) and isinstance(out[3], ValueError)
    assert isinstance(out[6], ValueError)  # an empty client id
    assert st.acked_all() == [1, -1, 0, 2]  # rank 3 kept its higher cursor
    # Each accepted ack was its client's sign of life: it holds the lease now.
    assert [h.client_id for h in st.rank_health()] == ["a", None, "c", "d"]
    assert st.ack_many([], LONG) == []


def test_ack_many_is_fenced_by_the_lease_and_never_skips_an_undelivered_step(env):
    """An ack or heartbeat of a client whose rank another client holds changes nothing
    (`RankHeld`: its stream ends); an ack beyond the rank's delivery grant is refused
    (`AckNotDelivered`), however far the plan is published."""
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 5)), fence=gen)
    st.claim_rank(0, "A", LONG)
    st.grant([(0, 0, 2), (0, 1, 1)])
    out = st.ack_many([RankAck(0, "B", 1), RankAck(0, "B"), RankAck(0, "A", 3),
                       RankAck(1, "C", 4), RankAck(1, "C", 1)], LONG)
    assert isinstance(out[0], RankHeld) and isinstance(out[1], RankHeld)
    assert isinstance(out[2], AckNotDelivered) and isinstance(out[3], AckNotDelivered)
    assert out[4] is None
    assert st.acked_all()[:2] == [-1, 1] and st.rank_health()[0].client_id == "A"
    assert st.ack_many([RankAck(0, "A", 2)], LONG) == [None] and st.acked(0) == 2


def test_ack_many_renews_only_its_clients_lease_and_takes_a_lapsed_one_over(env):
    st = env.state
    st.claim_rank(0, "A", SHORT)
    env.sleep(SHORT / 2)
    assert st.ack_many([RankAck(0, "A")], 0.6) == [None]  # a heartbeat renews it
    env.sleep(SHORT)
    assert not st.rank_health()[0].lapsed
    env.sleep(0.6)
    assert st.rank_health()[0].lapsed  # silent for the lease: lapsed, nothing renewed it
    assert st.ack_many([RankAck(0, "B")], LONG) == [None]  # taken over: a lapse
    assert st.rank_health()[0].client_id == "B" and st.counters().lease_lapses == 1
    # A rank outside the world (and not a draining rank of the one it ended): refused.
    assert isinstance(st.ack_many([RankAck(4, "E")], LONG)[0], ValueError)


def test_an_ack_without_renew_retakes_only_a_lease_its_client_does_not_hold_live(env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 1)), fence=gen)
    st.grant([(0, 0, 1)])
    st.claim_rank(0, "A", SHORT)
    expires = st.rank_health()[0].lease_expires_at
    assert st.ack_many([RankAck(0, "A", 0, renew=False)], LONG) == [None]
    assert st.rank_health()[0].lease_expires_at == expires  # live and its own: left as it was
    env.sleep(LAPSE)
    assert st.ack_many([RankAck(0, "A", 1, renew=False)], LONG) == [None]
    h = st.rank_health()[0]
    assert not h.lapsed and h.lease_expires_at > expires and st.acked(0) == 1  # taken back


def test_acks_need_no_lease(env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 1)), fence=gen)
    st.claim_rank(0, "A", LONG)
    st.ack(0, 1)  # a replica acks for a rank it serves; the lease is the replica's business
    assert st.acked(0) == 1 and st.rank_health()[0].client_id == "A"


def test_state_errors_are_one_hierarchy():
    for exc in (StepConflict, StepGap, CheckpointConflict, AckAheadOfPlan, RankHeld, Fenced):
        assert issubclass(exc, StateError)
