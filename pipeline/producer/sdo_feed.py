"""An SDO job's feed: each epoch's visits, in traversal order, over the job's Ray preprocessing.

Runs in the producer actor beside `RayFeed`, which it wraps. The producer loop is unchanged: it
reads items, plans and publishes; only what an epoch's items are differs (docs/sdo.md, "Served").

Per epoch, in `iter_epoch`:
1. The whole epoch is preprocessed by the `RayFeed` (payloads stay in Ray's object store, only
   metadata comes here): traversal order is not source order, so visits can be ordered only
   once every sample of the epoch is measured.
2. Once per producer, the organization: restored from the job's record in Redis (graph members,
   window, repeat gap), or, for the job's first epoch, built: embeddings by the Ray Data stage
   (cached beside the dataset, so computed once per dataset), the KNN graph over the epoch's
   samples that have a vector (cached too), and the record saved.
3. The epoch's visits: read back from Redis, or planned from the stored ledger and saved with
   the ledger after it (`epoch_visits_for`). Both writes are fenced by the producer's lease
   generation and happen before any step of the epoch can be published, so a restarted
   producer, or a replay, plans the very same epoch.
4. The items: the epoch's quarantined records (preprocessing's, then the embedding stage's),
   then one `MeasuredSample` per visit under its visit id (`<sample_id>#<k>`). `start_row`
   skips the items a previous producer already fed (the planner checkpoint counts items).

Payloads: the batch row of a visit is its sample's row, staged by the `RayFeed` from the block
by reference for a sample's first remaining visit, rebuilt by id for a second one or after a
restart (the same seeded preprocessing: byte-identical). A sample with no visit left in the
epoch is discarded at once, so its block is not held for nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.config import TrainingJobConfig
from pipeline.jobstate.interface import QuarantineEntry
from pipeline.order.cursor import OrderCursor
from pipeline.organization.epoch_visits import split_visit_id
from pipeline.organization.ledger_store import epoch_visits_for
from pipeline.organization.organizer import (
    Organization,
    job_lookahead,
    organize,
    restore_organization,
)
from pipeline.planner.types import MeasuredSample, Step
from pipeline.producer.feed import FeedItem, quarantine_entry
from pipeline.producer.ray_feed import RayFeed

if TYPE_CHECKING:
    from pipeline.coordinator.redis_ledger_store import RedisLedgerStore

log = logging.getLogger(__name__)


def reading_job(job: TrainingJobConfig) -> TrainingJobConfig:
    """The job as an SDO feed reads it: in file order. Its visits are its order (traversal),
    and the epoch is read whole before it is ordered, so a shuffle would buy nothing."""
    return job.model_copy(update={"source": job.source.model_copy(update={"shuffle": False})})


def planning_job(job: TrainingJobConfig) -> TrainingJobConfig:
    """The job as its producer plans it: an SDO job's planner window is the one `locality`
    asks for (the registered config, and so its hash, stay the job's own)."""
    if job.organization.kind != "sdo":
        return job
    batching = job.batching.model_copy(update={"lookahead_tokens": job_lookahead(job)})
    return job.model_copy(update={"batching": batching})


def _sample_of(visit: MeasuredSample) -> MeasuredSample:
    """The sample whose payload a visit carries (same measured size)."""
    return dataclasses.replace(visit, sample_id=split_visit_id(str(visit.sample_id))[0])


class SdoFeed:
    """`MeasuredFeed` of an SDO job. `fence()` gives the producer's lease generation, which
    every write of SDO state to `store` carries."""

    def __init__(self, job: TrainingJobConfig, inner: RayFeed, store: RedisLedgerStore, *,
                 fence: Callable[[], int | None]) -> None:
        self.job = job
        self.inner = inner
        self.store = store
        self._fence = fence
        self._org: Organization | None = None
        self._embedding_quarantine: list[QuarantineEntry] = []

    def _writer(self) -> RedisLedgerStore:
        generation = self._fence()
        if generation is None:
            raise RuntimeError(f"job {self.job.job_id}: SDO state written without a lease")
        return self.store.fenced(generation)

    def _organization(self, epoch: int, measured: Sequence[MeasuredSample]) -> Organization:
        if self._org is not None:
            return self._org
        from pipeline.organization.embed_stage import embed_dataset

        emb = embed_dataset(self.job)  # a cache read after the first time on this dataset
        self._embedding_quarantine = [quarantine_entry(r) for r in emb.table.quarantined]
        record = self.store.organization(self.job.job_id)
        if record is not None:
            self._org = restore_organization(self.job, emb.table, record, emb.path)
        elif epoch == 0:
            self._org = organize(self.job, emb.table, measured, emb.path)
            self._writer().save_organization(self.job.job_id, self._org.record())
        else:
            raise RuntimeError(f"job {self.job.job_id}: epoch {epoch} but no SDO organization "
                               "is recorded (its epoch 0 was never planned)")
        g = self._org.graph
        log.info("job %s: SDO graph of %d samples (k=%d, %s), window %d tokens, repeat gap %d",
                 self.job.job_id, g.size, g.k, "restored" if record else "built",
                 self._org.lookahead_tokens, self._org.repeat_gap)
        return self._org

    def iter_epoch(self, epoch: int, cursor: OrderCursor) -> Iterator[FeedItem]:
        start_row = cursor.position
        measured: dict[str, MeasuredSample] = {}
        quarantined: list[QuarantineEntry] = []
        for item in self.inner.iter_epoch(epoch, OrderCursor()):
            if isinstance(item, QuarantineEntry):
                quarantined.append(item)
            else:
                measured[str(item.sample_id)] = item
        org = self._organization(epoch, list(measured.values()))
        cfg = self.job.organization
        visits = epoch_visits_for(self._writer(), self.job.job_id, org.graph, epoch,
                                  seed=self.job.seed, coverage_epochs=cfg.coverage_epochs,
                                  visits_per_epoch=cfg.visits_per_epoch,
                                  repeat_gap=org.repeat_gap)
        seen = {q.sample_id for q in quarantined}
        quarantined += [q for q in self._embedding_quarantine if q.sample_id not in seen]
        items: list[FeedItem] = list(quarantined)
        missing = 0
        for v in visits.visits:
            m = measured.get(str(v.sample_id))
            if m is None:  # quarantined in this epoch only: its record is listed above
                missing += 1
                continue
            items.append(dataclasses.replace(m, sample_id=v.visit_id))
        if missing:
            log.warning("job %s: %d visit(s) of epoch %d have no sample this epoch",
                        self.job.job_id, missing, epoch)
        left = Counter(str(_sample_of(s).sample_id) for s in items[start_row:]
                       if isinstance(s, MeasuredSample))
        idle = [m for sid, m in measured.items() if sid not in left]
        if idle:
            self.inner.discard(idle)
        yield from items[start_row:]

    def stage(self, steps: Sequence[Step]) -> None:
        self.inner.stage([dataclasses.replace(step, batches=tuple(
            dataclasses.replace(b, samples=tuple(_sample_of(s) for s in b.samples))
            for b in step.batches)) for step in steps])

    def release(self, keys: Sequence[tuple[int, int]]) -> None:
        self.inner.release(keys)

    def discard(self, samples: Sequence[MeasuredSample]) -> None:
        self.inner.discard([_sample_of(s) for s in samples])

    def refs(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], Any]:
        return self.inner.refs(keys)

    def held(self) -> dict[str, int]:
        return self.inner.held()

    def close(self) -> None:
        self.inner.close()
