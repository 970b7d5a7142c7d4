"""How a replica gets the payloads of one rank's batch: by reference, and only that rank's.

`PayloadSource.fetch(step, rank)` returns the rank's samples in batch order (of a global step:
of all its micro-batches, in micro-batch order: one fetch serves them all), byte-identical
whenever and wherever it is called (restarts redeliver identical batches).
- `ArrayPayloads`: the in-memory `ArraySource` the job was planned from.
- `RayPayloads`: first the batches a bootstrap producer of this replica staged in this process
  (`LocalFeed`, while Ray started), then asks the job's producer actor for the object holding
  this (step, rank) batch
  (the references of concurrent requests travel in one actor call) and reads it through Ray's
  object manager. When the producer does not hold it — published by a previous producer,
  released after the rank acknowledged it (a trainer rewinding to an older checkpoint), or the
  producer is gone — the samples are rebuilt by id with `SampleStore` (the same `Processor`,
  same seed: byte-identical), from the epoch of the step or the one before (a sample carried
  over by quota mode, or returned by a reconfiguration after its epoch's END, is planned in the
  next epoch: the producer rebuilds the same way). The Ray calls of a fetch (the producer's
  reference, then the object) share one bound, `timeout_s`: a frozen producer, Ray head or
  object store makes the replica rebuild by id instead (and skip Ray for a while), never wait
  forever, and the rebuild still fits the stream's bound (`stream_io`). An SDO job
  plans visits (`<sample_id>#<k>`): each carries the payload of its sample (`payload_id_of`).
Both count what they fetched per rank (`fetched_by_rank`), so tests and operators can check that
a replica never reads payloads of ranks it does not serve.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.config import TrainingJobConfig
from pipeline.planner.types import MeasuredSample, SampleId, Step
from pipeline.preprocess.array_source import ArraySource
from pipeline.preprocess.sample import ProcessedSample
from pipeline.service.coalescer import Coalescer

if TYPE_CHECKING:
    from pipeline.producer.local_feed import LocalFeed

log = logging.getLogger(__name__)


class PayloadSource(Protocol):
    blocking: bool  # fetch may wait on I/O (an event loop calls it in a thread then)

    def fetch(self, step: Step, rank: int) -> list[ProcessedSample]: ...

    def fetched_by_rank(self) -> dict[int, int]:
        """Samples fetched so far, per rank."""

    def close(self) -> None: ...


def _matches(p: ProcessedSample, s: MeasuredSample, collate: str, payload_id: str) -> bool:
    return p.measured(collate) == MeasuredSample(payload_id, s.num_tokens,
                                                 s.num_visual_tokens, s.loss_tokens)


def payload_id_of(job: TrainingJobConfig) -> Callable[[SampleId], str]:
    """The sample whose payload a planned id names: the id itself, or for an SDO job the
    sample of a visit (`<sample_id>#<k>`)."""
    if job.organization.kind == "sdo":
        from pipeline.organization.epoch_visits import split_visit_id

        return lambda planned: split_visit_id(str(planned))[0]
    return str


class _Counting:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fetched: Counter = Counter()

    def _count(self, rank: int, n: int) -> None:
        with self._lock:
            self._fetched[rank] += n

    def fetched_by_rank(self) -> dict[int, int]:
        with self._lock:
            return dict(self._fetched)


class ArrayPayloads(_Counting):
    blocking = False

    def __init__(self, source: ArraySource) -> None:
        super().__init__()
        self.source = source

    def fetch(self, step: Step, rank: int) -> list[ProcessedSample]:
        out = [self.source.get(str(s.sample_id), step.epoch) for s in _samples(step, rank)]
        self._count(rank, len(out))
        return out

    def close(self) -> None:
        pass


class RayPayloads(_Counting):
    blocking = True

    def __init__(self, job: TrainingJobConfig, local: LocalFeed | None = None, *,
                 timeout_s: float = 10.0) -> None:
        super().__init__()
        self.job = job
        self.local = local
        self.timeout_s = timeout_s
        self._ray_down_until = 0.0  # Ray did not answer: rebuild by id until then
        self.collate = job.batching.collate
        self.payload_id = payload_id_of(job)
        self._actor_lock = threading.Lock()
        self._actor: Any = None
        self._refs = Coalescer(self._refs_many)
        self._store: Any = None
        self._store_lock = threading.Lock()
        self.rebuilt = 0  # samples rebuilt by id (not served from the object store)

    def _producer(self) -> Any:
        from pipeline.producer.actor import find_producer

        with self._actor_lock:
            if self._actor is None:
                self._actor = find_producer(self.job.job_id)
            return self._actor

    def _refs_many(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        ray = _ray_if_up()
        if time.monotonic() < self._ray_down_until or ray is None:
            return [None] * len(keys)  # (ray.get_actor would start a Ray of its own)
        try:
            actor = self._producer()
            if actor is None:
                return [None] * len(keys)
            got = ray.get(actor.batch_refs.remote(list(keys)), timeout=self.timeout_s)
        except Exception as exc:  # the producer died or restarts: rebuild, find it again later
            log.debug("job %s: producer unreachable for payload refs", self.job.job_id,
                      exc_info=True)
            with self._actor_lock:
                self._actor = None
            self._ray_unanswered(exc)
            return [None] * len(keys)
        return [got.get(tuple(k)) for k in keys]

    def _ray_unanswered(self, exc: BaseException) -> None:
        """A Ray call that timed out: Ray (its head, the object store) may be frozen; rebuild
        by id without asking it for a while."""
        import ray

        if isinstance(exc, ray.exceptions.GetTimeoutError):
            self._ray_down_until = time.monotonic() + self.timeout_s
            log.warning("job %s: Ray did not answer within %gs; payloads are rebuilt by id for "
                        "the next %gs", self.job.job_id, self.timeout_s, self.timeout_s)

    def fetch(self, step: Step, rank: int) -> list[ProcessedSample]:
        from pipeline.preprocess.rows import from_table

        samples = _samples(step, rank)
        here = self.local.staged(step.step, rank) if self.local is not None else None
        if here is not None:
            self._count(rank, len(here))
            return here
        deadline = time.monotonic() + self.timeout_s
        ref = self._refs((step.step, rank))
        if ref is not None:  # (only when Ray is up: `_refs_many`)
            import ray

            try:
                left = max(0.0, deadline - time.monotonic())
                items = from_table(ray.get(ref, timeout=left))
                if len(items) == len(samples) and all(
                        isinstance(p, ProcessedSample)
                        and _matches(p, s, self.collate, self.payload_id(s.sample_id))
                        for p, s in zip(items, samples, strict=True)):
                    self._count(rank, len(items))
                    return items  # type: ignore[return-value]
                log.error("job %s: staged payload of step %d rank %d does not match its "
                          "plan; rebuilding by id", self.job.job_id, step.step, rank)
            except Exception as exc:  # the object is lost with its owner, or Ray froze: rebuild
                log.info("job %s: payload of step %d rank %d lost; rebuilding by id",
                         self.job.job_id, step.step, rank, exc_info=True)
                self._ray_unanswered(exc)
        out = [self._rebuild(s, step.epoch) for s in samples]
        self._count(rank, len(out))
        return out

    def _rebuild(self, s: MeasuredSample, epoch: int) -> ProcessedSample:
        from pipeline.preprocess.pipeline import SampleStore

        with self._store_lock:
            if self._store is None:
                self._store = SampleStore(self.job)
            store = self._store
        sid = self.payload_id(s.sample_id)
        # A sample of epoch e's plan came from epoch e, or from epoch e-1 (carried over by quota
        # mode, or returned by a reconfiguration after its epoch's END): the one that measures
        # as planned, epoch e first (as the producer's rebuild decides).
        candidates = [e for e in (epoch, epoch - 1) if e >= 0]
        for e in candidates:
            p = store.get(sid, e)
            if _matches(p, s, self.collate, sid):
                self.rebuilt += 1
                return p
        raise LookupError(f"job {self.job.job_id}: no payload of {sid} measuring "
                          f"{s.num_tokens} tokens in epoch(s) {candidates}")

    def close(self) -> None:
        with self._store_lock:
            if self._store is not None:
                self._store.close()
                self._store = None


def _ray_if_up() -> Any:
    """The `ray` module if this process has started or joined Ray, else None. Never imports
    it: `serve` imports Ray on another thread while it starts, and a second importer of the
    same package can be handed the half-imported module (Ray then fails to start)."""
    ray = sys.modules.get("ray")
    is_up = getattr(ray, "is_initialized", None)
    return ray if callable(is_up) and is_up() else None


def _samples(step: Step, rank: int) -> tuple[MeasuredSample, ...]:
    """The rank's samples of the step, over all its micro-batches."""
    if step.batch_for(rank) is None:
        raise LookupError(f"step {step.step} has no batch for rank {rank}")
    return step.rank_samples(rank)
