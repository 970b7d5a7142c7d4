"""Prometheus metrics: a custom Collector that renders the replica's `ServiceStatus` on every
scrape.

Nothing is incremented on the hot path; each scrape asks `ServiceView` (which reads the job
state and the published plan), so the figures cannot drift from what the service did. Job-wide
series are the same on every replica (aggregate them with `max by (job_id, rank)`, not `sum`);
what only one replica knows carries a `replica` label. Counter names below get `_total` on the
wire (prometheus-client convention). The job label is `job_id`, not `job`: Prometheus sets `job`
on every scraped series itself (the scrape job), and a clash would rename ours to `exported_job`.

Label values are bounded and hold no per-record details: job ids, rank numbers, the replica id,
modes, phases, epochs and quarantine reasons from the closed vocabulary (`pipeline.quarantine`;
anything else is counted as `other`). Record ids, details, client ids and error texts are only
on the status pages and JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.observability.job_status import JobStatus, MemberStatus, RankStatus, RefillStatus
from pipeline.observability.status_view import ServiceView
from pipeline.quarantine import QuarantineReason

_REASONS = {r.value for r in QuarantineReason}

# (name, help, value of a rank): counters, then gauges.
_RANK_COUNTERS: tuple[tuple[str, str, Callable[[RankStatus], Any]], ...] = (
    ("odb_samples_emitted", "Samples the rank consumed (acknowledged)",
     lambda r: r.samples_emitted),
    ("odb_tokens_emitted", "Input tokens the rank consumed (after truncation)",
     lambda r: r.tokens_emitted),
    ("odb_padded_tokens", "Pad positions in the rank's consumed padded batches (0 packed)",
     lambda r: r.padded_tokens),
    ("odb_batches_emitted", "Batches the rank consumed", lambda r: r.batches_emitted),
    ("odb_batch_cost", "Sum of the planner cost of consumed batches (budget utilisation)",
     lambda r: r.batch_cost),
)
_RANK_GAUGES: tuple[tuple[str, str, Callable[[RankStatus], Any]], ...] = (
    ("odb_rank_acked_step", "Last step the rank acknowledged (-1 none)", lambda r: r.acked_step),
    ("odb_rank_lag_steps", "Published steps of the rank not yet acknowledged",
     lambda r: r.lag_steps),
    ("odb_rank_stalled", "1 when the rank has waiting steps and no ack progress for 30 s",
     lambda r: r.stalled),
    ("odb_rank_lapsed", "1 when the rank's lease expired without release", lambda r: r.lapsed),
    ("odb_rank_seconds_since_progress", "Seconds since the rank's acked step last moved",
     lambda r: r.seconds_since_progress),
)
# This replica's own view of a rank's stream.
_REPLICA_RANK_GAUGES: tuple[tuple[str, str, Callable[[RankStatus], Any]], ...] = (
    ("odb_replica_rank_connected", "1 while the rank has a stream open on this replica",
     lambda r: r.replica and r.replica.connected),
    ("odb_replica_rank_delivered_step", "Last step this replica sent to the rank (-1 none)",
     lambda r: r.replica and r.replica.delivered_step),
)
# A member of a rank's model-parallel group (labels job_id, rank, member: bounded by W x group
# size; its client id is on the status JSON only).
_MEMBER_GAUGES: tuple[tuple[str, str, Callable[[MemberStatus], Any]], ...] = (
    ("odb_member_acked_step", "Last step the group member acknowledged (-1 none)",
     lambda m: m.acked_step),
    ("odb_member_lag_steps", "Steps the group member is behind its group's most advanced one",
     lambda m: m.lag_steps),
    ("odb_member_lapsed", "1 when the group member's lease expired without release (a lost "
     "member: its rank is lost)", lambda m: bool(m.lapsed_for_s)),
)
_JOB_GAUGES: tuple[tuple[str, str, Callable[[JobStatus], Any]], ...] = (
    ("odb_step_published", "Highest published step (-1 none)", lambda j: j.published_through),
    ("odb_token_budget", "The job's token budget per batch", lambda j: j.token_budget),
    ("odb_world_size", "The job's world size", lambda j: j.world_size),
    ("odb_job_done", "1 once every epoch is planned", lambda j: j.done),
    # Compute balancing (docs/compute-balancing.md); absent for a job that does not use it.
    ("odb_compute_gate_open", "1 while ranks are balanced by the fitted compute model, 0 by "
     "tokens", lambda j: j.compute and j.compute.gate_open),
    ("odb_compute_fit_error", "Held-out relative error of the compute model in force",
     lambda j: j.compute and j.compute.error),
    ("odb_compute_reports_rejected", "Compute reports rejected as nonsense (negative, NaN, "
     "infinite, absurd)", lambda j: j.compute and j.compute.rejected),
    ("odb_compute_imbalance_p50", "Per-step max/mean of the ranks' measured compute, median of "
     "the newest fully reported steps", lambda j: j.compute and j.compute.imbalance_p50),
    ("odb_compute_imbalance_p90", "Per-step max/mean of the ranks' measured compute, p90",
     lambda j: j.compute and j.compute.imbalance_p90),
)
# A refill job's requests (docs/refill.md).
_REFILL_COUNTERS: tuple[tuple[str, str, Callable[[RefillStatus], Any]], ...] = (
    ("odb_refill_enqueued", "Requests made from the source (every epoch)",
     lambda f: f.enqueued),
    ("odb_refill_admitted", "Admissions (a re-admitted request counts again); rate() = "
     "admissions per second", lambda f: f.admitted),
    ("odb_refill_completed", "Requests completed (each once per epoch)", lambda f: f.completed),
    ("odb_refill_readmitted", "Leases given back (consumer gone or reopened without them)",
     lambda f: f.readmitted),
    ("odb_refill_lease_lapses", "Consumers whose lease lapsed while they held requests",
     lambda f: f.lease_lapses),
)
_REFILL_GAUGES: tuple[tuple[str, str, Callable[[RefillStatus], Any]], ...] = (
    ("odb_refill_waiting", "Requests waiting for admission", lambda f: f.waiting),
    ("odb_refill_in_flight", "Requests admitted and not finished", lambda f: f.in_flight),
    ("odb_refill_consumers", "Consumers holding a live lease", lambda f: f.consumers),
    ("odb_refill_exhausted", "1 once every source row of every epoch was read",
     lambda f: f.exhausted),
    ("odb_refill_epoch", "The epoch the refill producer reads", lambda f: f.epoch),
)
_OTHER = ("odb_replica_samples_fetched_total", "odb_samples_in_total", "odb_samples_planned_total",
          "odb_quarantined_total", "odb_job_info", "odb_job_open", "odb_job_failed",
          "odb_producer_generation", "odb_producer_live", "odb_service_start_time_seconds",
          "odb_world_generation", "odb_reconfiguration_seconds",
          "odb_reconfiguration_first_batch_seconds", "odb_compute_coefficient",
          "odb_compute_rank_seconds", "odb_source_samples", "odb_source_loss_tokens",
          "odb_source_quarantined", "odb_source_share", "odb_source_target_share")
# A mixture job's sources (docs/data-order.md): the current epoch's published steps, per
# source (the `source` label is a source's name in the job's config: bounded).
_SOURCE_GAUGES = (
    ("odb_source_samples", "Samples of the source in the epoch's published steps",
     lambda x: x.samples),
    ("odb_source_loss_tokens", "Loss tokens of the source in the epoch's published steps",
     lambda x: x.loss_tokens),
    ("odb_source_quarantined", "The source's records quarantined this epoch",
     lambda x: x.quarantined),
    ("odb_source_share", "The source's share of the epoch's plan so far (in the job's mix_by)",
     lambda x: x.share),
    ("odb_source_target_share", "The share the mixture in force gives the source",
     lambda x: x.target),
)


def _n(value: object) -> float:
    return float(value) if value is not None else float("nan")


def _reason(reason: str) -> str:
    return reason if reason in _REASONS else "other"


class OdbCollector(Collector):
    def __init__(self, view: ServiceView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        status = self.view.status()
        replica = status.replica_id
        rank_counters = [(CounterMetricFamily(n, d, labels=["job_id", "rank"]), f)
                         for n, d, f in _RANK_COUNTERS]
        rank_gauges = [(GaugeMetricFamily(n, d, labels=["job_id", "rank"]), f)
                       for n, d, f in _RANK_GAUGES]
        replica_gauges = [(GaugeMetricFamily(n, d, labels=["job_id", "rank", "replica"]), f)
                          for n, d, f in _REPLICA_RANK_GAUGES]
        member_gauges = [(GaugeMetricFamily(n, d, labels=["job_id", "rank", "member"]), f)
                         for n, d, f in _MEMBER_GAUGES]
        job_gauges = [(GaugeMetricFamily(n, d, labels=["job_id"]), f) for n, d, f in _JOB_GAUGES]
        refill_counters = [(CounterMetricFamily(n, d, labels=["job_id"]), f)
                           for n, d, f in _REFILL_COUNTERS]
        refill_gauges = [(GaugeMetricFamily(n, d, labels=["job_id"]), f)
                         for n, d, f in _REFILL_GAUGES]
        refill_epoch = CounterMetricFamily("odb_refill_epoch_completed",
                                           "Requests of the epoch completed",
                                           labels=["job_id", "epoch"])
        fetched = CounterMetricFamily("odb_replica_samples_fetched",
                                      "Sample payloads this replica fetched for the rank",
                                      labels=["job_id", "rank", "replica"])
        samples_in = CounterMetricFamily("odb_samples_in",
                                         "Source rows that became samples (all epochs)",
                                         labels=["job_id"])
        planned = CounterMetricFamily("odb_samples_planned", "Samples in published steps",
                                      labels=["job_id"])
        quarantined = CounterMetricFamily("odb_quarantined",
                                          "Records set aside, by reason", labels=["job_id",
                                                                                  "reason"])
        info = GaugeMetricFamily("odb_job_info", "1 for every job this replica serves, by mode",
                                 labels=["job_id", "mode"])
        open_ = GaugeMetricFamily("odb_job_open", "1 when the job is served without a "
                                  "credential (no token)", labels=["job_id"])
        failed = GaugeMetricFamily("odb_job_failed", "1 when the job's producer failed",
                                   labels=["job_id"])
        generation = GaugeMetricFamily("odb_producer_generation",
                                       "Fencing generation of the job's producer lease",
                                       labels=["job_id"])
        live = GaugeMetricFamily("odb_producer_live", "1 while a producer lease is live",
                                 labels=["job_id"])
        world_gen = GaugeMetricFamily("odb_world_generation",
                                      "Reconfigurations so far (the current world's generation)",
                                      labels=["job_id"])
        switch = GaugeMetricFamily(
            "odb_reconfiguration_seconds", "The latest reconfiguration, from its request to: "
            "the new plan published (adopted), every old rank's END (drained), the first batch "
            "at every new rank (first_batch)", labels=["job_id", "phase"])
        first_batch = GaugeMetricFamily(
            "odb_reconfiguration_first_batch_seconds",
            "The latest reconfiguration, from its request to the rank's first batch in the new "
            "world", labels=["job_id", "rank"])
        coefficient = GaugeMetricFamily(
            "odb_compute_coefficient", "The compute model in force: seconds per unit of a batch "
            "feature", labels=["job_id", "feature"])
        rank_seconds = GaugeMetricFamily(
            "odb_compute_rank_seconds", "The newest fully reported step: a rank's measured "
            "compute seconds, and those its step's model predicted",
            labels=["job_id", "rank", "kind"])
        sources = [(GaugeMetricFamily(n, d, labels=["job_id", "source", "mix_by"]), f)
                   for n, d, f in _SOURCE_GAUGES]
        for job in status.jobs:
            jid = job.job_id
            for x in job.sources.sources if job.sources else ():
                for fam, f in sources:
                    fam.add_metric([jid, x.name, job.sources.mix_by], _n(f(x)))
            c = job.compute
            if c is not None:
                for feature, v in (c.coefficients or {}).items():
                    coefficient.add_metric([jid, feature], v)
                for kind, per_rank in (("measured", c.rank_measured_s),
                                       ("predicted", c.rank_predicted_s)):
                    for r, v in (per_rank or {}).items():
                        rank_seconds.add_metric([jid, str(r), kind], v)
            info.add_metric([jid, job.mode], 1.0)
            open_.add_metric([jid], 1.0 if job.open else 0.0)
            failed.add_metric([jid], 1.0 if job.error else 0.0)
            for reason, n in (job.quarantine.by_reason or {}).items() if job.quarantine else ():
                quarantined.add_metric([jid, _reason(reason)], n)
            if job.refill is not None:
                for fam, f in refill_counters + refill_gauges:
                    fam.add_metric([jid], _n(f(job.refill)))
                for e in job.refill.by_epoch:
                    refill_epoch.add_metric([jid, str(e.epoch)], e.completed)
                continue
            for r in job.ranks or ():
                labels = [jid, str(r.rank)]
                for fam, f in rank_counters + rank_gauges:
                    fam.add_metric(labels, _n(f(r)))
                for fam, f in replica_gauges:
                    fam.add_metric([*labels, replica], _n(f(r)))
                if r.replica is not None:
                    fetched.add_metric([*labels, replica], r.replica.samples_fetched or 0)
                for m in r.members or ():
                    for fam, f in member_gauges:
                        fam.add_metric([*labels, str(m.member)], _n(f(m)))
            for fam, f in job_gauges:
                fam.add_metric([jid], _n(f(job)))
            samples_in.add_metric([jid], job.samples_in or 0)
            planned.add_metric([jid], job.planned.samples if job.planned else 0)
            prod = job.producer
            generation.add_metric([jid], prod.generation if prod else 0.0)
            live.add_metric([jid], 1.0 if prod and prod.live else 0.0)
            latest = job.worlds[-1] if job.worlds else None
            if latest is None:
                continue
            world_gen.add_metric([jid], latest.generation)
            if latest.generation > 0:
                for phase in ("adopted", "drained", "first_batch"):
                    t = getattr(latest, f"{phase}_s")
                    if t is not None:
                        switch.add_metric([jid, phase], t)
                for r, t in (latest.first_batch_s_by_rank or {}).items():
                    if t is not None:
                        first_batch.add_metric([jid, str(r)], t)
        start = GaugeMetricFamily("odb_service_start_time_seconds",
                                  "Unix time the metrics view of this replica started")
        start.add_metric([], self.view.started_at)
        for group in (rank_counters, rank_gauges, replica_gauges, member_gauges, job_gauges,
                      refill_counters, refill_gauges, sources):
            yield from (fam for fam, _ in group)
        yield from (refill_epoch, fetched, samples_in, planned, quarantined, info, open_,
                    failed, generation, live, start, world_gen, switch, first_batch, coefficient,
                    rank_seconds)


def metric_names() -> set[str]:
    """Every family name this collector can emit (as written in PromQL: counters with _total)."""
    names = {f"{n}_total" for n, _, _ in _RANK_COUNTERS + _REFILL_COUNTERS}
    names |= {n for n, _, _ in _RANK_GAUGES + _REPLICA_RANK_GAUGES + _JOB_GAUGES
              + _REFILL_GAUGES}
    names |= {n for n, _, _ in _MEMBER_GAUGES}
    return names | set(_OTHER) | {"odb_refill_epoch_completed_total"}
