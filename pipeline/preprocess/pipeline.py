"""Ray Data wiring: the preprocessing plan, the ordered sample stream, and random access by id.

Plan: the epoch's order (pipeline/order/: a seeded permutation by default, file order with
`source.shuffle: false`) comes in blocks; a block is a bounded stretch of the epoch whose rows
come from a few hundred read units. Two stages:

1. *read* (one task per block, light on CPU): reads the block's units (block_reader.py: one
   read per unit, never per row), arranges the rows in the order's sequence, and hands them on
   in chunks of as many rows as one processing task's output target holds (task_size.py: a chat
   keeps 256 rows, a file of 1024 x 1024 images ~10), each chunk a block of its own;
2. *process* (a pool of Ray workers): each worker builds the tokenizer/template/image processor
   once (per-process cache in task mode, the default, which Ray keeps warm across
   datasets/epochs; or once per actor with `_ChunkActor`) and processes a chunk per call,
   yielding it in parts of about `preprocess.task_output_mb` as they are done (one batched
   tokenizer call per part; a chunk of chats is one part; a part of images leaves as a block at
   once).

JSONL is not read with `read_json`/`read_text` on purpose: they would fail on a bad line or lose
exact line numbers. Order is preserved (the order's sequence: what every reader of the epoch
sees) and the object-store budget is capped so a paused consumer stops the producers
(backpressure), between the blocks of one task too. A block's raw rows are held only while its
chunks are processed: the shuffle's buffer is raw source bytes (`source.shuffle_block_mb`), not
preprocessed payloads.

Random access (`SampleStore`) runs the very same `Processor` in-process on one row re-read from
the source by its cached byte offset, so it returns byte-identical samples to the stream.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.config import JobConfig, job_from_json
from pipeline.order.cursor import OrderCursor
from pipeline.order.epoch_order import OrderBlock
from pipeline.order.job_order import JobOrder
from pipeline.preprocess.block_reader import read_block
from pipeline.preprocess.process import Processor, split_sample_id
from pipeline.preprocess.rows import SCHEMA, from_table, to_table
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.preprocess.sources import SourceFile, expand_sources, read_row
from pipeline.preprocess.task_size import rows_per_task, task_bytes

Item = ProcessedSample | QuarantinedRecord

DEFAULT_COMPUTE = "tasks"
READ_TASK_CPUS = 0.25  # a read task waits on storage; it must not take a processing core
# The object-store budget of the preprocessing stream is `preprocess.object_store_mb`. Ray's
# default (unbounded for this op) produced the whole epoch while the consumer was paused; a cap
# makes producers wait. It must hold a few blocks (each about `preprocess.task_output_mb`): a
# 64 MB cap with 256-row blocks of chats and 15% images (~50 MB each) halved throughput
# (bench/preprocess_bench.py).


@dataclass
class PreprocessStats:
    """Running counts of a stream: rows seen, samples, quarantined by reason, tokens."""

    rows: int = 0
    samples: int = 0
    quarantined: int = 0
    quarantined_by_reason: Counter = field(default_factory=Counter)
    num_tokens: int = 0
    num_visual_tokens: int = 0
    truncated: int = 0

    def add(self, item: Item) -> None:
        self.rows += 1
        if isinstance(item, QuarantinedRecord):
            self.quarantined += 1
            self.quarantined_by_reason[item.reason] += 1
        else:
            self.samples += 1
            self.num_tokens += item.num_tokens
            self.num_visual_tokens += item.num_visual_tokens
            self.truncated += int(item.truncated)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows, "samples": self.samples, "quarantined": self.quarantined,
            "quarantined_by_reason": dict(sorted(self.quarantined_by_reason.items())),
            "num_tokens": self.num_tokens, "num_visual_tokens": self.num_visual_tokens,
            "truncated": self.truncated,
        }


def _one_thread_tokenizer() -> None:
    # A Ray worker holds one CPU; the Rust tokenizer's own thread pool would oversubscribe it.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _process_chunks(processor: Processor, batch: pa.Table) -> Iterator[pa.Table]:
    """A chunk of raw rows (`RawRow`s, in the order's sequence) as Arrow tables of about
    `preprocess.task_output_mb` each (a chunk of chats: one table), each yielded once done."""
    for blob in batch.column("chunk").to_pylist():
        for items in processor.process_parts(pickle.loads(blob), task_bytes(processor.job)):
            yield to_table(items)


@dataclass(frozen=True)
class _BlockTask:
    """One read task: an order block, its sources' files, the positions of it to hand on
    ([skip, take)), and how to cut them into chunks."""

    block: OrderBlock
    files: tuple[tuple[SourceFile, ...], ...]
    skip: int
    take: int
    chunk_rows: tuple[float, ...]  # per source: rows one processing task holds


def _read_blocks(batch: pa.Table) -> Iterator[pa.Table]:
    """Read stage: a block's rows in order, handed on in chunks (each chunk a table of one row,
    which the streaming repartition keeps a block of its own: a processing task each)."""
    for blob in batch.column("block").to_pylist():
        task: _BlockTask = pickle.loads(blob)
        rows = read_block(task.block, task.files, task.skip)[:task.take - task.skip]
        per_row = {f.source: 1.0 / task.chunk_rows[s] for s, fs in enumerate(task.files)
                   for f in fs}
        chunk: list = []
        fill = 0.0
        for r in rows:
            chunk.append(r)
            fill += per_row[r[0].source]
            if fill >= 1.0 - 1e-9:
                yield pa.table({"chunk": [pickle.dumps(chunk)]})
                chunk, fill = [], 0.0
        if chunk:
            yield pa.table({"chunk": [pickle.dumps(chunk)]})


class _ChunkActor:
    """Ray Data callable class: one per actor, so the ~1-4 s of setup is paid once."""

    def __init__(self, job_json: str, epoch: int) -> None:
        _one_thread_tokenizer()
        self.processor = Processor(job_from_json(job_json), epoch)

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        return _process_chunks(self.processor, batch)


_task_processors: OrderedDict[tuple[str, int], Processor] = OrderedDict()


def _chunk_task(batch: pa.Table, job_json: str, epoch: int) -> Iterator[pa.Table]:
    """Task mode: Ray reuses worker processes across tasks and datasets, so a per-process
    cache gives the same once-per-worker setup as actors and stays warm between epochs."""
    key = (job_json, epoch)
    proc = _task_processors.get(key)
    if proc is None:
        _one_thread_tokenizer()
        proc = _task_processors[key] = Processor(job_from_json(job_json), epoch)
        while len(_task_processors) > 4:
            _task_processors.popitem(last=False)
    return _process_chunks(proc, batch)


def _block_tasks(job: JobConfig, epoch: int, cursor: OrderCursor, limit: int | None,
                 chunk_rows: int | None, order: JobOrder | None) -> list[_BlockTask]:
    """The read tasks of an epoch from the cursor's position: one per block of its order."""
    order = order or JobOrder(job.source, job.seed)
    epoch_order = order.epoch(epoch, cursor)
    files = tuple(lay.files for lay in order.layouts)
    if chunk_rows is not None:
        per_source = tuple(float(chunk_rows) for _ in files)
    else:  # each source's rows per task from its first file's rows (task_size.py)
        per_source = tuple(float(rows_per_task(job, fs[0])) for fs in files)
    start = cursor.position
    end = epoch_order.size if limit is None else min(epoch_order.size, start + limit)
    tasks = []
    for block in epoch_order.blocks(start):
        if block.start >= end:
            break
        tasks.append(_BlockTask(block, files, max(0, start - block.start),
                                min(len(block), end - block.start), per_source))
    return tasks


