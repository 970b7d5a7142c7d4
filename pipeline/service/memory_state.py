"""`MemoryJobState`: the JobState protocol kept in this process (one server, no restart survival).

Thread-safe with one lock; everything is small metadata (steps hold sample ids, not payloads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pipeline.planner.types import EpochEnd, Step
from pipeline.service.job_state import PlannerCheckpoint, RankHeld, RankLease, StepConflict


class MemoryJobState:
    def __init__(self, job_id: str, clock: Callable[[], float] = time.time,
                 world_size: int | None = None) -> None:
        self.job_id = job_id
        # For `acked_all` (JobRuntime fills it in from the job when left None).
        self.world_size = world_size
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: dict[int, Step] = {}
        self._through = -1
        self._ends: list[EpochEnd] = []
        self._done = False
        self._checkpoint: PlannerCheckpoint | None = None
        self._leases: dict[int, RankLease] = {}
        self._lapsed: set[int] = set()
        self._acked: dict[int, int] = {}

    # --- the plan ---
    def publish_step(self, step: Step) -> None:
        with self._lock:
            old = self._steps.get(step.step)
            if old is not None:
                if old != step:
                    raise StepConflict(f"job {self.job_id}: step {step.step} republished "
                                       "with different content")
                return
            self._steps[step.step] = step
            self._through = max(self._through, step.step)

    def get_step(self, step: int) -> Step | None:
        with self._lock:
            return self._steps.get(step)

    def published_through(self) -> int:
        with self._lock:
            return self._through

    def publish_epoch_end(self, end: EpochEnd) -> None:
        with self._lock:
            if any(e.epoch == end.epoch for e in self._ends):
                return
            self._ends.append(end)

    def epoch_ends(self) -> list[EpochEnd]:
        with self._lock:
            return list(self._ends)

    def mark_done(self) -> None:
        with self._lock:
            self._done = True

    def is_done(self) -> bool:
        with self._lock:
            return self._done

    def save_checkpoint(self, checkpoint: PlannerCheckpoint) -> None:
        with self._lock:
            self._checkpoint = checkpoint

    def load_checkpoint(self) -> PlannerCheckpoint | None:
        with self._lock:
            return self._checkpoint

    # --- ranks ---
    def claim_rank(self, rank: int, client_id: str, lease_seconds: float) -> RankLease:
        now = self._clock()
        with self._lock:
            cur = self._leases.get(rank)
            if cur is not None and cur.client_id != client_id:
                if cur.expires_at > now:
                    raise RankHeld(
                        f"rank {rank} of job {self.job_id} is held by client {cur.client_id!r} "
                        f"for {cur.expires_at - now:.1f}s more"
                    )
                self._lapsed.add(rank)
            lease = RankLease(rank, client_id, now + lease_seconds)
            self._leases[rank] = lease
            return lease

    def release_rank(self, rank: int, client_id: str) -> None:
        with self._lock:
            cur = self._leases.get(rank)
            if cur is not None and cur.client_id == client_id:
                del self._leases[rank]

    def heartbeat(self, rank: int, client_id: str, lease_seconds: float) -> None:
        now = self._clock()
        with self._lock:
            cur = self._leases.get(rank)
            if cur is None or cur.client_id == client_id or cur.expires_at <= now:
                self._leases[rank] = RankLease(rank, client_id, now + lease_seconds)

    def lapsed_ranks(self) -> list[int]:
        now = self._clock()
        with self._lock:
            live_expired = {r for r, lease in self._leases.items() if lease.expires_at <= now}
            return sorted(self._lapsed | live_expired)

    def ack(self, rank: int, step: int) -> None:
        with self._lock:
            if step > self._acked.get(rank, -1):
                self._acked[rank] = step

    def acked(self, rank: int) -> int:
        with self._lock:
            return self._acked.get(rank, -1)

    # --- extras (not in the JobState protocol; the server uses them where a state has them,
    # as it does RedisJobState's of the same names) ---
    def acked_all(self) -> list[int]:
        """Every rank's cursor, index = rank, -1 if none (as RedisJobState.acked_all); covers
        ranks 0..world_size-1 (or up to the highest rank seen while world_size is unknown)."""
        with self._lock:
            n = max([self.world_size or 0, *(r + 1 for r in (*self._acked, *self._leases))])
            return [self._acked.get(r, -1) for r in range(n)]

    def timed_out_ranks(self, rank_timeout_seconds: float) -> dict[int, float]:
        """Ranks whose lease is lapsed *now* (held, expired, not released, not re-claimed) for
        longer than the timeout -> seconds lapsed (as RedisJobState.timed_out_ranks)."""
        now = self._clock()
        with self._lock:
            return {r: now - lease.expires_at for r, lease in sorted(self._leases.items())
                    if now - lease.expires_at > max(0.0, rank_timeout_seconds)}

    def lease(self, rank: int) -> RankLease | None:
        with self._lock:
            return self._leases.get(rank)
