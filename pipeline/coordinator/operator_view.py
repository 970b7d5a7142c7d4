"""Operator reads for `odb-pipeline status`: which jobs exist and where each one stands.

Read-only and cheap: a handful of commands per job (the per-rank part is one script, O(W)).
A `mode: refill` job has no plan or ranks: its summary carries its refill counts instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from pipeline.coordinator import registry
from pipeline.coordinator.connection import unavailable_as_error
from pipeline.coordinator.redis_job_state import RedisJobState
from pipeline.coordinator.redis_ledger_store import RedisLedgerStore
from pipeline.coordinator.refill_state import RefillCounts, RefillState
from pipeline.jobstate.interface import JobCounters, ProducerLease, RankHealth
from pipeline.modes import JobMode


@dataclass(frozen=True)
class JobSummary:
    job: registry.JobRecord
    retained_steps: int  # steps still readable in Redis (the epochs ranks may replay)
    min_acked: int
    ranks: list[RankHealth]
    lapsed_ranks: list[int]
    counters: JobCounters
    producer: ProducerLease | None
    error: str | None
    epoch_ends: int  # END records published
    exposure: dict | None  # SDO jobs: the exposure ledger's summary (epochs, min, max, p50,
    #                        max_epochs_unseen) after the last planned epoch; None otherwise
    refill: RefillCounts | None = None  # a refill job's counts (then no ranks or plan)
    refill_records: list[dict] | None = None  # ... and its first quarantine records


QUARANTINE_RECORDS = 1000  # a refill job's records read (its list keeps at most these)


def list_jobs(client: redis.Redis) -> list[str]:
    with unavailable_as_error("redis"):
        return registry.list_jobs(client)


def job_summary(client: redis.Redis, job_id: str) -> JobSummary | None:
    """None when the job does not exist (or expired)."""
    with unavailable_as_error("redis"):
        rec = registry.read_job(client, job_id)
        if rec is None:
            return None
        if rec.mode is JobMode.REFILL:
            rf = RefillState(client, job_id)
            return JobSummary(job=rec, retained_steps=0, min_acked=-1, ranks=[],
                              lapsed_ranks=[], counters=JobCounters(), producer=None,
                              error=None, epoch_ends=0, exposure=None, refill=rf.counts(),
                              refill_records=rf.quarantine(QUARANTINE_RECORDS))
        st = RedisJobState.attach(client, job_id)  # a view never creates or alters the job
        ranks = st.rank_health()
        n_ends = client.hlen(st.keys.ends)
    exposure = RedisLedgerStore(client).summary(job_id)
    return JobSummary(
        job=rec,
        retained_steps=rec.published_through - rec.trimmed_through,
        min_acked=min((r.acked for r in ranks), default=-1),
        ranks=ranks,
        lapsed_ranks=st.lapsed_ranks(),
        counters=st.counters(),
        producer=st.producer_lease(),
        error=st.error(),
        epoch_ends=n_ends,
        exposure=exposure,
    )