def build_dataset(job: JobConfig, epoch: int, *, start_row: int = 0,
                  cursor: OrderCursor | None = None, limit: int | None = None,
                  chunk_rows: int | None = None, concurrency: int | None = None,
                  compute: str = DEFAULT_COMPUTE, object_store_limit: int | None = None,
                  order: JobOrder | None = None) -> Any:
    """The Ray Data plan of one epoch (lazy `ray.data.Dataset`; rows follow `rows.SCHEMA`).

    Columns: sample_id, source, row, num_tokens, num_visual_tokens, cost, truncated, input_ids,
    labels, pixel_values (+pixel_dim, pixel_dtype), image_grid_thw, quarantine_reason,
    quarantine_detail;
    arrays are little-endian bytes (see rows.py; `rows.from_row` turns a row into a sample).
    Rows come in the epoch's order (pipeline/order/), from position `start_row` (or the
    `cursor`'s position, which also carries the mixture changes in force); `limit` keeps at most
    that many rows after it. `chunk_rows` = rows per task; None (the service) = as many as
    `preprocess.task_output_mb` holds (task_size.py). `concurrency` = a fixed number of
    parallel workers; None (the service) = as many as the cluster has CPUs for, at every
    moment: nothing is frozen at epoch start, so a growing cluster (the KubeRay autoscaler sees
    the pending tasks) is used at once; `compute` = "tasks" (pooled workers, warm across
    epochs) or "actors" (an autoscaling actor pool). `order`: the job's order, if the caller
    holds it (it reads every file's index to build one).
    Ray must be initialized by the caller.
    """
    import ray
    from ray.data import ExecutionResources

    if not ray.is_initialized():
        # Ray Data would silently start a default local cluster (token auth, workers at nice
        # 15); the service and the CLI start Ray with the settings they need.
        raise RuntimeError("Ray is not initialized: call ray.init(...) before preprocessing")
    if compute not in ("tasks", "actors"):
        raise ValueError(f"compute must be 'tasks' or 'actors', got {compute!r}")
    cursor = cursor or OrderCursor(start_row)
    tasks = _block_tasks(job, epoch, cursor, limit, chunk_rows, order)
    if not tasks:
        return ray.data.from_arrow(SCHEMA.empty_table())
    ds = ray.data.from_items([{"block": pickle.dumps(t)} for t in tasks],
                             override_num_blocks=len(tasks))
    ctx = ds.context  # this dataset's own copy: the caller's global DataContext is untouched
    ctx.execution_options.preserve_order = True  # deterministic stream order
    ctx.execution_options.resource_limits = ExecutionResources(
        object_store_memory=object_store_limit or job.preprocess.object_store_mb * 2**20)
    ctx.target_max_block_size = task_bytes(job)  # a task's parts, gathered into blocks
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    # Reading is I/O: little CPU, and two blocks at most (one being processed, the next; an
    # epoch of one block: one, or Ray Data warns the pool is larger than its input).
    ds = ds.map_batches(_read_blocks, batch_size=1, batch_format="pyarrow",
                        num_cpus=READ_TASK_CPUS,
                        compute=ray.data.TaskPoolStrategy(size=min(2, len(tasks))))
    ds = ds.repartition(target_num_rows_per_block=1)  # one chunk, one processing task
    common = {"batch_size": 1,  # one chunk per call: it is already sized for one task
              "batch_format": "pyarrow", "num_cpus": 1}
    if compute == "actors":
        pool = (ray.data.ActorPoolStrategy(size=concurrency) if concurrency else
                ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, _chunks_hint(tasks))))
        return ds.map_batches(_ChunkActor, fn_constructor_args=(job.model_dump_json(), epoch),
                              compute=pool, **common)
    return ds.map_batches(_chunk_task, fn_args=(job.model_dump_json(), epoch),
                          compute=ray.data.TaskPoolStrategy(size=concurrency), **common)


