"""Trimming by epochs: the ACK script drops the steps before the epoch *before* the one the
slowest rank is in, so any step of a rank's current epoch (and the previous one) can be
replayed, and Redis holds O(two epochs) of plan however long the job runs."""

from __future__ import annotations

import random
import time

import pytest
from jobstate.builders import make_end, make_step, publication

from pipeline.errors import StepConflict
from pipeline.jobstate import RankAck, ScaleRequest

from .retention import expected_trimmed

LONG = 60.0


class Plan:
    """Publishes epochs of given lengths (0: an epoch with no steps, only its END)."""

    def __init__(self, state, world_size: int) -> None:
        self.state, self.w = state, world_size
        self.gen = state.claim_producer("producer", LONG)
        self.next = 0
        self.epoch = 0
        self.first_steps: dict[int, int] = {}

    def epoch_of(self, length: int) -> None:
        e, first = self.epoch, self.next
        s = [make_step(n, self.w, epoch=e) for n in range(first, first + length)]
        if s:
            self.first_steps[e] = first
        last = first + length - 1 if s else None
        end = make_end(e, (last,) * self.w, length)
        self.state.publish(publication(s, epoch=e + 1, rows=0, next_step=first + length,
                                       ends=(end,)), fence=self.gen)
        self.next += length
        self.epoch += 1


def test_trimming_follows_the_slowest_rank_by_epochs_over_a_long_run(new_state):
    st = new_state(world_size=3)
    plan = Plan(st, 3)
    rng = random.Random(5)
    acked = [-1, -1, -1]
    for _ in range(40):
        plan.epoch_of(rng.randint(3, 15))
        for _ in range(rng.randint(1, 6)):
            r = rng.randrange(3)
            step = min(plan.next - 1, acked[r] + rng.randint(0, 12))
            st.ack(r, step)
            acked[r] = max(acked[r], step)
            tt = st.trimmed_through()
            assert tt == expected_trimmed(plan.first_steps, min(acked))
            assert st.get_step(tt + 1) is not None or tt + 1 > plan.next - 1
            if tt >= 0:
                assert st.get_step(tt) is None
    tt = st.trimmed_through()
    assert tt > 100  # the run was long enough to trim a lot
    retained = list(st.client.scan_iter(match=st.keys.base + "step:*", count=1000))
    assert len(retained) == plan.next - 1 - tt
    # A trimmed step can still be republished identically (its digest stays), never otherwise.
    assert st.publish(publication([make_step(3, 3)], epoch=plan.epoch, rows=0,
                                  next_step=plan.next), fence=plan.gen) == 0
    with pytest.raises(StepConflict, match="3"):
        st.publish(publication([make_step(3, 3, salt="q")], epoch=plan.epoch, rows=0,
                               next_step=plan.next), fence=plan.gen)


def test_grouped_acks_trim_as_single_acks_do(new_state):
    """A replica records its streams' acks in grouped calls (`ack_many`, one script for all of
    them): the slowest cursor after the whole group decides what is trimmed, and a refused ack
    in the group (ahead of the plan) changes nothing."""
    st = new_state(world_size=3)
    plan = Plan(st, 3)
    rng = random.Random(11)
    acked = [-1, -1, -1]
    for _ in range(30):
        plan.epoch_of(rng.randint(3, 12))
        group = []
        for r in rng.sample(range(3), rng.randint(1, 3)):
            group.append((r, min(plan.next - 1, acked[r] + rng.randint(0, 12))))
        st.grant([(0, r, plan.next - 1) for r in range(3)])
        out = st.ack_many([RankAck(r, f"c{r}", step) for r, step in group]
                          + [RankAck(0, "c0", plan.next + 5)], 60)
        assert out[:-1] == [None] * len(group) and "published" in str(out[-1])
        for r, step in group:
            acked[r] = max(acked[r], step)
        assert st.acked_all() == acked
        tt = st.trimmed_through()
        assert tt == expected_trimmed(plan.first_steps, min(acked))
        assert st.get_step(tt + 1) is not None or tt + 1 > plan.next - 1
    assert st.trimmed_through() > 50


def test_an_epoch_without_steps_does_not_stop_trimming(new_state):
    """Quota mode can close an epoch with no step (everything carried over to the next one)."""
    st = new_state(world_size=2)
    plan = Plan(st, 2)
    for length in (4, 0, 3, 5, 0, 0, 2, 4):
        plan.epoch_of(length)
    for first in sorted(plan.first_steps.values()):
        for r in range(2):
            st.ack(r, first)
        assert st.trimmed_through() == expected_trimmed(plan.first_steps, first)
    assert st.trimmed_through() == plan.first_steps[6] - 1  # keeps epochs 6 and 7


