"""A Ray-preprocessed job's rows processed in this process: the feed of the bootstrap producer.

While a `serve` replica's Ray starts (5-10 s on a small machine), the job's first steps are
planned from rows preprocessed here, by the very `Processor` the Ray tasks run (same job, epoch,
seed: byte-identical samples), so the first batch does not wait for Ray. The payloads of staged
batches stay in this process (`staged`), where this replica's `RayPayloads` finds them; any
other replica rebuilds them by id. Once Ray is up the bootstrap producer stops, its lease goes
to the job's producer actor, which resumes from the checkpoint (producer/hosting.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence

from pipeline.config import TrainingJobConfig
from pipeline.order.cursor import OrderCursor
from pipeline.order.job_order import JobOrder
from pipeline.planner.types import MeasuredSample, Step
from pipeline.preprocess.block_reader import read_block
from pipeline.preprocess.process import Processor
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.producer.feed import FeedItem, quarantine_entry

CHUNK_ROWS = 32  # small parts: the first step needs a few budgets of samples (planner ramp)


class LocalFeed:
    def __init__(self, job: TrainingJobConfig) -> None:
        self.job = job
        self.collate = job.batching.collate
        self._lock = threading.Lock()
        # Yielded, not yet staged or discarded, by id in arrival order: quota mode can carry
        # a sample of epoch e-1 next to the same id of epoch e (told apart by their sizes).
        self._fed: dict[str, list[ProcessedSample]] = {}
        self._staged: dict[tuple[int, int], list[ProcessedSample]] = {}
        self._order: JobOrder | None = None

    def iter_epoch(self, epoch: int, cursor: OrderCursor) -> Iterator[FeedItem]:
        """The epoch's order (the job's, as the Ray feed reads it) from the cursor on: each
        block read raw (a bounded number of rows), then processed here in small parts."""
        if self._order is None:
            self._order = JobOrder(self.job.source, self.job.seed)
        order = self._order
        files = [lay.files for lay in order.layouts]
        source_of = {f.source: i for i, lay in enumerate(order.layouts) for f in lay.files}
        processor = Processor(self.job, epoch)
        for block in order.epoch(epoch, cursor).blocks(cursor.position):
            rows = read_block(block, files, max(0, cursor.position - block.start))
            for k in range(0, len(rows), CHUNK_ROWS):
                for item in processor.process_rows(rows[k:k + CHUNK_ROWS]):
                    if isinstance(item, QuarantinedRecord):
                        yield quarantine_entry(item)
                        continue
                    with self._lock:
                        self._fed.setdefault(item.sample_id, []).append(item)
                    yield dataclasses.replace(item.measured(self.collate),
                                              source=source_of[item.source])

    def _take(self, s: MeasuredSample) -> ProcessedSample | None:
        held = self._fed.get(str(s.sample_id), [])
        for i, p in enumerate(held):
            if p.measured(self.collate) == dataclasses.replace(s, source=0):
                del held[i]
                if not held:
                    del self._fed[str(s.sample_id)]
                return p
        return None

    def stage(self, steps: Sequence[Step]) -> None:
        with self._lock:
            for step in steps:
                for rank in step.ranks():  # all of the rank's micro-batches together
                    # A sample restored from a checkpoint was read by an earlier producer: it
                    # is not here, and the replicas rebuild it by id.
                    got = [self._take(s) for s in step.rank_samples(rank)]
                    if all(p is not None for p in got):
                        self._staged[(step.step, rank)] = got  # type: ignore[assignment]

    def staged(self, step: int, rank: int) -> list[ProcessedSample] | None:
        """The payloads of (step, rank) if this feed staged them."""
        with self._lock:
            return self._staged.get((step, rank))

    def release(self, keys: Sequence[tuple[int, int]]) -> None:
        with self._lock:
            for k in keys:
                self._staged.pop(k, None)

    def discard(self, samples: Sequence[MeasuredSample]) -> None:
        with self._lock:
            for s in samples:
                self._take(s)

    def close(self) -> None:
        """Stop feeding; staged payloads stay for this replica's streams (bounded by the
        producer's back-pressure: `max_ahead` steps) until `drop`."""
        with self._lock:
            self._fed.clear()

    def drop(self) -> None:
        with self._lock:
            self._fed.clear()
            self._staged.clear()
