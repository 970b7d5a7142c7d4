"""The reconfiguration part of the `JobState` contract (worlds, grants, `scale`, `rank_left`) on
every implementation. Each test tries to break one promise: a boundary that voids a delivered
batch or takes back a delivered END, a stale producer publishing into the new world, a second
switch while the first is unfinished, a refusal that changes something."""

from __future__ import annotations

import pytest

from pipeline.errors import (
    Fenced,
    PlanningComplete,
    RanksLive,
    ScaleInProgress,
    WorldChanged,
)
from pipeline.jobstate import Grant, ScaleReason, ScaleRequest, World
from pipeline.jobstate.worlds import choose_boundary

from .builders import make_end, make_global_step, make_step, publication, steps
from .conftest import LONG, Env


def _returned(st, world: World) -> tuple[int, int]:
    """Samples and tokens of a world's returned batches, read back from its steps."""
    samples = tokens = 0
    for r, last in enumerate(world.last_steps):
        for n in range(last + 1, world.published_through + 1):
            for b in st.get_step(n).micros_for(r):
                samples, tokens = samples + len(b.samples), tokens + b.num_tokens
    return samples, tokens


def _observed(st) -> dict:
    """Everything a refused `scale` must leave as it was."""
    return {"head": st.head(), "worlds": st.worlds(), "acked": st.acked_all(),
            "counters": st.counters(), "grants": st.grant([(st.head().generation, 0, -1)])}


def test_a_fresh_job_has_one_world(env: Env):
    st = env.state
    (w0,) = st.worlds()
    assert (w0.generation, w0.world_size, w0.first_step, w0.reason) == (0, 4, 0,
                                                                         ScaleReason.INITIAL)
    assert not w0.ended and w0.last_step is None
    head = st.head()
    assert (head.published_through, head.generation, head.world_size, head.first_step) == (
        -1, 0, 4, 0)
    assert st.world_size == 4 and st.world_timings(0) is None


def test_grants_are_capped_by_the_plan_and_never_go_down(env: Env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 5)), fence=gen)
    assert st.grant([(0, 1, 3), (0, 2, 99)]) == [Grant(3), Grant(5)]
    assert st.grant([(0, 1, 1)]) == [Grant(3)]  # monotonic
    bad = st.grant([(0, 4, 1), (1, 0, 1), (0, 0, 2)])
    assert isinstance(bad[0], ValueError) and isinstance(bad[1], ValueError)
    assert bad[2] == Grant(2)


def test_live_ranks_end_at_the_highest_grant_gone_ranks_at_their_ack(env: Env):
    """Nothing a live rank may have been sent is voided; a rank without a live lease keeps only
    what it acknowledged; every returned batch leaves the planned counters."""
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 9)), fence=gen)
    for r in (0, 1, 2):
        st.claim_rank(r, f"c{r}", LONG)
    st.grant([(0, 0, 4), (0, 1, 6), (0, 2, 2)])
    st.ack(3, 1)  # rank 3 has no live lease (never claimed): it is gone
    before = st.counters()
    res = st.scale(ScaleRequest(2))
    assert res.changed and res.previous is not None
    old, new = res.previous, res.world
    assert old.last_steps == (6, 6, 6, 1) and old.last_step == 6
    assert old.live_ranks == (0, 1, 2) and old.published_through == 9
    assert (new.generation, new.world_size, new.first_step, new.reason) == (1, 2, 10,
                                                                            ScaleReason.SCALE)
    assert (old.returned_samples, old.returned_tokens) == _returned(st, old) != (0, 0)
    after = st.counters()
    assert after.samples_planned == before.samples_planned - old.returned_samples
    assert after.tokens_planned == before.tokens_planned - old.returned_tokens
    assert old.returned(7, 0) and not old.returned(6, 0) and old.returned(2, 3)
    assert st.worlds() == [old, new] and st.world_size == 2
    head = st.head()
    assert (head.generation, head.world_size, head.first_step) == (1, 2, 10)
    assert st.acked_all() == [9, 9]  # the new world's cursors: its first step - 1
    t = st.world_timings(1)
    assert t is not None and t.requested_at == pytest.approx(new.requested_at)
    assert t.adopted_at is None and t.first_batch_at == {}
    assert choose_boundary(first_step=0, published_through=9, last_end_step=-1,
                           grants=[4, 6, 2, -1], acked=[-1, -1, -1, 1],
                           live=[True, True, True, False]) == old.last_steps


