"""The producer of a refill job: source rows -> preprocessed samples -> requests in Redis.

Every replica runs one per refill job; the one holding the job's refill producer lease (a
Redis-clock lease, renewed while it works) reads the next rows from the source cursor, runs the
job's real preprocessing in this process (the same `Processor` as training jobs: the job's
tokenizer and chat template), turns each sample into a request and enqueues them together with
the new cursor in one fenced script. A replica that dies leaves the cursor where its last
enqueue put it; the next holder continues from there, and a row is never enqueued twice. The
queue is bounded (`refill.queue_depth` waiting requests): reading stops while it is full.
A refill job needs no planner: consumers' capacities do the batching.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from pipeline.config import JobConfig, RefillConfig
from pipeline.coordinator.refill_state import RefillState
from pipeline.preprocess.process import Processor
from pipeline.preprocess.records import decode_line
from pipeline.preprocess.sample import IGNORE_INDEX, ProcessedSample, QuarantinedRecord
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
from pipeline.quarantine import QuarantineReason
from pipeline.refill.request import Priced, RefillRequest, price

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


def to_request(rule: RefillConfig, sample: ProcessedSample, record: Any,
               seq: int) -> tuple[Priced, np.ndarray]:
    prompt, answer = prompt_and_answer(sample)
    try:
        gen = planned_generation(rule, record, answer)
    except ValueError as exc:
        return Priced(None, QuarantineReason.BAD_RECORD.value, str(exc)), prompt
    return price(sample.sample_id, seq, len(prompt), gen, rule.max_request_tokens,
                 rule.over_budget), prompt


class RefillProducer:
    def __init__(self, job: JobConfig, state: RefillState, holder: str) -> None:
        assert job.refill is not None
        self.job, self.rule, self.state, self.holder = job, job.refill, state, holder
        self.lease_ms = int(max(2.0, self.rule.lease_seconds / 3) * 1000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._processor: Processor | None = None
        self.error: str | None = None

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
            except Exception as exc:  # Redis down a while, a source gone: retry, say why
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("job %s: refill producer: %s", self.job.job_id, self.error,
                            exc_info=True)
                self._stop.wait(1.0)

    def _step(self) -> None:
        """Read, preprocess and enqueue the next chunk of rows after the cursor."""
        if self._processor is None:
            self._processor = Processor(self.job, 0)  # one pass over the source: epoch 0
        cursor = self.state.cursor()
        chunks = plan_chunks(expand_sources(self.job.source), CHUNK_ROWS, cursor, limit=CHUNK_ROWS)
        if not chunks:
            self.state.enqueue(self.holder, cursor, True, [])
            return
        chunk = chunks[0]
        rows = read_chunk(chunk)
        items = self._processor.process(chunk.file, rows)
        requests: list[tuple[RefillRequest, np.ndarray]] = []
        quarantined: list[dict] = []
        for i, ((_, raw), item) in enumerate(zip(rows, items, strict=True)):
            if isinstance(item, QuarantinedRecord):
                quarantined.append({"sample_id": item.sample_id, "reason": item.reason.value,
                                    "detail": item.detail})
                continue
            priced, prompt = to_request(self.rule, item, raw, cursor + i)
            if priced.request is None:
                quarantined.append({"sample_id": item.sample_id, "reason": priced.reason,
                                    "detail": priced.detail})
            else:
                requests.append((priced.request, prompt))
        end = cursor + len(rows)
        more = plan_chunks(expand_sources(self.job.source), CHUNK_ROWS, end, limit=1)
        if not self.state.enqueue(self.holder, end, not more, requests, quarantined):
            log.info("job %s: refill producer lost its lease; rows from %d left to the next "
                     "holder", self.job.job_id, cursor)
