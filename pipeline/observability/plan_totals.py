"""Consumption counters derived from the published plan, so the data plane keeps no ledger.

A step is write-once and every rank's acknowledged step is in the job state, so "what rank r
consumed" is exactly "r's batches in published steps up to r's cursor": the same figure on every
replica, whichever replica served the rank. `PlanTotals` scans each newly published step once
(incrementally, on scrape), keeps per-step per-rank figures only until every rank present in the
step has been counted, and sums them.

Counting starts at the lowest acknowledged step seen when the tracker is created (a replica that
starts later reports from there; Prometheus treats the fresh counters as a reset). Steps trimmed
from the state before they were scanned are skipped (counted in `steps_missing`).

A reconfiguration (docs/elastic.md) ends a world: its returned batches were never consumed and
leave the figures; every rank of it is counted through its last step there (its drain delivers
them; the new world's cursors start past them). Ranks are by id (worlds reuse the ids).
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

from pipeline.jobstate.interface import JobState
from pipeline.planner.types import Batch, Step

STALL_AFTER_S = 30.0  # a rank with waiting work and no ack progress this long is "stalled"


@dataclass(frozen=True, slots=True)
class BatchFigures:
    """A rank's batches of one step (its micro-batches of a global step: `batches` of them)."""

    samples: int
    tokens: int  # input tokens after truncation
    padded_tokens: int  # pad positions the collate adds (padded: B*Lmax - sum L; packed: 0)
    cost: int  # the planner's cost of the batch (what the token budget bounds)
    batches: int = 1


@dataclass
class RankTotals:
    counted_through: int = -1  # highest step whose batch for this rank is in the totals
    batches: int = 0
    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    cost: int = 0
    last_acked: int = -1
    progress_at: float = field(default_factory=time.time)  # when last_acked last moved


def batch_figures(batch: Batch, collate: str, pad_to_multiple: int = 1) -> BatchFigures:
    lengths = [batch.truncated_to.get(s.sample_id, s.num_tokens) for s in batch.samples]
    tokens = sum(lengths)
    # Lengths as sent: rounded up to the job's pad_to_multiple (padding under both collates).
    sent = [-(-n // pad_to_multiple) * pad_to_multiple for n in lengths]
    width = len(sent) * max(sent, default=0) if collate == "padded" else sum(sent)
    return BatchFigures(len(lengths), tokens, width - tokens, batch.cost)


def rank_figures(micros: tuple[Batch, ...], collate: str, pad_to_multiple: int = 1
                 ) -> BatchFigures:
    """A rank's batches of one step, summed (one, or its micro-batches of a global step)."""
    figs = [batch_figures(b, collate, pad_to_multiple) for b in micros]
    return BatchFigures(sum(f.samples for f in figs), sum(f.tokens for f in figs),
                        sum(f.padded_tokens for f in figs), sum(f.cost for f in figs), len(figs))


class PlanTotals:
    """Per-job totals; `update()` is cheap when nothing new was published or delivered."""

    def __init__(self, state: JobState, collate: str, pad_to_multiple: int = 1) -> None:
        self.state = state
        self.collate = collate
        self.pad_to_multiple = pad_to_multiple
        self.started_at = time.time()
        self._lock = threading.Lock()
        acked = state.acked_all()
        start = min(acked, default=-1)
        self.scanned_through = start  # highest published step already scanned
        self.published_samples = 0  # all-rank samples of scanned steps (for the planner buffer)
        self.steps_missing = 0
        self.ranks: dict[int, RankTotals] = {
            r: RankTotals(counted_through=start, last_acked=a) for r, a in enumerate(acked)}
        self._pending: dict[int, dict[int, BatchFigures]] = {}  # step -> rank -> figures
        self._unacked: dict[int, list[int]] = {}  # rank -> its published steps > acked
        self._generation = state.head().generation  # the world whose cursors these are

    def update(self, acked: list[int] | None = None) -> None:
        """Catch up with the plan and the ranks' cursors (`acked`, index = rank: one read)."""
        if acked is None:
            acked = self.state.acked_all()
        with self._lock:
            self._scan_published()
            self._follow_worlds()
            now = time.time()
            for r, a in enumerate(acked):
                tot = self.ranks.setdefault(r, RankTotals(counted_through=a, last_acked=a))
                self._count_rank(r, tot, a)
                if a != tot.last_acked:
                    tot.last_acked, tot.progress_at = a, now
                steps = self._unacked.get(r, [])
                del steps[:bisect.bisect_right(steps, a)]
            # Drop steps every present rank has counted (join mode: absent ranks never count).
            done = [n for n, per in self._pending.items()
                    if all(r not in self.ranks or self.ranks[r].counted_through >= n
                           for r in per)]
            for n in done:
                del self._pending[n]

    def _follow_worlds(self) -> None:
        """After a reconfiguration: drop the returned batches, count each rank of the ended
        world through its last step there."""
        if self.state.head().generation == self._generation:
            return
        worlds = self.state.worlds()
        for w in worlds[self._generation:-1]:
            for n, per in self._pending.items():
                for r in [r for r in per if w.returned(n, r)]:
                    del per[r]
            for r, last in enumerate(w.last_steps or ()):
                tot = self.ranks.get(r)
                if tot is not None:
                    self._count_rank(r, tot, last)
                steps = self._unacked.get(r, [])
                self._unacked[r] = [n for n in steps if n > w.published_through]
        self._generation = worlds[-1].generation

    def _scan_published(self) -> None:
        through = self.state.published_through()
        for n in range(self.scanned_through + 1, through + 1):
            step: Step | None = self.state.get_step(n)
            self.scanned_through = n
            if step is None:  # trimmed before we saw it
                self.steps_missing += 1
                continue
            self.published_samples += step.info.step_samples
            ranks = step.ranks()
            self._pending[n] = {r: rank_figures(step.micros_for(r), self.collate,
                                                self.pad_to_multiple) for r in ranks}
            for r in ranks:
                self._unacked.setdefault(r, []).append(n)

    def _count_rank(self, rank: int, tot: RankTotals, acked: int) -> None:
        if acked <= tot.counted_through:
            return
        for n in sorted(k for k in self._pending if tot.counted_through < k <= acked):
            fig = self._pending[n].get(rank)
            if fig is not None:
                tot.batches += fig.batches
                tot.samples += fig.samples
                tot.tokens += fig.tokens
                tot.padded_tokens += fig.padded_tokens
                tot.cost += fig.cost
        tot.counted_through = acked

    def lag(self, rank: int) -> int:
        """Published steps of `rank` after its last ack (as of the last update)."""
        return len(self._unacked.get(rank, ()))

    def seconds_since_progress(self, rank: int, now: float | None = None) -> float:
        return (now or time.time()) - self.ranks[rank].progress_at
