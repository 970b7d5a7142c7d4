"""`RankCursor` decides which END is its own from the END's world stamp, not from its length
(the guess `len(end.final_step) == world_size` breaks once two worlds have the same size,
4 -> 2 -> 4, and when a rank restored into a smaller world meets its epoch's END of the
larger one)."""

from __future__ import annotations

from pipeline.jobstate.worlds import PlanHead
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, Step, StepInfo, WorldStamp
from pipeline.service.rank_cursor import End, RankCursor, Reconfigure, Send, Wait


class Plan:
    def __init__(self, head: PlanHead, steps: dict[int, Step], ends: dict[int, EpochEnd]):
        self._head, self.steps, self.ends = head, steps, ends

    def head(self) -> PlanHead:
        return self._head

    def step_for(self, n: int, rank: int) -> Step | None:
        s = self.steps.get(n)
        return None if s is None else Step(s.epoch, s.step, tuple(
            b for b in s.batches if b.rank == rank), s.info, s.world)

    def epoch_end(self, epoch: int) -> EpochEnd | None:
        return self.ends.get(epoch)


def step(n: int, epoch: int, world: WorldStamp) -> Step:
    return Step(epoch, n, tuple(Batch(r, (MeasuredSample(f"{n}:{r}", 5),), 5)
                                for r in range(world.size)), StepInfo(world.size, 5 * world.size),
                world)


def test_a_stale_rank_of_the_first_world_never_takes_the_end_of_a_later_world_of_its_size():
    """4 -> 2 -> 4: a rank of world 0 that was gone at the first switch (its stream still open,
    its client frozen) wakes after the second one. Its last step is 3; epoch 0 ended in world 2
    without a step for anyone. That END is world 2's: the rank must get END(reconfigure), not
    an END of 4 ranks that merely has its world's size."""
    w0, w2 = WorldStamp(0, 4), WorldStamp(2, 4)
    plan = Plan(PlanHead(published_through=9, generation=2, world_size=4, first_step=10),
                {n: step(n, 0, w0) for n in range(6)},
                {0: EpochEnd(0, (None,) * 4, 10, (), w2)})
    cursor = RankCursor(rank=3, epochs=1, pos=4, epoch=0, last_sent=3, world=0, limit=3,
                        next_world_size=2)
    assert cursor.next(plan) == Reconfigure(2)


def test_a_rank_restored_into_a_smaller_world_gets_its_epochs_end_of_the_larger_one():
    """4 -> 2 after epoch 0 ended (END of 4 ranks at step 9): a rank of the new world restored
    from a state at step 10 (epoch 0, its END not yet taken) gets that END at once, before the
    new world published anything; by length it would wait for the next epoch's first step."""
    w0 = WorldStamp(0, 4)
    end0 = EpochEnd(0, (9, 9, 9, 9), 10, (), w0)
    plan = Plan(PlanHead(published_through=9, generation=1, world_size=2, first_step=10),
                {n: step(n, 0, w0) for n in range(10)}, {0: end0})
    cursor = RankCursor(rank=1, epochs=2, pos=10, epoch=0, last_sent=9, world=1)
    assert cursor.next(plan) == End(end0)
    cursor.ended(end0)
    assert cursor.next(plan) == Wait()  # epoch 1 of the new world: nothing published yet
    assert end0.final_for(1) == 9 and end0.final_for(3) == 9
    assert EpochEnd(0, (9, 9), 10, (), WorldStamp(1, 2)).final_for(3) is None


def test_steps_carry_their_world_to_the_wire_size():
    w1 = WorldStamp(1, 2)
    plan = Plan(PlanHead(published_through=10, generation=1, world_size=2, first_step=10),
                {10: step(10, 0, w1)}, {})
    action = RankCursor(rank=0, epochs=1, pos=10, epoch=0, world=1).next(plan)
    assert isinstance(action, Send) and action.step.world == w1