def _chunks_hint(tasks: list[_BlockTask]) -> int:
    """About how many processing tasks the epoch has (an actor pool's largest size)."""
    return int(sum((t.take - t.skip) / min(t.chunk_rows) for t in tasks)) + 1


def iter_samples(job: JobConfig, epoch: int, *, start_row: int = 0,
                 cursor: OrderCursor | None = None, limit: int | None = None,
                 stats: PreprocessStats | None = None, chunk_rows: int | None = None,
                 concurrency: int | None = None, compute: str = DEFAULT_COMPUTE,
                 object_store_limit: int | None = None,
                 order: JobOrder | None = None) -> Iterator[Item]:
    """Every record of the epoch in the epoch's order, as a sample or quarantined.

    Exactly one item per position (a row, or a row's copy), so a consumer that has taken k
    items restarts with `start_row=k`. Streams through Ray Data with bounded memory; Ray must be
    initialized. A sample's arrays view its block in Ray's object store (rows.py: no copy out of
    it), so a consumer that keeps samples keeps their blocks.
    """
    ds = build_dataset(job, epoch, start_row=start_row, cursor=cursor, limit=limit,
                       chunk_rows=chunk_rows, concurrency=concurrency, compute=compute,
                       object_store_limit=object_store_limit, order=order)
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
        for item in from_table(batch):
            if stats is not None:
                stats.add(item)
            yield item


class SampleQuarantined(LookupError):
    """`SampleStore.get` of a record that is quarantined (it never was a sample)."""

    def __init__(self, record: QuarantinedRecord) -> None:
        super().__init__(f"{record.sample_id} is quarantined: {record.reason}: {record.detail}")
        self.record = record


class SampleStore:
    """Random access by sample id: re-read the source row, reprocess with the same seed.

    Line offsets and Parquet row groups are cached, the tokenizer is loaded once per process,
    so a lookup costs one small read plus one sample's preprocessing. Thread-safe.
    """

    def __init__(self, job: JobConfig, max_epochs_cached: int = 2) -> None:
        self.job = job
        self.files = {f.source: f for f in expand_sources(job.source)}
        self._processors: OrderedDict[int, Processor] = OrderedDict()
        self._max = max_epochs_cached
        self._lock = threading.Lock()  # fast tokenizers refuse concurrent use ("borrowed")

    def _processor(self, epoch: int) -> Processor:
        p = self._processors.get(epoch)
        if p is None:
            p = self._processors[epoch] = Processor(self.job, epoch)
            if len(self._processors) > self._max:
                self._processors.popitem(last=False)
        self._processors.move_to_end(epoch)
        return p

    def get_item(self, sample_id: str, epoch: int) -> Item:
        source, row, copy = split_sample_id(sample_id)
        f = self.files.get(source)
        if f is None:
            raise KeyError(f"unknown source in sample id {sample_id!r}")
        with self._lock:
            raw = read_row(f, row)
            return self._processor(epoch).process_one(f, row, raw, copy)

    def get(self, sample_id: str, epoch: int) -> ProcessedSample:
        item = self.get_item(sample_id, epoch)
        if isinstance(item, QuarantinedRecord):
            raise SampleQuarantined(item)
        return item

    def close(self) -> None:
        with self._lock:
            self._processors.clear()
