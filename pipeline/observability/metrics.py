"""Prometheus metrics: a custom Collector that reads the live jobs on every scrape.

Nothing is incremented on the hot path; each scrape asks `ServiceView` (which reads the job
state and the published plan), so the figures cannot drift from what the service did. Job-wide
series are the same on every replica (aggregate them with `max by (job_id, rank)`, not `sum`);
what only one replica knows carries a `replica` label. Counter names below get `_total` on the
wire (prometheus-client convention). The job label is `job_id`, not `job`: Prometheus sets `job`
on every scraped series itself (the scrape job), and a clash would rename ours to `exported_job`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.observability.status_view import ServiceView

# Per rank, summed from the plan up to each rank's acknowledged step: (name, help, key).
_RANK_COUNTERS = (
    ("odb_samples_emitted", "Samples the rank consumed (acknowledged)", "samples_emitted"),
    ("odb_tokens_emitted", "Input tokens the rank consumed (after truncation)",
     "tokens_emitted"),
    ("odb_padded_tokens", "Pad positions in the rank's consumed padded batches (0 packed)",
     "padded_tokens"),
    ("odb_batches_emitted", "Batches the rank consumed", "batches_emitted"),
    ("odb_batch_cost", "Sum of the planner cost of consumed batches (budget utilisation)",
     "batch_cost"),
)
_RANK_GAUGES = (
    ("odb_rank_acked_step", "Last step the rank acknowledged (-1 none)", "acked_step"),
    ("odb_rank_lag_steps", "Published steps of the rank not yet acknowledged", "lag_steps"),
    ("odb_rank_stalled", "1 when the rank has waiting steps and no ack progress for 30 s",
     "stalled"),
    ("odb_rank_lapsed", "1 when the rank's lease expired without release", "lapsed"),
    ("odb_rank_seconds_since_progress", "Seconds since the rank's acked step last moved",
     "seconds_since_progress"),
)
# This replica's own view of a rank's stream: (name, help, key in rank["replica"]).
_REPLICA_RANK_GAUGES = (
    ("odb_replica_rank_connected", "1 while the rank has a stream open on this replica",
     "connected"),
    ("odb_replica_rank_delivered_step", "Last step this replica sent to the rank (-1 none)",
     "delivered_step"),
)
_JOB_GAUGES = (
    ("odb_step_published", "Highest published step (-1 none)", "published_through"),
    ("odb_token_budget", "The job's token budget per batch", "token_budget"),
    ("odb_world_size", "The job's world size", "world_size"),
    ("odb_job_done", "1 once every epoch is planned", "done"),
)


def _n(value: object) -> float:
    return float(value) if value is not None else float("nan")


class OdbCollector(Collector):
    def __init__(self, view: ServiceView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        snap = self.view.snapshot()
        replica = snap["replica_id"]
        rank_counters = {key: CounterMetricFamily(name, doc, labels=["job_id", "rank"])
                         for name, doc, key in _RANK_COUNTERS}
        rank_gauges = {key: GaugeMetricFamily(name, doc, labels=["job_id", "rank"])
                       for name, doc, key in _RANK_GAUGES}
        replica_gauges = {key: GaugeMetricFamily(name, doc, labels=["job_id", "rank", "replica"])
                          for name, doc, key in _REPLICA_RANK_GAUGES}
        fetched = CounterMetricFamily("odb_replica_samples_fetched",
                                      "Sample payloads this replica fetched for the rank",
                                      labels=["job_id", "rank", "replica"])
        job_gauges = {key: GaugeMetricFamily(name, doc, labels=["job_id"])
                      for name, doc, key in _JOB_GAUGES}
        samples_in = CounterMetricFamily("odb_samples_in",
                                         "Source rows that became samples (all epochs)",
                                         labels=["job_id"])
        planned = CounterMetricFamily("odb_samples_planned", "Samples in published steps",
                                      labels=["job_id"])
        quarantined = CounterMetricFamily("odb_quarantined",
                                          "Distinct records set aside, by reason",
                                          labels=["job_id", "reason"])
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
        for job in snap["jobs"]:
            jid = job["job_id"]
            for r in job["ranks"]:
                labels = [jid, str(r["rank"])]
                for key, fam in rank_counters.items():
                    fam.add_metric(labels, r[key])
                for key, fam in rank_gauges.items():
                    fam.add_metric(labels, _n(r[key]))
                for key, fam in replica_gauges.items():
                    fam.add_metric([*labels, replica], _n(r["replica"][key]))
                fetched.add_metric([*labels, replica], r["replica"]["samples_fetched"])
            for key, fam in job_gauges.items():
                fam.add_metric([jid], _n(job[key]))
            samples_in.add_metric([jid], job["samples_in"])
            planned.add_metric([jid], job["planned"]["samples"])
            for reason, n in job["quarantine"]["by_reason"].items():
                quarantined.add_metric([jid, reason], n)
            failed.add_metric([jid], 1.0 if job["error"] else 0.0)
            prod = job["producer"]
            generation.add_metric([jid], prod["generation"] if prod else 0.0)
            live.add_metric([jid], 1.0 if prod and prod["live"] else 0.0)
            latest = job["worlds"][-1]
            world_gen.add_metric([jid], latest["generation"])
            if latest["generation"] > 0:
                for phase in ("adopted", "drained", "first_batch"):
                    if latest[f"{phase}_s"] is not None:
                        switch.add_metric([jid, phase], latest[f"{phase}_s"])
                for r, t in latest["first_batch_s_by_rank"].items():
                    first_batch.add_metric([jid, str(r)], t)
        start = GaugeMetricFamily("odb_service_start_time_seconds",
                                  "Unix time the metrics view of this replica started")
        start.add_metric([], self.view.started_at)
        yield from rank_counters.values()
        yield from rank_gauges.values()
        yield from replica_gauges.values()
        yield from job_gauges.values()
        yield from (fetched, samples_in, planned, quarantined, failed, generation, live, start,
                    world_gen, switch, first_batch)


def metric_names() -> set[str]:
    """Every family name this collector can emit (as written in PromQL: counters with _total)."""
    names = {f"{n}_total" for n, _, _ in _RANK_COUNTERS}
    names |= {n for n, _, _ in _RANK_GAUGES + _REPLICA_RANK_GAUGES + _JOB_GAUGES}
    names |= {"odb_replica_samples_fetched_total", "odb_samples_in_total",
              "odb_samples_planned_total", "odb_quarantined_total", "odb_job_failed",
              "odb_producer_generation", "odb_producer_live", "odb_service_start_time_seconds",
              "odb_world_generation", "odb_reconfiguration_seconds",
              "odb_reconfiguration_first_batch_seconds"}
    return names
