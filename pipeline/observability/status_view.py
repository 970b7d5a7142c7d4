"""Builds `JobStatus` values (job_status.py): a replica's view of its jobs, and the builders the
status client reuses on Redis alone.

Job-wide facts are read from each job's state (the same on every replica: plan, cursors,
counters, quarantine, producer lease, errors; a refill job's `RefillState`); consumption totals
are derived from the plan up to each rank's acknowledged step (`plan_totals.py`), so they are
exact with N replicas. What only this replica knows (which ranks are connected *here*, what it
delivered, which payloads it fetched) comes from the runtimes' published `facts()` and sits in
each rank's `replica` part. `ServiceView` is what GetJob, `/metrics`, `/status.json` and the
status page render; rates are since the view started (`basis: uptime`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.modes import JobMode
from pipeline.observability.job_status import (
    ComputeStatus,
    EpochEndStatus,
    JobStatus,
    MemberStatus,
    MixChangeStatus,
    MixtureStatus,
    Planned,
    ProducerStatus,
    ProducerTrouble,
    QuarantineRecord,
    QuarantineStatus,
    RankOnReplica,
    RankStatus,
    RefillEpoch,
    RefillRates,
    RefillStatus,
    ReplicaStatus,
    ServiceStatus,
    SourceShareStatus,
    Throughput,
    Totals,
    WorldStatus,
)
from pipeline.observability.plan_totals import STALL_AFTER_S, PlanTotals
from pipeline.planner.compute_fit import FEATURES

if TYPE_CHECKING:
    from pipeline.config import TrainingJobConfig
    from pipeline.coordinator.refill_state import RefillCounts
    from pipeline.jobstate.interface import (
        ComputeFitStatus,
        GroupHealth,
        JobState,
        SourceStatus,
    )
    from pipeline.service.job_runtime import JobRuntime, ReplicaFacts
    from pipeline.service.refill_server import RefillJob
    from pipeline.service.server import RunningService

MAX_RECORDS = 1000  # quarantine records listed per job (the count is always exact)


def training_state(*, error: str | None, done: bool, published_through: int,
                   final_steps: Sequence[int] | None, acked: Sequence[int],
                   holders: Sequence[str | None] = ()) -> str:
    """failed | finished (every rank acked its last step) | waiting for ranks (steps are
    published, no rank has acked one or holds a lease yet) | draining (planning over, ranks
    still consuming) | running | waiting (nothing published yet). `holders`: each rank's lease
    holder (None or "": none)."""
    if error:
        return "failed"
    if done and final_steps is not None and all(a >= f for a, f in zip(acked, final_steps,
                                                                       strict=False)):
        return "finished"
    if published_through < 0:
        return "waiting"
    if all(a < 0 for a in acked) and not any(holders):
        return "waiting for ranks"
    return "draining" if done else "running"


def refill_state(done: bool) -> str:
    return "done" if done else "serving"


def world_statuses(state: JobState) -> tuple[WorldStatus, ...]:
    """The job's worlds by generation, with the timings of each switch (docs/elastic.md)."""
    out = []
    for w in state.worlds():
        t = state.world_timings(w.generation)

        def since(at: float | None, t=t) -> float | None:
            return None if at is None or t is None else at - t.requested_at

        first = {} if t is None else t.first_batch_at
        left = {} if t is None else t.left_at
        out.append(WorldStatus(
            generation=w.generation, world_size=w.world_size, first_step=w.first_step,
            last_step=w.last_step, rank_last_steps=tuple(w.last_steps or ()),
            reason=w.reason.value, requested_at=w.requested_at,
            returned_samples=w.returned_samples,
            adopted_s=since(t.adopted_at) if t else None,
            drained_s=since(max(left.values())) if left else None,
            first_batch_s=None if t is None else t.first_batch_seconds(w.world_size),
            first_batch_s_by_rank={r: since(at) for r, at in sorted(first.items())},
            live_ranks=tuple(w.live_ranks), left_ranks=tuple(sorted(left))))
    return tuple(out)


def reconfiguring(worlds: Sequence[WorldStatus]) -> bool:
    """The latest switch is not complete: its plan is not adopted, or a rank that was live at
    the boundary has not left the old world yet."""
    if len(worlds) < 2:
        return False
    latest, before = worlds[-1], worlds[-2]
    return latest.adopted_s is None or not set(before.live_ranks or ()) <= set(
        latest.left_ranks or ())