def test_the_boundary_never_takes_back_a_published_end(make_env):
    env = make_env(world_size=2)
    st, gen = env.state, env.producer()
    end0 = make_end(0, (4, 4), 5)
    st.publish(publication(steps(0, 4, 2), rows=5, ends=(end0,)), fence=gen)
    st.publish(publication(steps(5, 7, 2, epoch=1), epoch=1, rows=3), fence=gen)
    st.claim_rank(0, "c0", LONG)
    st.claim_rank(1, "c1", LONG)
    st.grant([(0, 0, 2), (0, 1, 1)])  # nobody was sent past step 2, but END(0) is published
    res = st.scale(ScaleRequest(3))
    assert res.previous.last_steps == (4, 4)  # the old world finishes epoch 0
    assert st.epoch_ends() == [end0]


def test_a_restored_position_ends_every_rank_before_it_only_once_all_are_gone(env: Env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 7)), fence=gen)
    st.claim_rank(2, "c2", LONG)
    seen = _observed(st)
    with pytest.raises(RanksLive, match=r"\[2\]"):
        st.scale(ScaleRequest(3, ScaleReason.ELASTIC, position=5, require_gone=True))
    assert _observed(st) == seen
    st.release_rank(2, "c2")
    res = st.scale(ScaleRequest(3, ScaleReason.ELASTIC, position=5, require_gone=True))
    assert res.previous.last_steps == (4, 4, 4, 4) and res.world.first_step == 8
    assert res.world.reason is ScaleReason.ELASTIC


def test_a_restored_position_never_reopens_an_epoch_whose_end_is_published(make_env):
    """Issue #27 item 4: an elastic Open restored at step 5 after END(0) (last step 9) was
    published. The old world's epoch 0 stays closed: every rank ends at 9, only epoch 1's
    steps come back (nothing of epoch 0 re-planned into epoch 1, the END not contradicted)."""
    env = make_env(world_size=2)
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 9, 2), rows=10, ends=(make_end(0, (9, 9), 10),)),
               fence=gen)
    st.publish(publication(steps(10, 12, 2, epoch=1), epoch=1, rows=3), fence=gen)
    res = st.scale(ScaleRequest(4, ScaleReason.ELASTIC, position=5, require_gone=True))
    assert res.previous.last_steps == (9, 9)
    assert res.previous.returned_samples == 3 * 2 * 2  # steps 10-12, two ranks, two samples
    assert choose_boundary(first_step=0, published_through=12, last_end_step=9, grants=[0, 0],
                           acked=[-1, -1], live=[False, False], position=5) == (9, 9)
    assert choose_boundary(first_step=0, published_through=12, last_end_step=9, grants=[0, 0],
                           acked=[-1, -1], live=[False, False], position=11) == (10, 10)


def test_an_ended_world_answers_grants_with_its_boundary(env: Env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 9)), fence=gen)
    st.claim_rank(0, "c0", LONG)
    st.grant([(0, 0, 6)])
    st.scale(ScaleRequest(2))
    assert st.grant([(0, 0, 8), (0, 3, 8)]) == [Grant(6, ended=True, next_world_size=2),
                                                Grant(-1, ended=True, next_world_size=2)]
    # The new world's grants start below its first step and follow its plan.
    assert st.grant([(1, 1, 20)]) == [Grant(9)]
    assert isinstance(st.grant([(1, 2, 20)])[0], ValueError)  # no rank 2 in a world of 2
    assert isinstance(st.grant([(2, 0, 20)])[0], ValueError)  # no world 2 yet


