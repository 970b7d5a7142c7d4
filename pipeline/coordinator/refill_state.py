"""A refill job's shared state in Redis: the queue, the leases, completions and counters.

Owns the `refill:*` keys of one job (keys.py, docs/redis-schema.md); every change that touches
more than one key is a script of `lua/refill_*.lua`, so a replica or consumer that dies between
two calls leaves no half-made change. Any replica answers any consumer from here; the producer
(the replica holding the job's refill producer lease) fills the queue through `enqueue`.
A job of several epochs reads its source once per epoch (`SourcePosition`), each epoch's
requests under ids of their own (`pipeline.refill.request`), counted per epoch. Imports nothing
of the service.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import redis

from pipeline.coordinator import refill_scripts as rs
from pipeline.coordinator.connection import open_client, unavailable_as_error
from pipeline.coordinator.keys import JobKeys
from pipeline.refill.admission import DEFAULT_SCAN
from pipeline.refill.leases import RefillRejected
from pipeline.refill.request import RefillRequest


@dataclass(frozen=True)
class RequestPayload:
    """A request with what a consumer decodes: the prompt's tokens and, for a VLM, its images
    (patch rows as preprocessing stored them, and one (t, h, w) grid row per image)."""

    request: RefillRequest
    input_ids: np.ndarray  # int32 prompt tokens
    pixel_values: np.ndarray | None = None  # [patches, C*T*P*P]: uint8, bfloat16 bits, float32
    image_grid_thw: np.ndarray | None = None  # int64 [images, 3]


@dataclass(frozen=True)
class RefillResult:
    admitted: list[RequestPayload]
    completed: list[str]
    stale: list[str]
    revoked: list[str]  # taken from this consumer at its lease's lapse: it should stop them


@dataclass(frozen=True, order=True)
class SourcePosition:
    """Where the producer reads next: source row `row` of epoch `epoch`."""

    epoch: int
    row: int


@dataclass(frozen=True)
class EpochCounts:
    epoch: int
    enqueued: int
    completed: int
    quarantined: int


@dataclass(frozen=True)
class RefillCounts:
    """What `status` shows for a refill job (in_flight, waiting, completed are derived from the
    keys themselves, never kept twice)."""

    enqueued: int  # requests, every epoch
    admitted: int
    completed: int
    readmitted: int
    quarantined: int  # records set aside, counted in each epoch that read them
    in_flight: int
    waiting: int
    consumers: int
    exhausted: bool  # every source row of every epoch was read
    lease_lapses: int = 0  # consumers whose lease lapsed while they held requests
    epoch: int = 0  # the epoch the producer reads
    by_epoch: tuple[EpochCounts, ...] = ()
    quarantined_by_reason: Mapping[str, int] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.exhausted and self.completed >= self.enqueued


def encode_info(r: RefillRequest) -> str:
    return f"{r.cost},{r.seq},{int(r.over_budget)},{r.prompt_tokens},{r.generation_tokens}"


def decode_info(request_id: str, s: str) -> RefillRequest:
    _cost, seq, over, prompt, gen = (int(x) for x in s.split(","))
    return RefillRequest(request_id, prompt, gen, seq, over_budget=bool(over))


def encode_images(pixels: np.ndarray, grid: np.ndarray) -> bytes:
    """One request's images as stored: a JSON line (dtype, shape, grid), then the raw bytes."""
    dt = pixels.dtype.newbyteorder("<") if pixels.dtype.byteorder == ">" else pixels.dtype
    head = {"dtype": dt.str, "shape": list(pixels.shape), "grid": np.asarray(grid).tolist()}
    return json.dumps(head).encode() + b"\n" + np.ascontiguousarray(pixels, dt).tobytes()


