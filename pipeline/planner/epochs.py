"""A job's epochs through one planner: the order an epoch's samples are fed in, and the
feed-then-end loop that every driver of a whole job shares (`odb-pipeline plan`, SDO's plan,
the planner benchmark, the planner tests). The producer streams its epochs itself, publishing
as it goes, and does not use this.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from pipeline.order.epoch_order import EpochOrder, Segment
from pipeline.order.read_units import rows_layout
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import MeasuredSample, PlanEvent


def epoch_order(samples: Iterable[MeasuredSample], epoch: int, *, seed: int,
                shuffle: bool) -> Iterable[MeasuredSample]:
    """An epoch's samples as given, or (`shuffle`) in the order the service reads a file of
    these rows in (pipeline/order/: seeded by (seed, epoch), units of 64 rows permuted, then
    shuffled in blocks)."""
    if not shuffle:
        return samples
    given = list(samples)
    order = EpochOrder(seed, epoch, [rows_layout("samples", len(given))],
                       [Segment(0, (len(given),))])
    return [given[p.row] for p in order.placements()]


def plan_epoch(planner: StepPlanner, samples: Iterable[MeasuredSample], *,
               last: bool) -> list[PlanEvent]:
    """One epoch: every sample fed in order, then the epoch's end; `last`: the job's last epoch
    (quota mode closes the job instead of carrying the remainder)."""
    events = planner.feed_many(samples)
    events.extend(planner.end_epoch(last_epoch=last))
    return events


def plan_epochs(planner: StepPlanner, epochs: Sequence[Iterable[MeasuredSample]], *,
                close: bool = True) -> Iterator[list[PlanEvent]]:
    """Each epoch's events in turn; `close`: the last epoch is the job's last."""
    for e, samples in enumerate(epochs):
        yield plan_epoch(planner, samples, last=close and e == len(epochs) - 1)
