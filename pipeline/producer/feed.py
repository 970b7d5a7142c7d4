"""What a producer reads: per source row, the measured sample (metadata only) or a quarantine
entry; and how it makes a published step's payloads reachable for the replicas.

`MeasuredFeed` is the small interface the producer loop speaks; its implementations own the
payloads. `ArrayFeed` serves samples already in this process (tests, benchmarks, tokenized
arrays): nothing to stage, replicas read the same `ArraySource`. The Ray implementation
(`ray_feed.RayFeed`) keeps preprocessed blocks in Ray's object store and stages one object per
(step, rank) batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from pipeline.jobstate.interface import QuarantineEntry
from pipeline.order.cursor import OrderCursor
from pipeline.planner.types import MeasuredSample, Step
from pipeline.preprocess.array_source import ArraySource
from pipeline.preprocess.sample import QuarantinedRecord

FeedItem = MeasuredSample | QuarantineEntry


def quarantine_entry(record: QuarantinedRecord) -> QuarantineEntry:
    return QuarantineEntry(record.sample_id, record.reason, record.detail)


class MeasuredFeed(Protocol):
    def iter_epoch(self, epoch: int, cursor: OrderCursor) -> Iterator[FeedItem]:
        """One item per position of `epoch`'s order (pipeline/order/) from `cursor.position`
        on, with the cursor's mixture changes; the same items in the same order every time the
        epoch is read from the same cursor. A sample names its mixture source
        (`MeasuredSample.source`)."""

    def stage(self, steps: Sequence[Step]) -> None:
        """Make the payloads of these steps' batches reachable by (step, rank) before they are
        published. Called with steps of samples this feed yielded (or restored ones)."""

    def release(self, keys: Sequence[tuple[int, int]]) -> None:
        """(step, rank) batches every interested party acknowledged: drop their payloads."""

    def discard(self, samples: Sequence[MeasuredSample]) -> None:
        """Samples the planner set aside: they will never be staged, drop their payloads."""

    def close(self) -> None: ...


class ArrayFeed:
    """An `ArraySource` as a feed: metadata from the in-memory samples, nothing to stage. The
    samples are one source, served in the order the caller gave them (an array already in
    memory is its own order); the cursor's position is an index into them."""

    def __init__(self, source: ArraySource, collate: str) -> None:
        self.source = source
        self.collate = collate

    def iter_epoch(self, epoch: int, cursor: OrderCursor) -> Iterator[FeedItem]:
        for item in self.source.iter_epoch(epoch, cursor.position):
            if isinstance(item, QuarantinedRecord):
                yield quarantine_entry(item)
            else:
                yield item.measured(self.collate)

    def stage(self, steps: Sequence[Step]) -> None:
        pass

    def release(self, keys: Sequence[tuple[int, int]]) -> None:
        pass

    def discard(self, samples: Sequence[MeasuredSample]) -> None:
        pass

    def close(self) -> None:
        self.source.close()