def test_a_stale_producer_cannot_publish_into_the_new_world(env: Env):
    """The checkpoint names the world it planned for: a producer that missed the switch is
    refused (WorldChanged) even with a valid fence; a stale fence is refused first. The first
    publication for the new world adopts it; its batches are checked against the new world."""
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 3)), fence=gen)
    st.scale(ScaleRequest(2))
    seen = _observed(st)
    with pytest.raises(WorldChanged):
        st.publish(publication(steps(4, 4)), fence=gen)
    st.release_producer(gen)
    newer = env.producer()
    with pytest.raises(Fenced):
        st.publish(publication((make_step(4, 2),), world=1), fence=gen)
    with pytest.raises(ValueError, match="rank 2"):
        st.publish(publication((make_step(4, 3),), world=1), fence=newer)
    assert _observed(st) == seen
    with pytest.raises(ScaleInProgress, match="not planned yet"):
        st.scale(ScaleRequest(3))
    assert st.publish(publication((make_step(4, 2),), world=1), fence=newer) == 1
    t = st.world_timings(1)
    assert t.adopted_at is not None and t.adopted_at >= t.requested_at
    assert st.scale(ScaleRequest(3)).changed  # adopted, nobody draining: the next may come


def test_a_switch_is_in_progress_while_a_live_old_rank_drains(env: Env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 5)), fence=gen)
    for r in range(4):
        st.claim_rank(r, f"c{r}", LONG)
    st.scale(ScaleRequest(2))
    st.publish(publication(world=1, rows=7, next_step=6), fence=gen)  # adopted, no step yet
    # Draining ranks (beyond the new world too) keep their leases; their cursors are not the
    # new world's.
    assert st.heartbeat(3, "c3", LONG)
    with pytest.raises(ValueError):
        st.ack(3, 2)
    with pytest.raises(ValueError):
        st.claim_rank(4, "c4", LONG)
    seen = _observed(st)
    with pytest.raises(ScaleInProgress, match="draining"):
        st.scale(ScaleRequest(3))
    assert _observed(st) == seen
    st.rank_left(0, 0, "c0")
    st.rank_left(0, 1, "c1")
    st.release_rank(2, "c2")  # a lease released (or lapsed) no longer drains either
    st.rank_left(0, 3, "not-the-holder")  # only the holder's exit counts
    with pytest.raises(ScaleInProgress, match=r"\[3\]"):
        st.scale(ScaleRequest(3))
    st.rank_left(0, 3, "c3")
    t = st.world_timings(1)
    assert set(t.left_at) == {0, 1, 3}
    assert st.scale(ScaleRequest(3)).changed


def test_no_change_for_the_current_size_or_a_world_that_already_ended(env: Env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 2)), fence=gen)
    seen = _observed(st)
    assert not st.scale(ScaleRequest(4)).changed
    assert not st.scale(ScaleRequest(2, ScaleReason.SHRINK, expect_generation=1)).changed
    assert _observed(st) == seen
    for bad in (0, -3):
        with pytest.raises(ValueError):
            st.scale(ScaleRequest(bad))
    assert _observed(st) == seen


def test_a_fully_planned_job_cannot_move_once_a_live_rank_may_have_its_last_end(env: Env):
    """(A fully planned job reopens otherwise: tests/elastic/test_reopen_state.py.)"""
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 2), ends=(make_end(0, (2, 2, 2, 2), 3),), done=True),
               fence=gen)
    st.claim_rank(0, "c0", LONG)
    st.grant([(0, 0, 2)])  # rank 0 was sent its last batch: END(0) may be delivered
    seen = _observed(st)
    with pytest.raises(PlanningComplete):
        st.scale(ScaleRequest(2))
    assert _observed(st) == seen