def _rates(totals: Totals, since: Totals | None, window_s: float, basis: str) -> Throughput:
    w = max(window_s, 1e-9)
    b = since or Totals(0, 0, 0, 0, 0)
    return Throughput(basis=basis, window_s=window_s,
                      samples_per_s=(totals.samples_emitted - b.samples_emitted) / w,
                      tokens_per_s=(totals.tokens_emitted - b.tokens_emitted) / w,
                      batches_per_s=(totals.batches_emitted - b.batches_emitted) / w)


def _records(entries: Sequence[Any]) -> tuple[QuarantineRecord, ...]:
    return tuple(QuarantineRecord(q["sample_id"], q["reason"], q.get("detail", ""))
                 if isinstance(q, dict) else QuarantineRecord(q.sample_id, q.reason, q.detail)
                 for q in entries)


def _members(group: GroupHealth, facts: ReplicaFacts | None) -> tuple[MemberStatus, ...]:
    """A group's seats with their lag behind its most advanced member (and this replica's
    stream of each, with `facts`)."""
    ahead = max(m.acked for m in group.members)
    out = []
    for m in group.members:
        replica = None
        if facts is not None:
            conn = facts.members.get((group.rank, m.index))
            live = conn is not None and conn.client_id == m.client_id
            replica = RankOnReplica(bool(live and conn.connected),
                                    conn.delivered if live else -1)
        out.append(MemberStatus(m.index, m.client_id, m.acked, ahead - m.acked, m.lapsed_for,
                                m.heartbeat_age, m.released, replica))
    return tuple(out)


def training_job_status(job_id: str, state: JobState, *, job: TrainingJobConfig | None = None,
                        open: bool | None = None, error: str | None = None,
                        tracker: PlanTotals | None = None, facts: ReplicaFacts | None = None,
                        replica_id: str | None = None, records: int = 0,
                        batch_size_notice: str | None = None) -> JobStatus:
    """A training job from its state; `job` (its config: epochs, collate, budget), `tracker`
    (emission totals), `facts` (this replica's connections) where the caller has them.
    `error`: the job's failure as the caller knows it (default: the producer's, recorded in
    the state). `records`: list that many quarantine records."""
    health = state.rank_health()  # every cursor, lease and heartbeat at one instant
    acked = [h.acked for h in health]
    if tracker is not None:
        tracker.update(acked)
        published = tracker.scanned_through
    else:
        published = state.published_through()
    now = time.time()
    lapsed = set(state.lapsed_ranks())
    groups = {g.rank: g for g in state.group_health()}
    ranks = []
    for h in health:
        row: dict[str, Any] = {"rank": h.rank, "acked_step": h.acked,
                               "client_id": h.client_id or "", "lapsed": h.rank in lapsed,
                               "lapsed_for_s": h.lapsed_for, "heartbeat_age_s": h.heartbeat_age}
        if tracker is not None:
            tot = tracker.ranks[h.rank]
            lag, quiet = tracker.lag(h.rank), tracker.seconds_since_progress(h.rank, now)
            row.update(lag_steps=lag, seconds_since_progress=quiet,
                       stalled=lag > 0 and quiet >= STALL_AFTER_S, batches_emitted=tot.batches,
                       samples_emitted=tot.samples, tokens_emitted=tot.tokens,
                       padded_tokens=tot.padded_tokens, batch_cost=tot.cost)
        if facts is not None:
            conn = facts.ranks.get(h.rank)
            row["replica"] = RankOnReplica(bool(conn and conn.connected),
                                           conn.delivered if conn else -1,
                                           facts.fetched_by_rank.get(h.rank, 0))
        if h.rank in groups:
            row["members"] = _members(groups[h.rank], facts)
            if facts is not None:  # the group's streams here: connected if one is
                seen = [m.replica for m in row["members"] if m.replica.delivered_step >= 0
                        or m.replica.connected]
                row["replica"] = RankOnReplica(
                    any(r.connected for r in seen),
                    max((r.delivered_step for r in seen), default=-1),
                    facts.fetched_by_rank.get(h.rank, 0))
        ranks.append(RankStatus(**row))
    counts = state.counters()
    done = state.is_done()
    ends = state.epoch_ends()
    finals = [-1 if s is None else s for s in ends[-1].final_step] if done and ends else None
    lease = state.producer_lease()
    failure = state.producer_failure()
    error = error if error is not None else state.error()
    worlds = world_statuses(state)
    totals = throughput = None
    uptime = None
    if tracker is not None:
        # Over every rank id the job had (a reconfiguration may have ended some).
        per = tracker.ranks.values()
        totals = Totals(sum(t.batches for t in per), sum(t.samples for t in per),
                        sum(t.tokens for t in per), sum(t.padded_tokens for t in per),
                        sum(t.cost for t in per))
        uptime = now - tracker.started_at
        throughput = _rates(totals, None, uptime, "uptime")
    return JobStatus(
        job_id=job_id, mode=state.mode,
        state=training_state(error=error, done=done, published_through=published,
                             final_steps=finals, acked=acked,
                             holders=[h.client_id for h in health]),
        done=done, error=error, open=open, world_size=state.head().world_size,
        epochs=job.epochs if job else None, published_through=published,
        samples_in=counts.samples_in,
        planned=Planned(counts.samples_planned, counts.tokens_planned),
        collate=job.batching.collate if job else None,
        token_budget=job.batching.token_budget if job else None,
        global_token_budget=job.batching.global_token_budget if job else None,
        producer=None if lease is None else ProducerStatus(lease.generation, lease.holder,
                                                           lease.live),
        producer_trouble=None if failure is None or failure.permanent else ProducerTrouble(
            failure.message, failure.cause, failure.attempts, failure.since),
        uptime_s=uptime, ranks=tuple(ranks), lapsed_ranks=tuple(sorted(lapsed)),
        worlds=worlds, reconfiguring=reconfiguring(worlds),
        epoch_ends=tuple(EpochEndStatus(e.epoch, e.steps,
                                        tuple(-1 if s is None else s for s in e.final_step),
                                        len(e.carried_over)) for e in ends),
        totals=totals, throughput=throughput,
        quarantine=QuarantineStatus(counts.quarantined, dict(counts.quarantined_by_reason),
                                    _records(state.quarantine(records)) if records else None),
        replica=None if replica_id is None else ReplicaStatus(
            replica_id, facts.uptime_s if facts else None),
        batch_size_notice=batch_size_notice, compute=compute_status(state.compute_fit()),
        sources=mixture_status(state.source_status()))


