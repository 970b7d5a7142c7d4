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
from pipeline.planner.types import MeasuredSample, Step
from pipeline.preprocess.array_source import ArraySource
from pipeline.preprocess.sample import QuarantinedRecord

FeedItem = MeasuredSample | QuarantineEntry


def quarantine_entry(record: QuarantinedRecord) -> QuarantineEntry:
    return QuarantineEntry(record.sample_id, record.reason, record.detail)


class MeasuredFeed(Protocol):
    def iter_epoch(self, epoch: int, start_row: int = 0) -> Iterator[FeedItem]:
        """One item per source row of `epoch` from row `start_row` on, in source order; the
        same rows in the same order every time the epoch is read."""

    def stage(self, steps: Sequence[Step]) -> None:
        """Make the payloads of these steps' batches reachable by (step, rank) before they are
        published. Called with steps of samples this feed yielded (or restored ones)."""

    def release(self, keys: Sequence[tuple[int, int]]) -> None:
        """(step, rank) batches every interested party acknowledged: drop their payloads."""

    def discard(self, samples: Sequence[MeasuredSample]) -> None:
        """Samples the planner set aside: they will never be staged, drop their payloads."""

    def close(self) -> None: ...


class ArrayFeed:
    """An `ArraySource` as a feed: metadata from the in-memory samples, nothing to stage."""

    def __init__(self, source: ArraySource, collate: str) -> None:
        self.source = source
        self.collate = collate

    def iter_epoch(self, epoch: int, start_row: int = 0) -> Iterator[FeedItem]:
        for item in self.source.iter_epoch(epoch, start_row):
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
