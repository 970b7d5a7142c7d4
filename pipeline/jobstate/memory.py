"""`MemoryJobState`: the `JobState` contract kept in this process (one server, nothing survives
a restart). Thread-safe with one lock; it holds metadata only (steps name samples, never hold
payloads). The reference implementation the contract tests run against beside Redis.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from pipeline.errors import (
    AckAheadOfPlan,
    CheckpointConflict,
    Fenced,
    RankHeld,
    StepConflict,
    StepGap,
)
from pipeline.jobstate.interface import (
    JobCounters,
    JobState,
    PlannerCheckpoint,
    ProducerLease,
    Publication,
    QuarantineEntry,
    RankHealth,
    RankLease,
)
from pipeline.planner.types import EpochEnd, Step


class MemoryJobState(JobState):
    def __init__(self, job_id: str, world_size: int, mode: str = "join", *,
                 clock: Callable[[], float] = time.time) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.job_id, self.world_size, self.mode = job_id, world_size, mode
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: dict[int, Step] = {}
        self._through = -1
        self._ends: dict[int, EpochEnd] = {}
        self._done = False
        self._checkpoint: PlannerCheckpoint | None = None
        self._producer: ProducerLease | None = None
        self._generation = 0
        self._error: str | None = None
        self._leases: dict[int, RankLease] = {}
        self._heartbeats: dict[int, float] = {}
        self._lapsed: set[int] = set()
        self._claimed: set[int] = set()  # ranks that ever held a lease
        self._first_claim: float | None = None
        self._acked = [-1] * world_size
        self._counts: Counter = Counter()
        self._quarantine: dict[str, QuarantineEntry] = {}  # insertion-ordered, one per id

    # --- the plan ---
    def _check_fence(self, fence: int) -> None:
        p = self._producer
        if p is None or p.generation != fence or p.expires_at <= self._clock():
            raise Fenced(f"job {self.job_id!r}: producer generation {fence} is not the live "
                         f"lease holder (current: {p.generation if p else None})")

    def _check_batches(self, step: Step) -> None:
        ranks = [b.rank for b in step.batches]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"job {self.job_id!r}: step {step.step}: a rank appears twice in "
                             f"batches: {ranks}")
        for r in ranks:
            self._check_rank(r)

    def publish(self, publication: Publication, *, fence: int) -> int:
        for step in publication.steps:
            self._check_batches(step)
        with self._lock:
            self._check_fence(fence)
            cp = publication.checkpoint
            old = self._checkpoint
            if old is not None and cp.position < old.position:
                raise CheckpointConflict(f"job {self.job_id!r}: checkpoint at {cp.position} "
                                         f"goes backwards from {old.position}")
            retry = old is not None and cp.position == old.position
            expect = self._through + 1
            new: list[Step] = []
            for step in publication.steps:
                have = self._steps.get(step.step) or next(
                    (s for s in new if s.step == step.step), None)
                if have is not None:
                    if have != step:
                        raise StepConflict(f"job {self.job_id!r}: step {step.step} is already "
                                           "published with different content")
                elif step.step == expect:
                    new.append(step)
                    expect += 1
                else:
                    raise StepGap(f"job {self.job_id!r}: cannot publish step {step.step}, the "
                                  f"next step to publish is {expect}")
            if new and self._done:
                raise StepConflict(f"job {self.job_id!r} is marked done: no new steps")
            ends: dict[int, EpochEnd] = {}
            for end in publication.ends:
                have_end = self._ends.get(end.epoch) or ends.get(end.epoch)
                if have_end is not None and have_end != end:
                    raise StepConflict(f"job {self.job_id!r}: epoch {end.epoch} already has a "
                                       "different END record")
                ends[end.epoch] = end
            if old is not None and cp.next_step < old.next_step:
                raise CheckpointConflict(f"job {self.job_id!r}: checkpoint next_step "
                                         f"{cp.next_step} goes backwards from {old.next_step}")
            if cp.next_step > expect:
                raise CheckpointConflict(f"job {self.job_id!r}: checkpoint next_step "
                                         f"{cp.next_step} claims unpublished steps (next is "
                                         f"{expect})")
            for step in new:
                self._steps[step.step] = step
                self._counts["samples_planned"] += step.info.step_samples
                self._counts["tokens_planned"] += step.info.step_tokens
            self._through = expect - 1
            for end in publication.ends:
                self._ends.setdefault(end.epoch, end)
            self._checkpoint = cp
            self._done = self._done or publication.done
            if not retry:
                self._counts["samples_in"] += publication.samples_in
                for q in publication.quarantined:
                    if q.sample_id not in self._quarantine:
                        self._quarantine[q.sample_id] = q
                        self._counts[f"q:{q.reason}"] += 1
            return len(new)

    def get_step(self, step: int) -> Step | None:
        with self._lock:
            return self._steps.get(step)

    def get_step_for(self, step: int, ranks: Sequence[int]) -> Step | None:
        with self._lock:
            s = self._steps.get(step)
        if s is None:
            return None
        want = set(ranks)
        return Step(s.epoch, s.step, tuple(b for b in s.batches if b.rank in want), s.info)

    def published_through(self) -> int:
        with self._lock:
            return self._through

    def trimmed_through(self) -> int:
        return -1  # nothing is trimmed in memory

    def epoch_ends(self) -> list[EpochEnd]:
        with self._lock:
            return [self._ends[e] for e in sorted(self._ends)]

    def is_done(self) -> bool:
        with self._lock:
            return self._done

    def load_checkpoint(self) -> PlannerCheckpoint | None:
        with self._lock:
            return self._checkpoint

    # --- the producer lease ---
    def claim_producer(self, holder: str, lease_seconds: float) -> int | None:
        if not holder:
            raise ValueError("holder must be non-empty")
        now = self._clock()
        with self._lock:
            p = self._producer
            if p is not None and p.holder != holder and p.expires_at > now:
                return None
            self._generation += 1
            self._producer = ProducerLease(self._generation, holder, now + lease_seconds)
            return self._generation

    def renew_producer(self, generation: int, lease_seconds: float) -> None:
        now = self._clock()
        with self._lock:
            p = self._producer
            if p is None or p.generation != generation:
                raise Fenced(f"job {self.job_id!r}: producer generation {generation} was "
                             f"replaced by {p.generation if p else None}")
            self._producer = ProducerLease(generation, p.holder, now + lease_seconds)

    def release_producer(self, generation: int) -> None:
        with self._lock:
            p = self._producer
            if p is not None and p.generation == generation:
                self._producer = ProducerLease(generation, p.holder, 0.0)

    def producer_lease(self) -> ProducerLease | None:
        with self._lock:
            return self._producer

    def set_error(self, message: str, *, fence: int) -> None:
        with self._lock:
            self._check_fence(fence)
            self._error = message

    def error(self) -> str | None:
        with self._lock:
            return self._error

    # --- ranks ---
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"job {self.job_id!r}: rank {rank} outside 0..{self.world_size - 1}")

    def _take(self, rank: int, client_id: str, lease_seconds: float, now: float) -> RankLease:
        cur = self._leases.get(rank)
        if cur is not None and cur.client_id != client_id:
            self._lapsed.add(rank)
            self._counts["lease_lapses"] += 1
        lease = RankLease(rank, client_id, now + lease_seconds)
        self._leases[rank] = lease
        self._claimed.add(rank)
        if self._first_claim is None:
            self._first_claim = now
        self._heartbeats[rank] = now
        return lease

    def claim_rank(self, rank: int, client_id: str, lease_seconds: float) -> RankLease:
        if not client_id:
            raise ValueError("client_id must be non-empty")
        self._check_rank(rank)
        now = self._clock()
        with self._lock:
            cur = self._leases.get(rank)
            if cur is not None and cur.client_id != client_id and cur.expires_at > now:
                raise RankHeld(f"job {self.job_id!r}: rank {rank} is held by client "
                               f"{cur.client_id!r} for {cur.expires_at - now:.1f}s more")
            return self._take(rank, client_id, lease_seconds, now)

    def release_rank(self, rank: int, client_id: str) -> None:
        self._check_rank(rank)
        with self._lock:
            cur = self._leases.get(rank)
            if cur is not None and cur.client_id == client_id:
                del self._leases[rank]
                self._heartbeats.pop(rank, None)

    def heartbeat(self, rank: int, client_id: str, lease_seconds: float) -> bool:
        if not client_id:
            raise ValueError("client_id must be non-empty")
        self._check_rank(rank)
        now = self._clock()
        with self._lock:
            cur = self._leases.get(rank)
            if cur is not None and cur.client_id != client_id and cur.expires_at > now:
                return False
            self._take(rank, client_id, lease_seconds, now)
            return True

    def _ack_locked(self, rank: int, step: int) -> None:
        if step > self._through:
            raise AckAheadOfPlan(f"job {self.job_id!r}: ack of step {step} but only steps "
                                 f"through {self._through} are published")
        self._acked[rank] = max(self._acked[rank], step)

    def ack(self, rank: int, step: int) -> None:
        self._check_rank(rank)
        if step < 0:
            return
        with self._lock:
            self._ack_locked(rank, step)

    def ack_many(self, acks: Sequence[tuple[int, int]]) -> list[Exception | None]:
        out: list[Exception | None] = []
        with self._lock:
            for rank, step in acks:
                try:
                    self._check_rank(rank)
                    if step >= 0:
                        self._ack_locked(rank, step)
                    out.append(None)
                except (AckAheadOfPlan, ValueError) as exc:
                    out.append(exc)
        return out

    def acked(self, rank: int) -> int:
        self._check_rank(rank)
        with self._lock:
            return self._acked[rank]

    def acked_all(self) -> list[int]:
        with self._lock:
            return list(self._acked)

    def lapsed_ranks(self) -> list[int]:
        now = self._clock()
        with self._lock:
            live = {r for r, lease in self._leases.items() if lease.expires_at <= now}
            return sorted(self._lapsed | live)

    def timed_out_ranks(self, timeout_seconds: float) -> dict[int, float]:
        now = self._clock()
        limit = max(0.0, timeout_seconds)
        with self._lock:
            out = {r: now - lease.expires_at for r, lease in self._leases.items()
                   if now - lease.expires_at > limit}
            if self._first_claim is not None and now - self._first_claim > limit:
                out.update({r: now - self._first_claim for r in range(self.world_size)
                            if r not in self._claimed})
            return dict(sorted(out.items()))

    def rank_health(self) -> list[RankHealth]:
        now = self._clock()
        with self._lock:
            out = []
            for r in range(self.world_size):
                lease = self._leases.get(r)
                hb = self._heartbeats.get(r)
                out.append(RankHealth(
                    rank=r, acked=self._acked[r],
                    client_id=lease.client_id if lease else None,
                    lease_expires_at=lease.expires_at if lease else None,
                    heartbeat_age=now - hb if hb is not None and lease else None,
                    lapsed_for=max(0.0, now - lease.expires_at) if lease else 0.0))
            return out

    # --- counts ---
    def counters(self) -> JobCounters:
        with self._lock:
            c = self._counts
            reasons = {k[2:]: n for k, n in sorted(c.items()) if k.startswith("q:")}
            return JobCounters(samples_in=c["samples_in"], samples_planned=c["samples_planned"],
                               tokens_planned=c["tokens_planned"],
                               quarantined=sum(reasons.values()),
                               quarantined_by_reason=reasons, lease_lapses=c["lease_lapses"])

    def quarantine(self, limit: int = 1000) -> list[QuarantineEntry]:
        with self._lock:
            return list(self._quarantine.values())[:max(0, limit)]
