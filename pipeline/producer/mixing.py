"""A mixture job's producer side: its weights changed at step boundaries, and each source's part
of the plan.

The producer (producer.py) calls it only where its cursor is a checkpoint's (right after it
restored one, right after each publication), so a change starts exactly where the published
plan stands, every rank meets it at one step boundary (steps are global), and a successor
producer makes the same change at the same position:

- `apply`: the schedule's entries whose `from_step` has come, then a `mix` request the cursor
  has not applied yet, each a change of the cursor's mixture at its position
  (`JobOrder.change`); the producer then reads the epoch again from there;
- `tally`: what the steps just published hold of each source, and the records quarantined per
  source, added to the cursor (so the counts survive a restart with the checkpoint);
- `report`: each source's samples, loss tokens, quarantined records and target share this
  epoch, for `status` (`JobState.set_source_status`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

from pipeline.config import TrainingJobConfig
from pipeline.errors import StateError
from pipeline.jobstate.interface import JobState, QuarantineEntry, SourceShare, SourceStatus
from pipeline.order.cursor import OrderCursor
from pipeline.order.job_order import JobOrder
from pipeline.planner.types import Batch
from pipeline.preprocess.process import split_sample_id

log = logging.getLogger(__name__)


class Mixing:
    def __init__(self, job: TrainingJobConfig, state: JobState, order: JobOrder) -> None:
        self.job, self.state, self.order = job, state, order
        self._source_of = {f.source: i for i, lay in enumerate(order.layouts) for f in lay.files}

    @classmethod
    def for_job(cls, job: TrainingJobConfig, state: JobState, feed: object) -> Mixing | None:
        """The job's mixing, None for a job without a mixture (one source: nothing to mix).
        Shares the feed's order when it has one (building it reads every file's index)."""
        if job.source.mixture is None:
            return None
        order = getattr(feed, "order", None)
        return cls(job, state, order if isinstance(order, JobOrder)
                   else JobOrder(job.source, job.seed))

    @property
    def names(self) -> tuple[str, ...]:
        return self.order.names

    def apply(self, epoch: int, cursor: OrderCursor, next_step: int) -> OrderCursor:
        """The cursor with every change due at this step boundary (the same cursor when none)."""
        schedule = self.job.source.schedule
        while (cursor.schedule_next < len(schedule)
               and next_step >= schedule[cursor.schedule_next].from_step):
            k = cursor.schedule_next
            cursor = self._change(epoch, cursor, schedule[k].weights, next_step,
                                  f"schedule {k}", schedule_next=k + 1)
        request = self.state.mix_request()
        if request is not None and request.seq > cursor.mix_seq:
            cursor = self._change(epoch, cursor, request.weights, next_step,
                                  f"mix {request.seq}", mix_seq=request.seq)
        return cursor

    def _change(self, epoch: int, cursor: OrderCursor, weights: dict[str, float], step: int,
                by: str, **seq: int) -> OrderCursor:
        changed = self.order.change(self.order.epoch(epoch, cursor), cursor, weights,
                                    step=step, by=by, **seq)
        log.info("job %s: mixture %s from step %d (epoch %d, position %d): %s",
                 self.job.job_id, by, step, epoch, cursor.position,
                 ", ".join(f"{n}={w:g}" for n, w in changed.weights_now or ()),
                 extra={"job": self.job.job_id})
        return changed

    def epoch_counts(self, epoch: int, cursor: OrderCursor) -> list[int]:
        """The samples of each source the epoch holds with the cursor's changes (the planner
        keeps each source's share of what is left of them)."""
        return self.order.epoch(epoch, cursor).source_totals()

    def tally(self, cursor: OrderCursor, batches: Iterable[Batch],
              quarantined: Sequence[QuarantineEntry] = (), *, sign: int = 1) -> OrderCursor:
        """The cursor with these published batches and quarantined records counted per source
        (`sign=-1`: batches a reconfiguration voided, published again for the new world)."""
        counts = [list(c) for c in cursor.published] or [[0, 0, 0] for _ in self.names]
        for b in batches:
            if b.filler:
                continue
            for s in b.samples:
                counts[s.source][0] += sign
                counts[s.source][1] += sign * min(s.loss_tokens,
                                                  b.truncated_to.get(s.sample_id, s.num_tokens))
        for q in quarantined:
            source = self._source_of.get(split_sample_id(q.sample_id)[0])
            if source is not None:
                counts[source][2] += 1
        return replace(cursor, published=tuple(tuple(max(0, x) for x in c) for c in counts))

    def report(self, epoch: int, cursor: OrderCursor) -> None:
        """Each source's part of the epoch's plan, for status (best effort: a view)."""
        order = self.order.epoch(epoch, cursor)
        shares = [t.share for t in self.order.targets(order, cursor.position)]
        counts = cursor.published or tuple((0, 0, 0) for _ in self.names)
        if self.job.source.mix_by == "loss_tokens":  # count x mean loss tokens so far
            means = [b / a if a else 0.0 for a, b, _ in counts]
            seen = [m for m in means if m] or [1.0]
            weights = [s * (m or sum(seen) / len(seen)) for s, m in zip(shares, means,
                                                                        strict=True)]
            total = sum(weights) or 1.0
            shares = [w / total for w in weights]
        status = SourceStatus(
            epoch, self.job.source.mix_by,
            tuple(SourceShare(n, a, b, c, round(t, 6))
                  for n, (a, b, c), t in zip(self.names, counts, shares, strict=True)),
            tuple((c.step, c.by, c.weights) for c in cursor.changes))
        try:
            self.state.set_source_status(status)
        except StateError:
            log.debug("job %s: source status not written", self.job.job_id, exc_info=True)