def mixture_status(status: SourceStatus | None) -> MixtureStatus | None:
    """A mixture job's sources as status shows them (None: one source, or nothing planned)."""
    if status is None:
        return None
    return MixtureStatus(
        status.epoch, status.mix_by,
        tuple(SourceShareStatus(s.name, s.samples, s.loss_tokens, s.quarantined,
                                round(status.share(i), 6), s.target)
              for i, s in enumerate(status.sources)),
        tuple(MixChangeStatus(n, by, dict(w)) for n, by, w in status.changes))


def compute_status(fit: ComputeFitStatus | None) -> ComputeStatus | None:
    """The job's compute fit as status shows it (None: never recorded)."""
    if fit is None:
        return None
    ratios = sorted(r for _, r in fit.imbalance)

    def pct(q: float) -> float | None:
        return ratios[min(len(ratios) - 1, int(q * len(ratios)))] if ratios else None

    return ComputeStatus(
        gate_open=fit.gate_open,
        coefficients=dict(zip(FEATURES, fit.coefficients, strict=True)) if fit.gate_open
        else None,
        error=fit.error if fit.gate_open else None, reports=fit.reports,
        last_error=None if fit.last_error < 0 else fit.last_error, accepted=fit.accepted,
        rejected=fit.rejected, warmup=fit.warmup, stale=fit.stale, drifts=fit.drifts,
        fit_failures=fit.fit_failures,
        imbalance_last=fit.imbalance[-1][1] if fit.imbalance else None,
        imbalance_p50=pct(0.5), imbalance_p90=pct(0.9), imbalance_steps=len(ratios),
        last_step=None if fit.last_step < 0 else fit.last_step,
        rank_measured_s=dict(fit.last_measured) if fit.last_step >= 0 else None,
        rank_predicted_s=dict(fit.last_predicted) if fit.last_predicted else None)


def refill_job_status(job_id: str, c: RefillCounts, *, epochs: int | None = None,
                      open: bool | None = None, error: str | None = None,
                      rates: RefillRates | None = None, replica: ReplicaStatus | None = None,
                      records: Sequence[dict] | None = None) -> JobStatus:
    """A `mode: refill` job from its counts (`RefillState.counts()`; `error`: its producer's
    last failure; `records`: its first quarantine records, when asked for)."""
    return JobStatus(
        job_id=job_id, mode=JobMode.REFILL, state=refill_state(c.done), done=c.done, error=error,
        open=open, epochs=epochs, samples_in=c.enqueued,
        quarantine=QuarantineStatus(c.quarantined, dict(c.quarantined_by_reason),
                                    None if records is None else _records(records)),
        refill=RefillStatus(
            enqueued=c.enqueued, waiting=c.waiting, in_flight=c.in_flight,
            completed=c.completed, readmitted=c.readmitted, admitted=c.admitted,
            quarantined=c.quarantined, consumers=c.consumers, exhausted=c.exhausted,
            lease_lapses=c.lease_lapses, epoch=c.epoch, epochs=epochs,
            by_epoch=tuple(RefillEpoch(e.epoch, e.enqueued, e.completed, e.quarantined)
                           for e in c.by_epoch),
            rates=rates),
        replica=replica)


