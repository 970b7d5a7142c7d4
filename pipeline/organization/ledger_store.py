"""Where a job's SDO state lives between epochs, and the rule that makes replays exact.

`LedgerStore` is the interface the coordinator implements in Redis (`RedisLedgerStore`, fenced
by the producer lease): per job, the organization record (which samples the graph holds, the
planner window, the repeat gap) and each planned epoch's visits together with the ledger after
it, each written once, before the first step planned from it is published. `MemoryLedgerStore`
keeps the same records in a dict, as JSON, for the CLI and tests. `epoch_visits_for` is what a
producer calls at the start of an epoch: an epoch already planned is read back (a restart or a
replay sees the very same visits); a new one is planned from the stored ledger and saved.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod

from pipeline.organization.epoch_visits import (
    DEFAULT_REPEAT_GAP,
    EpochVisits,
    plan_epoch_visits,
)
from pipeline.organization.exposure_ledger import ExposureLedger
from pipeline.organization.knn_graph import KnnGraph


class LedgerStore(ABC):
    """Per job: the visits of each planned epoch and the ledger after it. Write-once per epoch."""

    @abstractmethod
    def latest(self, job_id: str) -> dict | None:
        """The ledger after the last saved epoch (`ExposureLedger.to_dict` form), or None."""

    @abstractmethod
    def visits(self, job_id: str, epoch: int) -> dict | None:
        """The saved visits of `epoch` (`EpochVisits.to_dict` form), or None."""

    @abstractmethod
    def save(self, job_id: str, visits: dict, ledger_after: dict) -> None:
        """Record one epoch. Saving an epoch again with other visits raises ValueError; saving
        it again identically is a no-op; epochs are saved in order (next = latest + 1)."""

    @abstractmethod
    def organization(self, job_id: str) -> dict | None:
        """The job's organization record (`Organization.record()` form), or None."""

    @abstractmethod
    def save_organization(self, job_id: str, record: dict) -> None:
        """Record the organization once: again identically is a no-op, differently a
        ValueError (a restarted producer must plan on the very same graph)."""

    def summary(self, job_id: str) -> dict | None:
        """`ExposureLedger.summary()` of the latest ledger (what `status` shows), or None."""
        raw = self.latest(job_id)
        return None if raw is None else ExposureLedger.from_dict(raw).summary()


def canonical(record: dict) -> str:
    """The one JSON text of a record, so that write-once compares texts."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


class MemoryLedgerStore(LedgerStore):
    """`LedgerStore` in memory; records are kept as JSON text, as Redis would hold them."""

    def __init__(self) -> None:
        self._visits: dict[tuple[str, int], str] = {}
        self._latest: dict[str, str] = {}
        self._organization: dict[str, str] = {}

    def latest(self, job_id: str) -> dict | None:
        raw = self._latest.get(job_id)
        return None if raw is None else json.loads(raw)

    def visits(self, job_id: str, epoch: int) -> dict | None:
        raw = self._visits.get((job_id, epoch))
        return None if raw is None else json.loads(raw)

    def save(self, job_id: str, visits: dict, ledger_after: dict) -> None:
        epoch = int(visits["epoch"])
        text = canonical(visits)
        old = self._visits.get((job_id, epoch))
        if old is not None:
            if old != text:
                raise ValueError(f"job {job_id}: epoch {epoch} was already planned differently")
            return
        prev = self.latest(job_id)
        expected = 0 if prev is None else prev["next_epoch"]
        if epoch != expected or ledger_after["next_epoch"] != epoch + 1:
            raise ValueError(f"job {job_id}: epoch {epoch} saved out of order (next is "
                             f"{expected})")
        self._visits[(job_id, epoch)] = text
        self._latest[job_id] = canonical(ledger_after)

    def organization(self, job_id: str) -> dict | None:
        raw = self._organization.get(job_id)
        return None if raw is None else json.loads(raw)

    def save_organization(self, job_id: str, record: dict) -> None:
        text = canonical(record)
        old = self._organization.setdefault(job_id, text)
        if old != text:
            raise ValueError(f"job {job_id}: the organization was already recorded differently")


def epoch_visits_for(store: LedgerStore, job_id: str, graph: KnnGraph, epoch: int, *,
                     seed: int, coverage_epochs: int, visits_per_epoch: int | None = None,
                     repeat_gap: int = DEFAULT_REPEAT_GAP) -> EpochVisits:
    """The visits of `epoch`: read back when already planned, else planned and saved.

    Planning needs the ledger before `epoch`, i.e. the stored latest ledger at `epoch` (or a
    fresh one at epoch 0); any other position is an error, never a silent re-plan.
    """
    saved = store.visits(job_id, epoch)
    if saved is not None:
        return EpochVisits.from_dict(saved, graph)
    raw = store.latest(job_id)
    ledger = (ExposureLedger.initial(graph.digest, graph.size) if raw is None
              else ExposureLedger.from_dict(raw))
    visits, after = plan_epoch_visits(graph, ledger, epoch, seed=seed,
                                      coverage_epochs=coverage_epochs,
                                      visits_per_epoch=visits_per_epoch,
                                      repeat_gap=repeat_gap)
    store.save(job_id, visits.to_dict(), after.to_dict())
    return visits
