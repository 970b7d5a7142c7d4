"""The exposure ledger: how often each sample of a job has been trained, and when last.

A value, not a store: `after_epoch` returns the next ledger, `to_dict`/`from_dict` give a JSON
form to keep beside the plan (the coordinator writes it with the epoch's steps, so a restart or a
replay plans the same epoch from the same ledger). Arrays are indexed like the `KnnGraph` whose
`digest()` the ledger carries; a ledger never meets another graph.

Per sample i:
- `exposure[i]`   visits planned so far (all epochs before `next_epoch`);
- `last_seen[i]`  last epoch with a visit, -1 before any (as if seen in epoch -1, so the
                  coverage floor's first window is epochs 0..C-1);
- `max_unseen[i]` the longest run of consecutive epochs without a visit so far, the run still
                  open included (the coverage floor keeps it <= coverage_epochs - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEDGER_VERSION = 1


def _frozen(values, name: str, n: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != (n,) or (n and arr.dtype.kind not in "iu"):
        raise ValueError(f"ledger {name} must be {n} integers, got shape {arr.shape} "
                         f"of {arr.dtype}")
    arr = arr.astype(np.int64, copy=True)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class ExposureLedger:
    graph_digest: str
    next_epoch: int
    exposure: np.ndarray
    last_seen: np.ndarray
    max_unseen: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.exposure)
        for name in ("exposure", "last_seen", "max_unseen"):
            object.__setattr__(self, name, _frozen(getattr(self, name), name, n))
        if self.next_epoch < 0:
            raise ValueError(f"ledger next_epoch must be >= 0, got {self.next_epoch}")
        if n and (self.exposure.min() < 0 or self.last_seen.min() < -1
                  or self.last_seen.max() >= self.next_epoch or self.max_unseen.min() < 0):
            raise ValueError("ledger is inconsistent (negative counts or a visit in the future)")

    @classmethod
    def initial(cls, graph_digest: str, size: int) -> ExposureLedger:
        """The ledger before a job's first epoch: nothing seen."""
        z = np.zeros(size, dtype=np.int64)
        return cls(graph_digest, 0, z, z - 1, z)

    @property
    def size(self) -> int:
        return len(self.exposure)

    def deadlines(self, coverage_epochs: int) -> np.ndarray:
        """The last epoch by which each sample must be visited again (coverage floor)."""
        return self.last_seen + coverage_epochs

    def after_epoch(self, epoch: int, counts: np.ndarray) -> ExposureLedger:
        """The ledger once epoch `epoch` (== next_epoch) planned `counts[i]` visits of sample i."""
        if epoch != self.next_epoch:
            raise ValueError(f"ledger is at epoch {self.next_epoch}, cannot record epoch {epoch}")
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != self.exposure.shape or (counts.size and counts.min() < 0):
            raise ValueError("counts must be one non-negative integer per sample")
        seen = counts > 0
        # A visit closes the unseen run (epochs last_seen+1 .. epoch-1); no visit extends it.
        run = np.where(seen, epoch - self.last_seen - 1, epoch - self.last_seen)
        return ExposureLedger(
            self.graph_digest, epoch + 1, self.exposure + counts,
            np.where(seen, epoch, self.last_seen), np.maximum(self.max_unseen, run))

    def summary(self) -> dict:
        """min / max / p50 exposure and the longest unseen run (the `plan` JSON's `exposure`)."""
        if not self.size:
            return {"epochs": self.next_epoch, "min": 0, "max": 0, "p50": 0,
                    "max_epochs_unseen": 0}
        x = np.sort(self.exposure)
        return {
            "epochs": self.next_epoch,
            "min": int(x[0]),
            "max": int(x[-1]),
            "p50": int(x[(len(x) - 1) // 2]),
            "max_epochs_unseen": int(self.max_unseen.max()),
        }

    def to_dict(self) -> dict:
        """JSON-ready state (plain ints), e.g. to keep in Redis with the plan."""
        return {
            "version": LEDGER_VERSION,
            "graph_digest": self.graph_digest,
            "next_epoch": self.next_epoch,
            "exposure": self.exposure.tolist(),
            "last_seen": self.last_seen.tolist(),
            "max_unseen": self.max_unseen.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ExposureLedger:
        if d.get("version") != LEDGER_VERSION:
            raise ValueError(f"ledger version {d.get('version')!r} is not {LEDGER_VERSION}")
        n = len(d["exposure"])
        return cls(str(d["graph_digest"]), int(d["next_epoch"]),
                   _frozen(d["exposure"], "exposure", n), _frozen(d["last_seen"], "last_seen", n),
                   _frozen(d["max_unseen"], "max_unseen", n))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExposureLedger):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]
