"""The producer of a refill job: source rows -> preprocessed samples -> requests in Redis.

Every replica runs one per refill job; the one holding the job's refill producer lease (a
Redis-clock lease, renewed while it works) reads the next rows from the source cursor, runs the
job's real preprocessing in this process (the same `Processor` as training jobs: the job's
tokenizer and chat template), turns each sample into a request and enqueues them together with
the new cursor in one fenced script. A replica that dies leaves the cursor where its last
enqueue put it; the next holder continues from there, and a row is never enqueued twice. The
queue is bounded (`refill.queue_depth` waiting requests): reading stops while it is full.
A job of `epochs: N` reads its source N times, epoch by epoch (preprocessing seeded by the epoch,
as for training jobs), and makes each epoch's requests under ids of their own. A request of an
image record carries the images of its prompt, as preprocessing stored them.
A refill job needs no planner: consumers' capacities do the batching.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from pipeline.config import RefillConfig, RefillJobConfig
from pipeline.coordinator.refill_state import RefillState, RequestPayload, SourcePosition
from pipeline.preprocess.process import Processor
from pipeline.preprocess.records import decode_line
from pipeline.preprocess.sample import IGNORE_INDEX, ProcessedSample, QuarantinedRecord
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
from pipeline.preprocess.vision import MERGE_SIZE
from pipeline.quarantine import QuarantineReason
from pipeline.refill.request import Priced, arrival_seq, price, request_id

log = logging.getLogger(__name__)

CHUNK_ROWS = 64


def prompt_and_answer(sample: ProcessedSample) -> tuple[np.ndarray, int]:
    """The generation prompt (tokens before the last assistant answer: it ends with the
    template's assistant header) and the reference answer's length in tokens."""
    trained = np.flatnonzero(sample.labels != IGNORE_INDEX)
    if not len(trained):
        return sample.input_ids, 0
    # The last answer is the last run of consecutive trained tokens.
    breaks = np.flatnonzero(np.diff(trained) > 1)
    start = int(trained[breaks[-1] + 1]) if len(breaks) else int(trained[0])
    return sample.input_ids[:start], int(len(sample.input_ids) - start)


def prompt_images(sample: ProcessedSample, prompt: np.ndarray,
                  image_pad_id: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(pixel_values, image_grid_thw) of the sample's images whose visual tokens are in the
    prompt: whole images, in order (None, None without any)."""
    pixels, grid = sample.pixel_values, sample.image_grid_thw
    if pixels is None or grid is None or not len(grid):
        return None, None
    per_image = np.prod(grid, axis=1) // MERGE_SIZE**2
    pads = int(np.count_nonzero(prompt == image_pad_id))
    n = int(np.searchsorted(np.cumsum(per_image), pads, side="right"))
    if n == 0:
        return None, None
    return pixels[: int(np.prod(grid[:n], axis=1).sum())], grid[:n]


def planned_generation(rule: RefillConfig, record: Any, answer_tokens: int) -> int:
    """The job's rule, else the record's field, else the reference answer's length."""
    if rule.generation_tokens is not None:
        return rule.generation_tokens
    if rule.generation_tokens_field is not None:
        rec = decode_line(record) if isinstance(record, (bytes, bytearray)) else record
        value = rec.get(rule.generation_tokens_field) if isinstance(rec, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"field {rule.generation_tokens_field!r} = {value!r} is not a "
                             "positive integer")
        return value
    return answer_tokens


def to_request(rule: RefillConfig, sample: ProcessedSample, record: Any, epoch: int,
               image_pad_id: int) -> RequestPayload | Priced:
    """The sample's request of `epoch` with its payload, or why it is set aside."""
    prompt, answer = prompt_and_answer(sample)
    try:
        gen = planned_generation(rule, record, answer)
    except ValueError as exc:
        return Priced(None, QuarantineReason.BAD_RECORD.value, str(exc))
    priced = price(request_id(sample.sample_id, epoch), arrival_seq(epoch, sample.row),
                   len(prompt), gen, rule.max_request_tokens, rule.over_budget)
    if priced.request is None:
        return priced
    return RequestPayload(priced.request, prompt, *prompt_images(sample, prompt, image_pad_id))


class RefillProducer:
    def __init__(self, job: RefillJobConfig, state: RefillState, holder: str) -> None:
        self.job, self.rule, self.state, self.holder = job, job.refill, state, holder
        self.lease_ms = int(max(2.0, self.rule.lease_seconds / 3) * 1000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._processor: Processor | None = None
        self.error: str | None = None  # the last step's failure, until a step succeeds

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"refill-{self.job.job_id}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        try:
            self.state.release_producer(self.holder)
        except Exception:  # its lease then lapses
            log.debug("refill producer release failed", exc_info=True)

    def _run(self) -> None:
        idle = self.lease_ms / 3000
        while not self._stop.is_set():
            try:
                if not self.state.hold_producer(self.holder, self.lease_ms):
                    self._stop.wait(idle)
                    continue
                if self.state.counts().exhausted:
                    self._stop.wait(idle)  # keep the lease: nobody else needs to read
                    continue
                if self.state.waiting() >= self.rule.queue_depth:
                    self._stop.wait(0.05)
                    continue
                self._step()
                self.error = None  # what failed before works again (status stops showing it)
            except Exception as exc:  # Redis down a while, a source gone: retry, say why
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("job %s: refill producer: %s", self.job.job_id, self.error,
                            exc_info=True)
                self._stop.wait(1.0)

    def _processor_for(self, epoch: int) -> Processor:
        if self._processor is None or self._processor.epoch != epoch:
            self._processor = Processor(self.job, epoch)  # augmentation is seeded by the epoch
        return self._processor

    def _step(self) -> None:
        """Read, preprocess and enqueue the next chunk of rows after the stored position."""
        pos = self.state.position()
        files = expand_sources(self.job.source)
        chunks = plan_chunks(files, CHUNK_ROWS, pos.row, limit=CHUNK_ROWS)
        if not chunks:  # nothing (left) in this epoch's source
            self._enqueue(pos, pos.row, more=False, requests=[], quarantined=[])
            return
        chunk = chunks[0]
        rows = read_chunk(chunk)
        processor = self._processor_for(pos.epoch)
        items = processor.process(chunk.file, rows)
        requests: list[RequestPayload] = []
        quarantined: list[dict] = []
        for (_, raw), item in zip(rows, items, strict=True):
            if isinstance(item, QuarantinedRecord):
                quarantined.append({"sample_id": item.sample_id, "reason": item.reason.value,
                                    "detail": item.detail, "epoch": pos.epoch})
                continue
            made = to_request(self.rule, item, raw, pos.epoch, processor.image_pad_id)
            if isinstance(made, Priced):
                quarantined.append({"sample_id": item.sample_id, "reason": made.reason,
                                    "detail": made.detail, "epoch": pos.epoch})
            else:
                requests.append(made)
        end = pos.row + len(rows)
        more = bool(plan_chunks(files, CHUNK_ROWS, end, limit=1))
        self._enqueue(pos, end, more=more, requests=requests, quarantined=quarantined)

    def _enqueue(self, pos: SourcePosition, end_row: int, *, more: bool,
                 requests: list[RequestPayload], quarantined: list[dict]) -> None:
        """Enqueue the rows from `pos` to `end_row`; past an epoch's last row the position
        moves to the next epoch's first (or the source is exhausted after the last epoch)."""
        last_epoch = pos.epoch + 1 >= self.job.epochs
        end = (SourcePosition(pos.epoch, end_row) if more or last_epoch
               else SourcePosition(pos.epoch + 1, 0))
        if not self.state.enqueue(self.holder, pos, end, not more and last_epoch, requests,
                                  quarantined):
            log.info("job %s: refill producer lost its lease; rows from epoch %d row %d left "
                     "to the next holder", self.job.job_id, pos.epoch, pos.row)
