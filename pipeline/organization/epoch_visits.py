"""One SDO epoch as a budget of sample visits: (graph, ledger, epoch, seed) -> (visits, ledger).

`plan_epoch_visits` is a pure function of its arguments (a state machine whose state is the
`ExposureLedger`): the same graph, ledger, epoch and seed give the same visits, so a producer
that restarts, or replays an epoch, from the ledger it stored with the plan plans the same epoch.

An epoch:
1. *Coverage floor.* Sample i must be visited by epoch `last_seen[i] + coverage_epochs` (its
   deadline). Earliest-deadline-first: the epoch visits at least the `m` samples with the
   earliest deadlines, m = max over h in [0, C) of #{deadline <= epoch + h} - h * V, the fewest
   that leave every later deadline feasible at V visits per epoch. m <= V holds exactly when
   V * C >= n (checked), so no sample goes unseen for C epochs, ever.
2. *Exposure balance.* Each sample is owed `mean(exposure) + V/n - exposure[i]` visits this
   epoch; past that the traversal accepts it only with a probability that falls with every
   visit beyond its share (`traversal`), so hubs of the graph are not over-trained.
3. *Order.* The traversal walks the graph, so consecutive visits are neighbors; the planner
   forms budgeted steps from that order.

Visit ids: the k-th visit (0-based) of sample s in an epoch is `"<s>#<k>"`, unique in the
epoch, so exactly-once delivery is of visits (a sample visited twice is delivered twice, once
per visit id). `split_visit_id` recovers (s, k).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pipeline.organization.exposure_ledger import ExposureLedger
from pipeline.organization.knn_graph import KnnGraph
from pipeline.organization.traversal import neighborhood_walk
from pipeline.planner.types import MeasuredSample, SampleId

VISIT_SEP = "#"
DEFAULT_REPEAT_GAP = 256


def visit_id(sample_id: SampleId, k: int) -> str:
    return f"{sample_id}{VISIT_SEP}{k}"


def split_visit_id(vid: str) -> tuple[str, int]:
    """`"<sample_id>#<k>"` -> (sample_id as a string, k)."""
    sid, sep, k = vid.rpartition(VISIT_SEP)
    if not sep or not k.isdigit():
        raise ValueError(f"not a visit id (<sample_id>#<k>): {vid!r}")
    return sid, int(k)


@dataclass(frozen=True, slots=True)
class Visit:
    sample_id: SampleId
    k: int  # this sample's k-th visit in the epoch (0-based)

    @property
    def visit_id(self) -> str:
        return visit_id(self.sample_id, self.k)


@dataclass(frozen=True)
class EpochVisits:
    """The visits of one epoch in traversal order, and how many the coverage floor required."""

    epoch: int
    visits: tuple[Visit, ...]
    mandatory: int

    @property
    def visit_ids(self) -> list[str]:
        return [v.visit_id for v in self.visits]

    def planner_samples(self, measured: Mapping[SampleId, MeasuredSample]) -> list[MeasuredSample]:
        """The planner's input: each visit as its sample's measured size under the visit id.
        A visit whose sample is not in `measured` (quarantined this epoch) is left out."""
        out = []
        for v in self.visits:
            m = measured.get(v.sample_id)
            if m is not None:
                out.append(MeasuredSample(v.visit_id, m.num_tokens, m.num_visual_tokens,
                                          m.loss_tokens))
        return out

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "mandatory": self.mandatory, "visits": self.visit_ids}

    @classmethod
    def from_dict(cls, d: dict, graph: KnnGraph) -> EpochVisits:
        """Inverse of `to_dict`; sample ids are resolved against `graph` (int ids stay int)."""
        by_str = {str(sid): sid for sid in graph.ids}
        visits = []
        for vid in d["visits"]:
            sid, k = split_visit_id(vid)
            if sid not in by_str:
                raise ValueError(f"visit {vid!r} names a sample that is not in the graph")
            visits.append(Visit(by_str[sid], k))
        return cls(int(d["epoch"]), tuple(visits), int(d["mandatory"]))


def mandatory_count(deadlines: np.ndarray, epoch: int, visits: int, coverage_epochs: int) -> int:
    """Fewest earliest-deadline samples epoch `epoch` must visit to keep every deadline
    feasible at `visits` per epoch (see the module docstring)."""
    n = len(deadlines)
    if n == 0:
        return 0
    d = np.sort(deadlines)
    if d[0] < epoch:
        raise ValueError(f"ledger is broken: a sample's coverage deadline (epoch {int(d[0])}) "
                         f"passed before epoch {epoch}")
    due = np.searchsorted(d, epoch + np.arange(coverage_epochs), side="right")
    m = int(max(0, (due - np.arange(coverage_epochs) * visits).max()))
    if m > visits:
        raise ValueError(f"coverage floor cannot hold: {m} samples must be visited in epoch "
                         f"{epoch} but organization.visits_per_epoch is {visits} (needs "
                         f"visits_per_epoch * coverage_epochs >= {n} samples)")
    return m


def _streams(seed: int, epoch: int) -> tuple[random.Random, np.random.Generator]:
    key = f"odb-sdo:{seed}:{epoch}"
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little")
    return random.Random(key), np.random.Generator(np.random.PCG64(digest))


def plan_epoch_visits(graph: KnnGraph, ledger: ExposureLedger, epoch: int, *, seed: int,
                      coverage_epochs: int, visits_per_epoch: int | None = None,
                      repeat_gap: int = DEFAULT_REPEAT_GAP,
                      ) -> tuple[EpochVisits, ExposureLedger]:
    """The visits of epoch `epoch` and the ledger after it (`ledger.next_epoch` must be `epoch`).

    `visits_per_epoch` None = the graph's size. `repeat_gap`: fewest visits between two visits
    of one sample (pass the planner's window so they do not share a batch). Raises ValueError
    when the ledger belongs to another graph or epoch, or the coverage floor cannot hold.
    """
    n = graph.size
    if ledger.graph_digest != graph.digest or ledger.size != n:
        raise ValueError("the exposure ledger belongs to another KNN graph (different samples "
                         "or embeddings); start a new ledger or rebuild the old graph")
    if epoch != ledger.next_epoch:
        raise ValueError(f"the ledger is before epoch {ledger.next_epoch}; cannot plan {epoch}")
    if coverage_epochs < 1:
        raise ValueError(f"coverage_epochs must be >= 1, got {coverage_epochs}")
    budget = n if visits_per_epoch is None else visits_per_epoch
    if budget < 0:
        raise ValueError(f"visits_per_epoch must be >= 0, got {budget}")
    walk_rng, key_rng = _streams(seed, epoch)
    deadlines = ledger.deadlines(coverage_epochs)
    m = mandatory_count(deadlines, epoch, budget, coverage_epochs)
    tie = key_rng.random(n)
    owed = (ledger.exposure.mean() if n else 0.0) + (budget / n if n else 0.0) - ledger.exposure
    # Jumps: the m earliest deadlines first (ties in a seeded order), then the most owed.
    by_deadline = np.lexsort((tie, deadlines))
    mandatory = np.zeros(n, dtype=bool)
    mandatory[by_deadline[:m]] = True
    rest = by_deadline[m:]
    rest = rest[np.lexsort((tie[rest], -owed[rest]))]
    jump_order = np.concatenate((by_deadline[:m], rest))
    order = neighborhood_walk(graph, budget=budget, mandatory=mandatory, owed=owed,
                              jump_order=jump_order, repeat_gap=repeat_gap, rng=walk_rng)
    counts = np.zeros(n, dtype=np.int64)
    visits = []
    for i in order:
        visits.append(Visit(graph.ids[i], int(counts[i])))
        counts[i] += 1
    return EpochVisits(epoch, tuple(visits), m), ledger.after_epoch(epoch, counts)