def test_trimming_catches_up_64_steps_per_ack(new_state):
    """Acks that jump whole long epochs trim at most 64 steps per call (bounded script time);
    later acks finish the job."""
    st = new_state(world_size=1)
    plan = Plan(st, 1)
    for _ in range(4):
        plan.epoch_of(150)
    st.ack(0, 449)  # epochs 0, 1 and 2 done: keep 2 and 3, i.e. trim through 299
    assert st.trimmed_through() == 63
    seen = [63]
    while st.trimmed_through() < 299:
        st.ack(0, 449)
        seen.append(st.trimmed_through())
    assert seen == [63, 127, 191, 255, 299]


def test_trimming_keeps_what_the_ranks_of_an_ended_world_still_drain(new_state):
    """After a reconfiguration the new world's cursors start past the old world's steps; the
    old world's live ranks still drain from their own cursors (`trim_floor`), so however far the
    new world gets, those steps stay readable."""
    st = new_state(world_size=2)
    gen = st.claim_producer("producer", LONG)
    st.publish(publication([make_step(n, 2) for n in range(6)], rows=6), fence=gen)
    for r, a in ((0, 1), (1, 0)):
        st.claim_rank(r, f"c{r}", LONG)
        st.ack(r, a)
    st.grant([(0, 0, 5), (0, 1, 5)])
    assert st.scale(ScaleRequest(3)).previous.last_steps == (5, 5)
    nxt = 6
    for e, length in ((0, 3), (1, 4), (2, 4)):  # epoch 0 goes on in the new world
        s = [make_step(n, 3, epoch=e) for n in range(nxt, nxt + length)]
        nxt += length
        st.publish(publication(s, epoch=e + 1, rows=0, next_step=nxt, world=1,
                               ends=(make_end(e, (nxt - 1,) * 3, nxt if e == 0 else length),)),
                   fence=gen)
    for r in range(3):
        st.ack(r, nxt - 1)
    assert st.trimmed_through() == 0  # only what every cursor passed: step 0
    assert all(st.get_step(n) is not None for n in range(1, 6))


@pytest.mark.parametrize("gone", ["left", "lapsed"])
def test_trimming_resumes_once_the_ended_worlds_ranks_are_gone(new_state, gone):
    """The old world's draining ranks hold trimming back only while they may still read their
    steps: once each got its END(reconfigure) (`rank_left`) or lost its lease, the plan is
    trimmed by the new world's epochs again, so Redis holds O(two epochs) of plan after any
    number of reconfigurations (#40 item 6)."""
    lease = LONG if gone == "left" else 0.3
    st = new_state(world_size=2)
    gen = st.claim_producer("producer", LONG)
    st.publish(publication([make_step(n, 2) for n in range(6)], rows=6), fence=gen)
    for r, a in ((0, 1), (1, 0)):
        st.claim_rank(r, f"c{r}", lease)
        st.ack(r, a)
    st.grant([(0, 0, 5), (0, 1, 5)])
    assert st.scale(ScaleRequest(3)).previous.last_steps == (5, 5)
    first_steps, nxt = {0: 0}, 6
    for e, length in ((0, 3), (1, 4), (2, 4), (3, 5)):  # epoch 0 goes on in the new world
        s = [make_step(n, 3, epoch=e) for n in range(nxt, nxt + length)]
        first_steps.setdefault(e, nxt)
        nxt += length
        st.publish(publication(s, epoch=e + 1, rows=0, next_step=nxt, world=1,
                               ends=(make_end(e, (nxt - 1,) * 3, nxt if e == 0 else length),)),
                   fence=gen)
    for r in range(3):
        st.ack(r, nxt - 1)
    assert st.trimmed_through() == 0  # the draining ranks may still read steps 1-5
    if gone == "left":
        for r in range(2):
            st.rank_left(0, r, f"c{r}")
    else:
        time.sleep(lease + 0.2)
        assert all(h.lapsed for h in st.rank_health()[:2])
    st.ack(0, nxt - 1)  # the next ack trims
    assert st.trimmed_through() == expected_trimmed(first_steps, nxt - 1) == first_steps[2] - 1
    assert st.get_step(first_steps[2]) is not None and st.get_step(first_steps[2] - 1) is None
