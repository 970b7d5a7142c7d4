"""`RedisLedgerStore`: an SDO job's organization record, epoch visits and exposure ledger in
Redis (keys `P sdo` and `P sdo_visits`, docs/redis-schema.md).

Written only by the job's producer, under its lease: every write carries the lease generation
(the fencing token) and the Lua script refuses an old one, as PUBLISH does, so a producer that
lost its lease can never record an epoch. An epoch's visits and the ledger after it are one
script (all or nothing); epochs are write-once and in order, and the producer records an epoch
before it publishes the first step planned from it, so a restarted producer or a replay reads
the very same epoch back. `summary` is kept beside the ledger so that `status` reads a few bytes,
not the per-sample arrays. A store without a fence (`RedisLedgerStore(client)`) only reads.
"""

from __future__ import annotations

import json

import redis

from pipeline.coordinator import keys, scripts
from pipeline.coordinator.connection import open_client, unavailable_as_error
from pipeline.errors import Fenced, UnknownJob
from pipeline.organization.exposure_ledger import ExposureLedger
from pipeline.organization.ledger_store import LedgerStore, canonical


class RedisLedgerStore(LedgerStore):
    def __init__(self, client_or_url: redis.Redis | str, *, fence: int | None = None) -> None:
        self.client, self._where = open_client(client_or_url)
        self.fence = fence

    def fenced(self, generation: int) -> RedisLedgerStore:
        """A view on the same client whose writes carry the producer lease `generation`."""
        view = RedisLedgerStore.__new__(RedisLedgerStore)
        view.client, view._where, view.fence = self.client, self._where, generation
        return view

    # --- reads ---
    def _hget(self, key: str, field: str | int) -> dict | None:
        with unavailable_as_error(self._where):
            raw = self.client.hget(key, field)
        return None if raw is None else json.loads(raw)

    def latest(self, job_id: str) -> dict | None:
        return self._hget(keys.JobKeys(job_id).sdo, "ledger")

    def visits(self, job_id: str, epoch: int) -> dict | None:
        return self._hget(keys.JobKeys(job_id).sdo_visits, epoch)

    def organization(self, job_id: str) -> dict | None:
        return self._hget(keys.JobKeys(job_id).sdo, "organization")

    def summary(self, job_id: str) -> dict | None:
        return self._hget(keys.JobKeys(job_id).sdo, "summary")

    # --- fenced writes ---
    def _run(self, job_id: str, script: scripts.Script, keys_: list[str], args: list) -> int:
        if self.fence is None:
            raise ValueError("this RedisLedgerStore only reads: writes need the producer's "
                             "lease generation (RedisLedgerStore.fenced)")
        with unavailable_as_error(self._where):
            try:
                return int(script(self.client, keys_, [self.fence, *args]))
            except redis.ResponseError as exc:
                code, *rest = str(exc).split()
                if code == "ODB_FENCED":
                    raise Fenced(f"job {job_id!r}: producer generation {rest[0]} may not "
                                 f"record SDO state (current: {rest[1]})") from None
                if code == "ODB_NOJOB":
                    raise UnknownJob(f"job {job_id!r} is not registered in Redis") from None
                if code == "ODB_SDO_CONFLICT":
                    raise ValueError(f"job {job_id}: the {' '.join(rest)} was already recorded "
                                     "differently (SDO state is write-once)") from None
                if code == "ODB_SDO_ORDER":
                    raise ValueError(f"job {job_id}: epoch {rest[0]} saved out of order (next "
                                     f"is {rest[1]})") from None
                raise

    def save(self, job_id: str, visits: dict, ledger_after: dict) -> None:
        epoch = int(visits["epoch"])
        if int(ledger_after["next_epoch"]) != epoch + 1:
            raise ValueError(f"job {job_id}: the ledger after epoch {epoch} must stand at epoch "
                             f"{epoch + 1}, not {ledger_after['next_epoch']}")
        summary = ExposureLedger.from_dict(ledger_after).summary()
        k = keys.JobKeys(job_id)
        self._run(job_id, scripts.sdo_epoch, [k.meta, k.sdo, k.sdo_visits],
                  [epoch, canonical(visits), canonical(ledger_after), canonical(summary)])

    def save_organization(self, job_id: str, record: dict) -> None:
        k = keys.JobKeys(job_id)
        self._run(job_id, scripts.sdo_organization, [k.meta, k.sdo], [canonical(record)])