@dataclass(frozen=True)
class _Seen:
    at: float
    admitted: int
    completed: int


class ServiceView:
    """A replica's jobs (training runtimes and refill jobs) as `JobStatus` values; one
    PlanTotals per training job, the first counts seen per refill job (for its rates)."""

    def __init__(self, runtimes: Mapping[str, JobRuntime], replica_id: str = "",
                 refill_jobs: Mapping[str, RefillJob] | None = None,
                 open_jobs: Collection[str] = ()) -> None:
        self.runtimes = runtimes
        self.refill_jobs = refill_jobs or {}
        self.replica_id = replica_id
        self.open_jobs = frozenset(open_jobs)
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._totals: dict[str, PlanTotals] = {}
        self._refill_seen: dict[str, _Seen] = {}
        for rt in runtimes.values():  # count from the cursors as they are now
            self._tracker(rt)
        for job_id, rj in self.refill_jobs.items():  # ... and from the counts as they are now
            self._refill_rates(job_id, rj.state.counts())

    @classmethod
    def of(cls, service: RunningService) -> ServiceView:
        return cls(service.runtimes, service.replica_id, service.refill_jobs,
                   service.open_jobs)

    def _tracker(self, rt: JobRuntime) -> PlanTotals:
        with self._lock:
            pt = self._totals.get(rt.job.job_id)
            if pt is None or pt.state is not rt.state:
                pt = self._totals[rt.job.job_id] = PlanTotals(rt.state, rt.collate,
                                                               rt.job.batching.pad_to_multiple or 1)
            return pt

    def job_ids(self) -> list[str]:
        return sorted([*self.runtimes, *self.refill_jobs])

    def job_status(self, job_id: str, *, quarantine: bool = False,
                   error: str | None = None) -> JobStatus:
        """`job_id`'s status (KeyError: not served here); `error`: as GetJob knows it."""
        records = MAX_RECORDS if quarantine else 0
        open_ = job_id in self.open_jobs
        if job_id in self.refill_jobs:
            rj = self.refill_jobs[job_id]
            counts = rj.state.counts()
            return refill_job_status(
                job_id, counts, epochs=rj.job.epochs, open=open_,
                error=error or rj.producer.error, rates=self._refill_rates(job_id, counts),
                replica=ReplicaStatus(self.replica_id, time.time() - self.started_at),
                records=rj.state.quarantine(records) if records else None)
        rt = self.runtimes[job_id]
        return training_job_status(job_id, rt.state, job=rt.job, open=open_, error=error,
                                   tracker=self._tracker(rt), facts=rt.facts(),
                                   replica_id=self.replica_id, records=records)

    def _refill_rates(self, job_id: str, c: RefillCounts) -> RefillRates:
        now = time.time()
        with self._lock:
            first = self._refill_seen.setdefault(job_id, _Seen(self.started_at, c.admitted,
                                                               c.completed))
        w = max(now - first.at, 1e-9)
        return RefillRates("uptime", now - first.at, (c.admitted - first.admitted) / w,
                           (c.completed - first.completed) / w)

    def status(self, *, job: str | None = None, quarantine: bool = False) -> ServiceStatus:
        ids = [job] if job is not None else self.job_ids()
        return ServiceStatus(time.time(), self.started_at, self.replica_id,
                             tuple(self.job_status(j, quarantine=quarantine) for j in ids
                                   if j in self.runtimes or j in self.refill_jobs))

    def snapshot(self, *, job: str | None = None, quarantine: bool = False) -> dict[str, Any]:
        """`status()` as `/status.json` writes it."""
        from pipeline.observability.status_json import service_to_dict

        return service_to_dict(self.status(job=job, quarantine=quarantine))

    def job(self, job_id: str) -> dict[str, Any]:
        """One job as `/status.json` writes it."""
        from pipeline.observability.status_json import job_to_dict

        return job_to_dict(self.job_status(job_id))
