"""One rank's stream as a small state machine: where it stands in the plan and what comes next.

No gRPC here: the servicer asks `next(plan)` and performs the action (send a batch when the
client has credit, send an END, wait). Positions: `pos` is the next global step to consider,
`micro` its next micro-batch to send (global steps: a rank's batches of one step go one wire
Batch each, in micro-batch order; a stream always opens at a step's first), `epoch` the first
epoch whose END has not been sent, `last_sent` the highest step sent (a step counts as sent
from its first micro-batch on).

Join mode leaves a rank out of the steps after its final one; once the rank has acknowledged
everything it was sent before an epoch's END, it is acknowledged through that epoch's last step
(`end_ack_due`), so the state can trim steps it has no batch in.

Worlds (docs/elastic.md): a cursor belongs to one world (`world`, its generation). It never
reads past the plan of its world: when the plan's head names a later world it asks for its
boundary (`Boundary`); once it knows its last step (`limit`) it runs through it, delivers the
ENDs of epochs that ended in its world (an END knows its world: `EpochEnd.world`), then
`Reconfigure`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pipeline.jobstate.worlds import PlanHead
from pipeline.planner.types import EpochEnd, Step


class PlanReader(Protocol):
    def head(self) -> PlanHead: ...

    def step_for(self, n: int, rank: int) -> Step | None: ...

    def epoch_end(self, epoch: int) -> EpochEnd | None: ...


@dataclass(frozen=True)
class Send:
    step: Step  # holds the rank's batches (its micro-batches of a global step)
    micro: int = 0  # which of them goes now


@dataclass(frozen=True)
class End:
    end: EpochEnd


@dataclass(frozen=True)
class Wait:
    pass


@dataclass(frozen=True)
class Missing:
    step: int  # published, but no longer in the state (trimmed)


@dataclass(frozen=True)
class Finished:
    pass


@dataclass(frozen=True)
class Boundary:
    pass  # the cursor's world ended: learn its last step (`RankCursor.limit`) first


@dataclass(frozen=True)
class Reconfigure:
    world_size: int  # the rank ran its world's last step: END(reconfigure), the new size


Action = Send | End | Wait | Missing | Finished | Boundary | Reconfigure


@dataclass
class RankCursor:
    rank: int
    epochs: int
    pos: int
    epoch: int
    last_sent: int = -1
    # (trigger, target): once the rank acks `trigger`, ack it through `target`.
    end_acks: list[tuple[int, int]] = field(default_factory=list)
    world: int = 0  # the world generation this cursor runs in
    micro: int = 0  # the next micro-batch of step `pos` to send
    limit: int | None = None  # this rank's last step, once its world ended
    next_world_size: int = 0  # the world after it (once it ended)

    def next(self, plan: PlanReader) -> Action:
        while True:
            if self.epoch >= self.epochs:
                return Finished()
            head = plan.head()
            through = head.published_through
            if self.limit is None:
                if head.generation > self.world:
                    return Boundary()
            else:
                through = min(through, self.limit)
            if self.pos <= through:
                step = plan.step_for(self.pos, self.rank)
                if step is None:
                    return Missing(self.pos)
                if step.epoch < self.epoch:  # a step of an epoch this rank has finished
                    self.pos += 1
                    continue
                if step.epoch > self.epoch:  # the current epoch ended before this step
                    end = plan.epoch_end(self.epoch)
                    return Wait() if end is None else End(end)
                if step.batches:
                    return Send(step, self.micro)
                self.pos += 1  # join mode: the rank is absent from this step
                continue
            end = plan.epoch_end(self.epoch)
            if end is not None and end.world.generation > self.world:
                end = None  # the epoch ended in the next world, after this rank's last step
            if end is not None and end.last_step < self.pos:
                return End(end)
            if self.limit is not None and self.pos > self.limit:
                return Reconfigure(self.next_world_size)
            return Wait()

    def sent(self, step: Step, micro: int = 0) -> None:
        """Micro-batch `micro` of the rank's batches in `step` was sent."""
        self.last_sent = max(self.last_sent, step.step)
        if micro + 1 < len(step.micros_for(self.rank)):
            self.pos, self.micro = step.step, micro + 1
        else:
            self.pos, self.micro = step.step + 1, 0

    def ended(self, end: EpochEnd) -> None:
        """The END of `end.epoch` was sent."""
        self.epoch = end.epoch + 1
        last = end.last_step
        if last > self.last_sent:  # steps after this rank's last batch: ack them when done
            self.end_acks.append((self.last_sent, last))

    def end_ack_due(self, acked: int) -> int | None:
        """The step to acknowledge the rank through, now that it acked `acked` (None: none)."""
        ready = [t for trig, t in self.end_acks if trig <= acked]
        if not ready:
            return None
        self.end_acks = [(trig, t) for trig, t in self.end_acks if trig > acked]
        target = max(ready)
        return target if target > acked else None

    @property
    def job_done(self) -> bool:
        return self.epoch >= self.epochs