def test_first_batches_of_the_new_world_are_timed(env: Env):
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 1)), fence=gen)
    st.scale(ScaleRequest(2))
    st.publish(publication((make_step(2, 2), make_step(3, 2)), world=1), fence=gen)
    st.grant([(1, 0, 2)])
    t = st.world_timings(1)
    assert set(t.first_batch_at) == {0} and t.first_batch_seconds(2) is None
    env.sleep(0.01)
    st.grant([(1, 1, 3), (1, 0, 3)])
    t = st.world_timings(1)
    assert set(t.first_batch_at) == {0, 1}
    assert t.first_batch_at[1] >= t.first_batch_at[0] >= t.requested_at
    assert t.first_batch_seconds(2) == pytest.approx(t.first_batch_at[1] - t.requested_at)


def test_the_new_world_does_not_inherit_the_old_worlds_lapses(env: Env):
    """A rank that lapsed in the old world (the reason for a shrink) is not a dead rank of the
    new world, whose rank with the same id has not connected yet."""
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 3)), fence=gen)
    st.claim_rank(0, "dead", 0.01)
    for r in (1, 2, 3):
        st.claim_rank(r, f"c{r}", LONG)
    env.sleep(0.05)
    assert 0 in st.timed_out_ranks(0.01) and 0 in st.lapsed_ranks()
    res = st.scale(ScaleRequest(3, ScaleReason.SHRINK, expect_generation=0))
    assert res.previous.live_ranks == (1, 2, 3) and res.previous.last_steps[0] == -1
    assert st.timed_out_ranks(0.0) == {} and st.lapsed_ranks() == []
    assert st.claim_rank(0, "new0", LONG).client_id == "new0"  # free at once


def test_a_record_published_before_stamps_gets_its_world_from_the_world_records():
    from pipeline.jobstate.worlds import World, stamp_of_end, stamp_of_step
    from pipeline.planner.types import EpochEnd, WorldStamp

    worlds = [World(0, 4, 0, last_steps=(3,) * 4, published_through=3),
              World(1, 2, 4, last_steps=(6, 6), published_through=6), World(2, 4, 7)]
    assert [stamp_of_step(worlds, n) for n in (0, 3, 4, 6, 7, 50)] == [
        WorldStamp(0, 4), WorldStamp(0, 4), WorldStamp(1, 2), WorldStamp(1, 2),
        WorldStamp(2, 4), WorldStamp(2, 4)]
    assert stamp_of_end(worlds, EpochEnd(0, (5, 6), 7)) == WorldStamp(1, 2)
    # No step at all to go by: the latest world of its size (what builds before stamps assumed).
    assert stamp_of_end(worlds, EpochEnd(0, (None,) * 4, 7)) == WorldStamp(2, 4)


def test_global_steps_read_back_whole_and_their_micro_batches_return_with_their_ranks(env: Env):
    """A global step's rank holds several micro-batches (one record per rank): both states give
    back the same steps, a rank's part alone, and a boundary returns every micro-batch of a
    rank after its last step (truncations counted at their kept length)."""
    st, gen = env.state, env.producer()
    published = tuple(make_global_step(n, (3, 1, 2, 1), truncated=n % 2 == 1)
                      for n in range(6))
    st.publish(publication(published), fence=gen)
    assert [st.get_step(n) for n in range(6)] == list(published)
    part = st.get_step_for(4, [2])
    assert part.batches == published[4].micros_for(2) and part.info == published[4].info
    for r in (0, 1, 2):
        st.claim_rank(r, f"c{r}", LONG)
    st.grant([(0, 0, 3), (0, 1, 3), (0, 2, 3)])
    st.ack(3, 1)  # rank 3 is gone, having acknowledged step 1
    res = st.scale(ScaleRequest(2))
    assert res.previous.last_steps == (3, 3, 3, 1)
    assert (res.previous.returned_samples, res.previous.returned_tokens) == _returned(
        st, res.previous)
    # Two samples a micro-batch: ranks 0-2 (3 + 1 + 2 micro-batches) in steps 4-5, rank 3 (one)
    # in steps 2-5.
    assert res.previous.returned_samples == 2 * 2 * (3 + 1 + 2) + 2 * 4 * 1
