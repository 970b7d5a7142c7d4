"""Reconfiguring a fully planned job, on every `JobState` (memory and Redis: the SCALE script
against its Python model). A fully planned job reopens when no live rank may have its final END:
that END is voided, the job is planned again (a producer re-plans the returned batches in the new
world, whose END then closes the epoch); when a live rank may have it, only a switch that returns
nothing is made (it has nothing to plan), any other is refused, changing nothing."""

from __future__ import annotations

import pytest
from jobstate.builders import make_end, make_step, publication, steps
from jobstate.conftest import LONG

from pipeline.errors import PlanningComplete, ScaleInProgress
from pipeline.jobstate import ScaleReason, ScaleRequest

END0 = make_end(0, (3, 3, 3, 3), 4)
END1 = make_end(1, (9, 9, 9, 9), 6)


def _planned(env):
    """W=4, epoch 0 = steps 0-3, epoch 1 (the last) = steps 4-9, fully planned; ranks 0-2 hold
    live leases, rank 3 has none (gone) and acknowledged step 5."""
    st, gen = env.state, env.producer()
    st.publish(publication(steps(0, 3), rows=4, ends=(END0,)), fence=gen)
    st.publish(publication(steps(4, 9, epoch=1), epoch=2, rows=0, ends=(END1,), done=True),
               fence=gen)
    for r in (0, 1, 2):
        st.claim_rank(r, f"c{r}", LONG)
    st.ack(3, 5)
    return st, gen


def _observed(st) -> dict:
    return {"head": st.head(), "worlds": st.worlds(), "acked": st.acked_all(),
            "counters": st.counters(), "ends": st.epoch_ends(), "done": st.is_done()}


def test_a_fully_planned_job_reopens_when_no_live_rank_may_have_its_last_end(env):
    st, gen = _planned(env)
    st.grant([(0, 0, 6), (0, 1, 7), (0, 2, 5)])  # each below its last step (9)
    before = st.counters()
    res = st.scale(ScaleRequest(3, ScaleReason.SHRINK))
    old, new = res.previous, res.world
    # The final END is no bound: live ranks end at their highest grant, the gone one at its ack.
    assert old.last_steps == (7, 7, 7, 5) and new.first_step == 10
    assert old.returned(8, 0) and old.returned(6, 3) and not old.returned(7, 1)
    assert st.epoch_ends() == [END0] and not st.is_done()  # voided, planning again
    after = st.counters()
    assert after.samples_planned == before.samples_planned - old.returned_samples > 0
    with pytest.raises(ScaleInProgress, match="not planned yet"):
        st.scale(ScaleRequest(2))  # the new world's producer has not adopted it yet
    # The producer re-plans for 3 ranks and closes the epoch again: a new END(1) is accepted.
    end1 = make_end(1, (10, 10, 10), 7, generation=1)
    st.publish(publication([make_step(10, 3, epoch=1, salt="re")], epoch=2, rows=0,
                           ends=(end1,), done=True, world=1), fence=gen)
    assert st.epoch_ends() == [END0, end1] and st.is_done()
    assert st.world_timings(1).adopted_at is not None


def test_a_restored_position_reopens_a_fully_planned_job(env):
    st, _ = _planned(env)
    for r in (0, 1, 2):
        st.release_rank(r, f"c{r}")
    res = st.scale(ScaleRequest(2, ScaleReason.ELASTIC, position=7, require_gone=True))
    assert res.previous.last_steps == (6, 6, 6, 6) and st.epoch_ends() == [END0]
    assert not st.is_done()


def test_a_live_rank_that_may_have_the_last_end_forbids_moving_returned_batches(env):
    st, _ = _planned(env)
    st.grant([(0, 0, 9), (0, 1, 6)])  # rank 0 was sent its last batch, so maybe END(1)
    seen = _observed(st)
    with pytest.raises(PlanningComplete, match=r"reached ranks \[0\]"):
        st.scale(ScaleRequest(3, ScaleReason.SHRINK))  # rank 3's steps 6-9 cannot move
    assert _observed(st) == seen


def test_a_switch_that_returns_nothing_is_made_with_nothing_to_plan(env):
    st, _ = _planned(env)
    st.ack(3, 9)  # the gone rank had consumed everything
    st.grant([(0, 0, 9)])  # and a live rank may have the last END: no reopening
    res = st.scale(ScaleRequest(3, ScaleReason.SHRINK))
    assert res.changed and res.previous.last_steps == (9, 9, 9, 9)
    assert res.previous.returned_samples == 0
    assert st.is_done() and st.epoch_ends() == [END0, END1]  # the live ranks finish as planned
    assert st.world_timings(1).adopted_at is not None  # adopted at once: nothing to plan
