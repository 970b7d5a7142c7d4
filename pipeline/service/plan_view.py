"""What the rank streams of one replica read of a job's plan, at most one round trip per fact.

With the state in another process (Redis), every stream reading the plan itself would cost a
round trip per check per rank. Here the plan's head (`published_through` and the current world,
read together) is read at most every `refresh_seconds` (so it is stale by at most that, and
never ahead of the state: it is only ever a value the state returned); steps are write-once,
so a cached one is always correct, and so are END records within a world (a switch may void a
fully planned job's last END: they are read again after one). A
stream reads only its own rank's batch of a step (`step_for`), with its next few published
steps read ahead: the reads of all streams waiting meanwhile go together in one round trip.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

from pipeline.jobstate.interface import JobState
from pipeline.jobstate.worlds import PlanHead
from pipeline.planner.types import EpochEnd, Step
from pipeline.service.coalescer import Coalescer


class PlanView:
    def __init__(self, state: JobState, *, refresh_seconds: float = 0.025,
                 cache_size: int = 4096, read_ahead: int = 8) -> None:
        self.state = state
        self.refresh_seconds = refresh_seconds
        self.read_ahead = read_ahead
        self._pt_lock = threading.Lock()
        self._pt: tuple[float, PlanHead | None, BaseException | None] | None = None  # at, v, err
        self._steps_lock = threading.Lock()
        self._steps: OrderedDict[tuple[int, int], Step] = OrderedDict()
        self._cache_size = cache_size
        self._fetch = Coalescer(self._fetch_many)
        self._ends_lock = threading.Lock()
        self._ends: dict[int, EpochEnd] = {}
        self._ends_at = -1.0
        self._generation = 0  # the world of the ENDs cached

    def head(self) -> PlanHead:
        """At most `refresh_seconds` stale; a failed read is re-raised to every reader of the
        same interval (no retry storm)."""
        with self._pt_lock:
            c = self._pt
            if c is None or time.monotonic() - c[0] >= self.refresh_seconds:
                at = time.monotonic()
                try:
                    c = (at, self._new_head(self.state.head()), None)
                except Exception as exc:
                    c = (at, None, exc)
                self._pt = c
            if c[2] is not None:
                raise c[2]
            return c[1]  # type: ignore[return-value]

    def published_through(self) -> int:
        return self.head().published_through

    # --- without I/O: what the cache holds now (an event loop must not block on the state) ---
    def head_age(self) -> float:
        """Seconds since the head was read (inf: never, or the read failed)."""
        c = self._pt
        return float("inf") if c is None or c[1] is None else time.monotonic() - c[0]

    def cached_head(self) -> PlanHead | None:
        """The head if read less than `refresh_seconds` ago (None: stale, failed or never
        read; `head()` reads it)."""
        c = self._pt
        if c is None or c[1] is None or time.monotonic() - c[0] >= self.refresh_seconds:
            return None
        return c[1]

    def cached_step(self, n: int, rank: int) -> Step | None:
        with self._steps_lock:
            return self._steps.get((n, rank))

    def cached_epoch_end(self, epoch: int) -> tuple[bool, EpochEnd | None]:
        """(known, END): known when the END is cached or its absence was read less than
        `refresh_seconds` ago; else `epoch_end(epoch)` reads it."""
        with self._ends_lock:
            hit = self._ends.get(epoch)
            fresh = time.monotonic() - self._ends_at < self.refresh_seconds
            return hit is not None or fresh, hit

    def fetch_steps(self, keys: Sequence[tuple[int, int]]) -> list[Step | None]:
        """`step_for` of several (step, rank) keys in one round trip (with read-ahead)."""
        return self._fetch_many(keys)

    def fresh_head(self) -> PlanHead:
        """Read the state now (before refusing a request that a stale value would refuse)."""
        v = self._new_head(self.state.head())
        with self._pt_lock:
            self._pt = (time.monotonic(), v, None)
        return v

    def _new_head(self, head: PlanHead) -> PlanHead:
        """A world switch can void an END (a fully planned job reopened, docs/elastic.md):
        the cached ENDs are read again after one."""
        if head.generation != self._generation:
            with self._ends_lock:
                self._ends.clear()
                self._ends_at = -1.0
            self._generation = head.generation
        return head

    def fresh_published_through(self) -> int:
        return self.fresh_head().published_through

    def step_for(self, n: int, rank: int) -> Step | None:
        """Step `n` with only `rank`'s batch (none if the rank is absent from it); None if the
        state does not hold the step (not published, or trimmed)."""
        with self._steps_lock:
            hit = self._steps.get((n, rank))
            if hit is not None:
                self._steps.move_to_end((n, rank))
                return hit
        return self._fetch((n, rank))

    def _fetch_many(self, keys: Sequence[tuple[int, int]]) -> list[Step | None]:
        # A rank reads its steps in order: with a miss, also read its next published steps
        # (`read_ahead`), all in the same round trip.
        pt = self._pt
        through = pt[1].published_through if pt is not None and pt[1] is not None else -1
        by_step: dict[int, set[int]] = {}
        with self._steps_lock:
            for n, r in keys:
                by_step.setdefault(n, set()).add(r)
                for m in range(n + 1, min(n + self.read_ahead, through) + 1):
                    if (m, r) not in self._steps:
                        by_step.setdefault(m, set()).add(r)
        wanted = [(n, sorted(ranks)) for n, ranks in by_step.items()]
        got: dict[tuple[int, int], Step | None] = {}
        for (n, ranks), step in zip(wanted, self.state.get_steps_for(wanted), strict=True):
            for r in ranks:
                got[(n, r)] = None if step is None else replace(
                    step, batches=tuple(b for b in step.batches if b.rank == r))
        with self._steps_lock:
            for k, v in got.items():
                if v is not None:
                    self._steps[k] = v
            while len(self._steps) > self._cache_size:
                self._steps.popitem(last=False)
        return [got[k] for k in keys]

    def epoch_end(self, epoch: int) -> EpochEnd | None:
        """Epoch `epoch`'s END record, None if not yet published (a miss re-reads the state at
        most every `refresh_seconds`)."""
        with self._ends_lock:
            hit = self._ends.get(epoch)
            if hit is not None or time.monotonic() - self._ends_at < self.refresh_seconds:
                return hit
            self._ends_at = time.monotonic()
            for e in self.state.epoch_ends():
                self._ends.setdefault(e.epoch, e)
            return self._ends.get(epoch)
