"""The production feed: Ray Data preprocessing whose payloads stay in Ray's object store.

The producer (a Ray actor) never holds a payload as a Python object. It iterates the epoch's
preprocessed blocks *by reference* (`Dataset.iter_internal_ref_bundles`), in the epoch's order
from the cursor's position (pipeline/order/: the job's order is built once per feed, from the
sources' indexes), and, per block, runs a
tiny task next to the block (`_measure_block`) that returns only the metadata the planner needs
(id, tokens, visual tokens, loss tokens, quarantine reason). When steps are about to be
published, one task (`_gather_batches`) copies each (step, rank) batch's rows out of the blocks
into an object of its own, so a replica fetches exactly the payloads of the ranks it serves.
A block is released as soon as none of its rows is still waiting to be planned; a batch object
once its rank acknowledged the step (`release`).

Samples of the restored planner state (window, pool, carry) were read by a previous producer:
their blocks are gone, so the gather task rebuilds them by id with `SampleStore` (the same
`Processor`, byte-identical). The measured size disambiguates a sample fed twice (quota
carry-over of epoch e-1 next to the same id in epoch e).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from pipeline.config import TrainingJobConfig
from pipeline.jobstate.interface import QuarantineEntry
from pipeline.order.cursor import OrderCursor
from pipeline.order.job_order import JobOrder
from pipeline.planner.types import MeasuredSample, Step
from pipeline.preprocess.sample import IGNORE_INDEX
from pipeline.producer.feed import FeedItem

MEASURE_AHEAD = 4  # metadata tasks in flight ahead of the planner

_Key = tuple[str, int, int, int]  # (sample_id, tokens, visual tokens, loss tokens)


def _key(s: MeasuredSample) -> _Key:
    return (str(s.sample_id), s.num_tokens, s.num_visual_tokens, s.loss_tokens)


@ray.remote(num_cpus=0)
def _measure_block(block: pa.Table, start: int, end: int, collate: str) -> list[tuple]:
    """Per row of block[start:end]: (sample_id, tokens, visual, loss, reason, detail, file)."""
    t = block.slice(start, end - start)
    cols = t.select(["sample_id", "num_tokens", "num_visual_tokens", "quarantine_reason",
                     "quarantine_detail", "source"]).to_pydict()
    out = []
    for i, labels in enumerate(t.column("labels").to_pylist()):
        lab = np.frombuffer(labels, dtype="<i4")
        loss = int(np.count_nonzero(lab != IGNORE_INDEX))
        if collate == "packed" and len(lab) and lab[0] != IGNORE_INDEX:
            loss -= 1
        out.append((cols["sample_id"][i], cols["num_tokens"][i], cols["num_visual_tokens"][i],
                    loss, cols["quarantine_reason"][i], cols["quarantine_detail"][i],
                    cols["source"][i]))
    return out


_stores: dict[str, Any] = {}
_stores_lock = threading.Lock()


def _rebuild(job_json: str, sample_id: str, epoch: int, key: _Key, collate: str) -> pa.Table:
    """One sample re-processed by id (its blocks are gone): the epoch whose measured size
    matches, `epoch` first, then `epoch - 1` (quota carry-over)."""
    from pipeline.preprocess.pipeline import SampleStore
    from pipeline.preprocess.rows import to_table

    with _stores_lock:
        store = _stores.get(job_json)
        if store is None:
            store = _stores[job_json] = SampleStore(TrainingJobConfig.model_validate_json(job_json))
    for e in (epoch, epoch - 1):
        if e < 0:
            continue
        s = store.get(sample_id, e)
        if _key(s.measured(collate)) == key:
            return to_table([s])
    raise LookupError(f"no payload of {sample_id} measuring {key[1:]} in epoch {epoch} or "
                      f"{epoch - 1}")


@ray.remote(num_cpus=0)
def _gather_batches(job_json: str, collate: str, spec: list, *blocks: pa.Table):
    """spec[i] = the rows of output i in batch order: ("b", block arg, row) or
    ("r", sample_id, epoch, key) to rebuild. Each output is a compact table of its own."""
    outs = []
    for rows in spec:
        parts = [blocks[r[1]].slice(r[2], 1) if r[0] == "b"
                 else _rebuild(job_json, r[1], r[2], tuple(r[3]), collate) for r in rows]
        outs.append(pa.concat_tables(parts).combine_chunks())
    return outs[0] if len(outs) == 1 else tuple(outs)


@dataclass
class _Block:
    ref: ray.ObjectRef
    waiting: int  # rows of it not yet staged in a batch


@dataclass
class RayFeed:
    """Ray Data preprocessing of one job as a `MeasuredFeed` (runs inside the producer actor).

    `refs(keys)` answers replicas: the object holding each (step, rank) batch's payload rows,
    None when this producer did not stage it (published by a previous producer, or released)."""

    job: TrainingJobConfig
    _blocks: dict[int, _Block] = field(default_factory=dict)
    _where: dict[_Key, deque[tuple[int, int]]] = field(default_factory=dict)
    _staged: dict[tuple[int, int], ray.ObjectRef] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._job_json = self.job.model_dump_json()
        self._collate = self.job.batching.collate
        self._order: JobOrder | None = None

    @property
    def order(self) -> JobOrder:
        """The job's order (built on first use: it reads every source file's index)."""
        if self._order is None:
            self._order = JobOrder(self.job.source, self.job.seed)
        return self._order

    def iter_epoch(self, epoch: int, cursor: OrderCursor) -> Iterator[FeedItem]:
        from pipeline.preprocess.pipeline import build_dataset

        order = self.order
        source_of = {f.source: i for i, lay in enumerate(order.layouts) for f in lay.files}
        ds = build_dataset(self.job, epoch, cursor=cursor, order=order)
        ahead: deque[tuple[ray.ObjectRef, int, ray.ObjectRef]] = deque()
        unyielded: list[MeasuredSample] = []  # registered, not yet handed out
        try:
            for bundle in ds.iter_internal_ref_bundles():
                for entry, sl in zip(bundle.blocks, bundle.slices, strict=True):
                    start, end = ((sl.start_offset, sl.end_offset) if sl is not None
                                  else (0, entry.metadata.num_rows))
                    ahead.append((entry.ref, start,
                                  _measure_block.remote(entry.ref, start, end, self._collate)))
                    while len(ahead) > MEASURE_AHEAD:
                        yield from self._hand_out(self._register(*ahead.popleft(), source_of),
                                                  unyielded)
            while ahead:
                yield from self._hand_out(self._register(*ahead.popleft(), source_of),
                                          unyielded)
        finally:
            # Closed early (a mixture change re-reads the epoch from the change): what was
            # registered but never handed out will never be staged.
            if unyielded:
                self.discard(unyielded)

    @staticmethod
    def _hand_out(items: list[FeedItem], unyielded: list[MeasuredSample]
                  ) -> Iterator[FeedItem]:
        unyielded[:] = [s for s in items if isinstance(s, MeasuredSample)]
        for item in items:
            if isinstance(item, MeasuredSample):
                unyielded.pop(0)
            yield item

    def _register(self, ref: ray.ObjectRef, start: int, meta_ref: ray.ObjectRef,
                  source_of: dict[str, int]) -> list[FeedItem]:
        rows = ray.get(meta_ref)
        block_id = next(self._ids)
        items: list[FeedItem] = []
        waiting = 0
        with self._lock:
            for i, (sid, n, v, loss, reason, detail, file) in enumerate(rows):
                if reason:
                    items.append(QuarantineEntry(sid, reason, detail or ""))
                    continue
                s = MeasuredSample(sid, int(n), int(v), int(loss), source_of[file])
                self._where.setdefault(_key(s), deque()).append((block_id, start + i))
                waiting += 1
                items.append(s)
            if waiting:
                self._blocks[block_id] = _Block(ref, waiting)
        return items

    def stage(self, steps: Sequence[Step]) -> None:
        keys: list[tuple[int, int]] = []
        spec: list[list] = []
        args: dict[int, int] = {}  # block id -> position among the task's block arguments
        with self._lock:
            for step in steps:
                for rank in step.ranks():  # one object per (step, rank): all its micro-batches
                    rows = []
                    for s in step.rank_samples(rank):
                        q = self._where.get(_key(s))
                        if q:
                            block_id, row = q.popleft()
                            if not q:
                                del self._where[_key(s)]
                            rows.append(("b", args.setdefault(block_id, len(args)), row))
                            blk = self._blocks[block_id]
                            blk.waiting -= 1
                        else:  # read by a previous producer: rebuild by id
                            rows.append(("r", str(s.sample_id), step.epoch, list(_key(s))))
                    keys.append((step.step, rank))
                    spec.append(rows)
            if not keys:
                return
            order = sorted(args, key=args.__getitem__)
            refs = [self._blocks[i].ref for i in order]
            for i in order:
                if self._blocks[i].waiting == 0:
                    del self._blocks[i]  # the gather task holds its own reference
        out = _gather_batches.options(num_returns=len(keys)).remote(
            self._job_json, self._collate, spec, *refs)
        outs = [out] if len(keys) == 1 else list(out)
        with self._lock:
            self._staged.update(zip(keys, outs, strict=True))

    def discard(self, samples: Sequence[MeasuredSample]) -> None:
        with self._lock:
            for s in samples:
                q = self._where.get(_key(s))
                if not q:
                    continue
                block_id, _ = q.popleft()
                if not q:
                    del self._where[_key(s)]
                blk = self._blocks[block_id]
                blk.waiting -= 1
                if blk.waiting == 0:
                    del self._blocks[block_id]

    def release(self, keys: Sequence[tuple[int, int]]) -> None:
        with self._lock:
            for k in keys:
                self._staged.pop(k, None)

    def refs(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], ray.ObjectRef | None]:
        with self._lock:
            return {k: self._staged.get(k) for k in keys}

    def held(self) -> dict[str, int]:
        """What this feed pins in the object store (status, tests)."""
        with self._lock:
            return {"blocks": len(self._blocks), "batches": len(self._staged),
                    "waiting_rows": sum(b.waiting for b in self._blocks.values())}

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._where.clear()
            self._staged.clear()