def decode_images(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    head, _, data = raw.partition(b"\n")
    h = json.loads(head)
    grid = np.asarray(h["grid"], dtype=np.int64).reshape(-1, 3)
    return np.frombuffer(data, dtype=h["dtype"]).reshape(h["shape"]), grid


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _counts(c: Mapping[str, int], in_flight: int, waiting: int, done: int, consumers: int,
            meta: Sequence[bytes | None]) -> RefillCounts:
    epochs: dict[int, dict[str, int]] = {}
    for name, n in c.items():
        if name.startswith("e") and ":" in name:
            e, what = name[1:].split(":", 1)
            epochs.setdefault(int(e), {})[what] = n
    exhausted, epoch = meta
    return RefillCounts(
        enqueued=c.get("enqueued", 0), admitted=c.get("admitted", 0), completed=done,
        readmitted=c.get("readmitted", 0), quarantined=c.get("quarantined", 0),
        in_flight=in_flight, waiting=waiting, consumers=consumers,
        exhausted=_s(exhausted or b"0") == "1", lease_lapses=c.get("lease_lapses", 0),
        epoch=int(epoch or 0),
        by_epoch=tuple(EpochCounts(e, v.get("enqueued", 0), v.get("completed", 0),
                                   v.get("quarantined", 0)) for e, v in sorted(epochs.items())),
        quarantined_by_reason={name[len("reason:"):]: n for name, n in sorted(c.items())
                               if name.startswith("reason:")})


class RefillState:
    def __init__(self, client: redis.Redis, job_id: str, where: str = "redis",
                 lease_ms: int = 30_000, scan: int = DEFAULT_SCAN) -> None:
        self.client = client
        self.keys = JobKeys(job_id)
        self.where = where
        self.lease_ms = lease_ms
        self.scan = scan

    @classmethod
    def connect(cls, client_or_url: redis.Redis | str, job_id: str, *,
                lease_seconds: float = 30.0, scan: int = DEFAULT_SCAN) -> RefillState:
        client, where = open_client(client_or_url)
        return cls(client, job_id, where, int(lease_seconds * 1000), scan)

    def close(self) -> None:
        self.client.close()

    def _run(self, script: rs.Script, args: Sequence) -> object:
        with unavailable_as_error(self.where):
            return script(self.client, [], [self.keys.base, *args])

    # --- consumers ---
    def open(self, consumer: str, held: Sequence[str] = (), retry_seq: int = 0) -> int:
        """A consumer (re)connects holding `held` (and about to repeat ask `retry_seq`, whose
        admission it holds too); its other leases are re-admitted now. Returns how many were."""
        return int(self._run(rs.open_consumer, [consumer, self.lease_ms, retry_seq, *held]))

    def refill(self, consumer: str, free_tokens: int, finished: Sequence[str],
               call_seq: int) -> RefillResult:
        """Record `finished`, admit new requests under `free_tokens` (one script). A call
        repeated with the same `call_seq` (a retry whose reply was lost) gets the same
        admission again. Raises RefillRejected naming unknown or repeated ids."""
        if free_tokens < 0:
            raise RefillRejected(f"free_tokens must be >= 0, got {free_tokens}")
        reply = self._run(rs.refill, [consumer, self.lease_ms, free_tokens, self.scan,
                                      call_seq, len(finished), *finished])
        kind = _s(reply[0])  # type: ignore[index]
        if kind == "rejected":
            unknown = [_s(x) for x in reply[1]]  # type: ignore[index]
            twice = [_s(x) for x in reply[2]]  # type: ignore[index]
            parts = ([f"unknown request ids {unknown}"] if unknown else []) + (
                [f"ids named twice {twice}"] if twice else [])
            raise RefillRejected("finished: " + "; ".join(parts) + " (nothing was applied)")
        ids, done, stale, revoked = ([_s(x) for x in part]
                                     for part in reply[1:5])  # type: ignore[index]
        return RefillResult(self.requests(ids), done, stale, revoked)

    def requests(self, ids: Sequence[str]) -> list[RequestPayload]:
        """Payloads of known requests (write-once: read outside the admission script)."""
        if not ids:
            return []
        with unavailable_as_error(self.where):
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(self.keys.refill_info, list(ids))
            pipe.hmget(self.keys.refill_payload, list(ids))
            pipe.hmget(self.keys.refill_pixels, list(ids))
            infos, payloads, images = pipe.execute()
        out = []
        for rid, i, p, im in zip(ids, infos, payloads, images, strict=True):
            pixels, grid = decode_images(im) if im else (None, None)
            out.append(RequestPayload(decode_info(rid, _s(i)), np.frombuffer(p, dtype="<i4"),
                                      pixels, grid))
        return out

    # --- the producer ---
    def hold_producer(self, holder: str, lease_ms: int) -> bool:
        """Take or renew the job's refill producer lease; True if `holder` holds it."""
        return bool(self._run(rs.producer, [holder, lease_ms]))

    def release_producer(self, holder: str) -> None:
        with unavailable_as_error(self.where):
            if _s(self.client.hget(self.keys.refill_meta, "producer") or b"") == holder:
                self.client.hset(self.keys.refill_meta, "producer_exp", 0)

    def position(self) -> SourcePosition:
        with unavailable_as_error(self.where):
            epoch, row = self.client.hmget(self.keys.refill_meta, ["epoch", "cursor"])
        return SourcePosition(int(epoch or 0), int(row or 0))

    def waiting(self) -> int:
        with unavailable_as_error(self.where):
            return int(self.client.zcard(self.keys.refill_waiting))

    def enqueue(self, holder: str, start: SourcePosition, end: SourcePosition,
                exhausted: bool, requests: Sequence[RequestPayload],
                quarantined: Sequence[dict] = ()) -> bool:
        """Add the requests read from the source rows between `start` (the stored position)
        and `end` (the next epoch's row 0 when they end an epoch), fenced by the producer
        lease. True once they are in (now, or by an earlier try of the same call: a retry adds
        nothing twice); False if `holder` lost the lease or `start` is not the stored position
        (nothing written). Each quarantined entry needs a "reason"."""
        args: list = [holder, start.epoch, start.row, end.epoch, end.row, int(exhausted),
                      len(requests), len(quarantined)]
        for p in requests:
            images = (b"" if p.pixel_values is None or p.image_grid_thw is None
                      else encode_images(p.pixel_values, p.image_grid_thw))
            args += [p.request.request_id, encode_info(p.request),
                     np.asarray(p.input_ids, dtype="<i4").tobytes(), images]
        args += [json.dumps(q, sort_keys=True) for q in quarantined]
        return bool(self._run(rs.enqueue, args))

    # --- status ---
    def counts(self) -> RefillCounts:
        k = self.keys
        with unavailable_as_error(self.where):
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(k.refill_counters)
            pipe.hlen(k.refill_owner)
            pipe.zcard(k.refill_waiting)
            pipe.hlen(k.refill_done)
            pipe.zcount(k.refill_consumers, f"({int(time.time() * 1000)}", "+inf")  # live
            pipe.hmget(k.refill_meta, ["exhausted", "epoch"])
            c, in_flight, waiting, done, consumers, meta = pipe.execute()
        return _counts({_s(a): int(b) for a, b in c.items()}, in_flight, waiting, done,
                       consumers, meta)

    def quarantine(self, limit: int = 100) -> list[dict]:
        with unavailable_as_error(self.where):
            raw = self.client.lrange(self.keys.refill_quarantine, 0, limit - 1)
        return [json.loads(x) for x in raw]

    def completions(self) -> dict[str, str]:
        """request id -> the consumer whose completion was recorded (tests, audits)."""
        with unavailable_as_error(self.where):
            return {_s(a): _s(b) for a, b in self.client.hgetall(self.keys.refill_done).items()}
