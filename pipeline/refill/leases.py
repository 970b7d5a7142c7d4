"""The refill job's lease table as a plain state machine: the model the Redis state follows.

Every request is in exactly one place: `waiting` (admissible), `leased` to one consumer, or
`completed` (by the consumer whose report was accepted). A consumer's leases live as long as the
consumer does: each of its calls renews its expiry; once that passes, every request it holds is
re-admitted (back to `waiting` with its original arrival order, counted as re-admitted).

A `finished` report is judged before anything is applied (the strict choice):
- an id the job never had, or one named twice in the report -> `RefillRejected` (INVALID_ARGUMENT
  on the wire), nothing applied;
- an id leased to the reporter, or waiting after its lease lapsed (nobody else has it) ->
  completed now;
- an id this consumer already completed (a retried report) -> accepted again, nothing changes;
- an id completed by another consumer or leased to another one (the reporter's lease lapsed and
  it was re-admitted there) -> `stale`: not applied, returned so the consumer can drop it.
So each request completes exactly once whoever reports it and however often.

A consumer whose lease lapsed may still be working on what it held. Its next call says so: the
ids taken from it (`revoked`: re-admitted, maybe decoding elsewhere already) that it neither
reports finished in that call nor gets back in that call's admission, so it can stop them
instead of finishing work another consumer does too (a reopening narrows them to the ids it
names as still held: a restarted consumer holds nothing to stop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, field

from pipeline.refill.admission import DEFAULT_SCAN, admit
from pipeline.refill.request import RefillRequest


class RefillRejected(ValueError):
    """A refill call that cannot be applied (INVALID_ARGUMENT); the message names the ids."""


@dataclass(frozen=True)
class RefillOutcome:
    admitted: list[RefillRequest]
    completed: list[str]  # newly completed by this report (exactly once)
    stale: list[str]      # finished ids another consumer owns now (not applied)
    revoked: list[str] = field(default_factory=list)  # taken from it at a lapse: stop them


@dataclass
class Counters:
    admitted: int = 0     # admissions (a re-admitted request counts again)
    completed: int = 0
    readmitted: int = 0   # leases that lapsed or were given up on reopening
    lease_lapses: int = 0  # consumers whose lease lapsed while they held requests
    completed_by_epoch: dict[int, int] = field(default_factory=dict)


@dataclass
class LeaseTable:
    lease_ms: int
    waiting: dict[str, RefillRequest] = field(default_factory=dict)
    leased: dict[str, tuple[RefillRequest, str]] = field(default_factory=dict)
    completed: dict[str, str] = field(default_factory=dict)  # id -> the consumer that did it
    expiry: dict[str, int] = field(default_factory=dict)     # consumer -> lease expiry (ms)
    lost: dict[str, set[str]] = field(default_factory=dict)  # consumer -> ids taken at a lapse
    counters: Counters = field(default_factory=Counters)
    scan: int = DEFAULT_SCAN

    # --- transitions ---
    def enqueue(self, requests: Iterable[RefillRequest]) -> None:
        for r in requests:
            if r.request_id in self.waiting or r.request_id in self.leased or \
                    r.request_id in self.completed:
                continue  # a restarted producer re-reads rows: never a second copy
            self.waiting[r.request_id] = r

    def expire(self, now_ms: int) -> list[str]:
        """Re-admit every request of consumers whose lease passed; returns their ids."""
        dead = {c for c, t in self.expiry.items() if t <= now_ms}
        out = []
        for c in sorted(dead):
            del self.expiry[c]
            taken = self._release(lambda owner, c=c: owner == c)
            if taken:
                self.lost.setdefault(c, set()).update(taken)
                self.counters.lease_lapses += 1
            out += taken
        return out

    def open(self, consumer: str, held: Sequence[str], now_ms: int) -> list[str]:
        """A consumer (re)connects still holding `held`: its other leases are re-admitted now
        (a restarted consumer lost them), the held ones renewed. Returns the released ids."""
        self.expire(now_ms)
        keep = set(held)
        released = self._release(lambda owner: owner == consumer, keep=keep)
        self.expiry[consumer] = now_ms + self.lease_ms
        # Of what a lapse took, only what it says it still works on is worth telling it.
        lost = self.lost.pop(consumer, set()) & keep
        if lost:
            self.lost[consumer] = lost
        return released

    def refill(self, consumer: str, free_tokens: int, finished: Sequence[str],
               now_ms: int) -> RefillOutcome:
        if free_tokens < 0:
            raise RefillRejected(f"free_tokens must be >= 0, got {free_tokens}")
        self._check_known(finished)
        self.expire(now_ms)
        lost = self.lost.pop(consumer, set())
        completed, stale = [], []
        for rid in finished:
            if rid in self.completed:
                if self.completed[rid] != consumer:
                    stale.append(rid)
                continue
            if rid in self.leased and self.leased[rid][1] != consumer:
                stale.append(rid)
                continue
            held = self.leased.pop(rid, None)
            req = held[0] if held is not None else self.waiting.pop(rid)
            self.completed[rid] = consumer
            self.counters.completed += 1
            by_epoch = self.counters.completed_by_epoch
            by_epoch[req.epoch] = by_epoch.get(req.epoch, 0) + 1
            completed.append(rid)
        self.expiry[consumer] = now_ms + self.lease_ms
        idle = not any(owner == consumer for _, owner in self.leased.values())
        got = admit(self.waiting.values(), free_tokens, consumer_idle=idle, scan=self.scan)
        for r in got:
            del self.waiting[r.request_id]
            self.leased[r.request_id] = (r, consumer)
        self.counters.admitted += len(got)
        kept = {*finished, *(r.request_id for r in got)}
        return RefillOutcome(got, completed, stale, sorted(lost - kept))

    # --- derived ---
    @property
    def in_flight(self) -> int:
        return len(self.leased)

    def known(self, rid: str) -> bool:
        return rid in self.waiting or rid in self.leased or rid in self.completed

    def _check_known(self, finished: Sequence[str]) -> None:
        unknown = [r for r in finished if not self.known(r)]
        twice = sorted({r for r in finished if finished.count(r) > 1})
        if unknown or twice:
            parts = []
            if unknown:
                parts.append(f"unknown request ids {unknown}")
            if twice:
                parts.append(f"ids named twice {twice}")
            raise RefillRejected("finished: " + "; ".join(parts) + " (nothing was applied)")

    def _release(self, owned: Callable[[str], bool],
                 keep: Set[str] = frozenset()) -> list[str]:
        out = [rid for rid, (_, owner) in self.leased.items()
               if owned(owner) and rid not in keep]
        for rid in out:
            req, _ = self.leased.pop(rid)
            self.waiting[rid] = req
        self.counters.readmitted += len(out)
        return out
