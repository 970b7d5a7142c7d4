"""A refill job's shared state in Redis: the queue, the leases, completions and counters.

Owns the `refill:*` keys of one job (keys.py, docs/redis-schema.md); every change that touches
more than one key is a script of `lua/refill_*.lua`, so a replica or consumer that dies between
two calls leaves no half-made change. Any replica answers any consumer from here; the producer
(the replica holding the job's refill producer lease) fills the queue through `enqueue`.
Imports nothing of the service.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import redis

from pipeline.coordinator import refill_scripts as rs
from pipeline.coordinator.connection import open_client, unavailable_as_error
from pipeline.coordinator.keys import JobKeys
from pipeline.refill.admission import DEFAULT_SCAN
from pipeline.refill.leases import RefillRejected
from pipeline.refill.request import RefillRequest


@dataclass(frozen=True)
class LeasedRequest:
    """An admitted request as a consumer receives it."""

    request: RefillRequest
    input_ids: np.ndarray  # int32 prompt tokens


@dataclass(frozen=True)
class RefillResult:
    admitted: list[LeasedRequest]
    completed: list[str]
    stale: list[str]


@dataclass(frozen=True)
class RefillCounts:
    """What `status` shows for a refill job (in_flight, waiting, completed are derived from the
    keys themselves, never kept twice)."""

    enqueued: int
    admitted: int
    completed: int
    readmitted: int
    quarantined: int
    in_flight: int
    waiting: int
    consumers: int
    exhausted: bool  # every source row was read

    @property
    def done(self) -> bool:
        return self.exhausted and self.completed >= self.enqueued


def encode_info(r: RefillRequest) -> str:
    return f"{r.cost},{r.seq},{int(r.over_budget)},{r.prompt_tokens},{r.generation_tokens}"


def decode_info(request_id: str, s: str) -> RefillRequest:
    _cost, seq, over, prompt, gen = (int(x) for x in s.split(","))
    return RefillRequest(request_id, prompt, gen, seq, over_budget=bool(over))


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


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
        ids, done, stale = ([_s(x) for x in part] for part in reply[1:4])  # type: ignore[index]
        return RefillResult(self.requests(ids), done, stale)

    def requests(self, ids: Sequence[str]) -> list[LeasedRequest]:
        """Payloads of known requests (write-once: read outside the admission script)."""
        if not ids:
            return []
        with unavailable_as_error(self.where):
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(self.keys.refill_info, list(ids))
            pipe.hmget(self.keys.refill_payload, list(ids))
            infos, payloads = pipe.execute()
        return [LeasedRequest(decode_info(rid, _s(i)), np.frombuffer(p, dtype="<i4"))
                for rid, i, p in zip(ids, infos, payloads, strict=True)]

    # --- the producer ---
    def hold_producer(self, holder: str, lease_ms: int) -> bool:
        """Take or renew the job's refill producer lease; True if `holder` holds it."""
        return bool(self._run(rs.producer, [holder, lease_ms]))

    def release_producer(self, holder: str) -> None:
        with unavailable_as_error(self.where):
            if _s(self.client.hget(self.keys.refill_meta, "producer") or b"") == holder:
                self.client.hset(self.keys.refill_meta, "producer_exp", 0)

    def cursor(self) -> int:
        with unavailable_as_error(self.where):
            return int(self.client.hget(self.keys.refill_meta, "cursor") or 0)

    def waiting(self) -> int:
        with unavailable_as_error(self.where):
            return int(self.client.zcard(self.keys.refill_waiting))

    def enqueue(self, holder: str, cursor: int, exhausted: bool,
                requests: Sequence[tuple[RefillRequest, np.ndarray]],
                quarantined: Sequence[dict] = ()) -> bool:
        """Add requests read from source rows before `cursor`, fenced by the producer lease;
        False if `holder` lost it (nothing written)."""
        args: list = [holder, cursor, int(exhausted), len(requests), len(quarantined)]
        for r, ids in requests:
            args += [r.request_id, encode_info(r), np.asarray(ids, dtype="<i4").tobytes()]
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
            pipe.zcard(k.refill_consumers)
            pipe.hget(k.refill_meta, "exhausted")
            c, in_flight, waiting, done, consumers, exhausted = pipe.execute()
        c = {_s(a): int(b) for a, b in c.items()}
        return RefillCounts(
            enqueued=c.get("enqueued", 0), admitted=c.get("admitted", 0), completed=done,
            readmitted=c.get("readmitted", 0), quarantined=c.get("quarantined", 0),
            in_flight=in_flight, waiting=waiting, consumers=consumers,
            exhausted=_s(exhausted or b"0") == "1")

    def quarantine(self, limit: int = 100) -> list[dict]:
        with unavailable_as_error(self.where):
            raw = self.client.lrange(self.keys.refill_quarantine, 0, limit - 1)
        return [json.loads(x) for x in raw]

    def completions(self) -> dict[str, str]:
        """request id -> the consumer whose completion was recorded (tests, audits)."""
        with unavailable_as_error(self.where):
            return {_s(a): _s(b) for a, b in self.client.hgetall(self.keys.refill_done).items()}
