"""Prometheus metrics: a custom Collector that reads the live jobs on every scrape.

Nothing is incremented on the hot path; each scrape asks `ServiceView` (which reads the
JobRuntimes and the published plan), so the figures cannot drift from what the service did.
Counter names below get `_total` on the wire (prometheus-client convention). The job label is
`job_id`, not `job`: Prometheus sets `job` on every scraped series itself (the scrape job), and a
clash would rename ours to `exported_job`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.observability.status_view import ServiceView

# Per rank, summed from the plan up to each rank's delivered step: (name, help, snapshot key).
_RANK_COUNTERS = (
    ("odb_samples_emitted", "Samples sent to the rank", "samples_emitted"),
    ("odb_tokens_emitted", "Input tokens sent to the rank (after truncation)", "tokens_emitted"),
    ("odb_padded_tokens", "Pad positions in the rank's padded batches (0 when packed)",
     "padded_tokens"),
    ("odb_batches_emitted", "Batches sent to the rank", "batches_emitted"),
    ("odb_batch_cost", "Sum of the planner cost of batches sent (budget utilisation)",
     "batch_cost"),
)
_RANK_GAUGES = (
    ("odb_rank_delivered_step", "Last step sent to the rank by this server (-1 none)",
     "delivered_step"),
    ("odb_rank_acked_step", "Last step the rank acknowledged (-1 none)", "acked_step"),
    ("odb_rank_lag_steps", "Published steps of the rank not yet acknowledged", "lag_steps"),
    ("odb_rank_connected", "1 while the rank has a stream open on this server", "connected"),
    ("odb_rank_stalled", "1 when the rank has waiting steps and no ack progress for 30 s",
     "stalled"),
    ("odb_rank_lapsed", "1 when the rank's lease expired without release", "lapsed"),
    ("odb_rank_seconds_since_progress", "Seconds since the rank's acked step last moved",
     "seconds_since_progress"),
)
_JOB_GAUGES = (
    ("odb_step_published", "Highest published step (-1 none)", "published_through"),
    ("odb_token_budget", "The job's token budget per batch", "token_budget"),
    ("odb_world_size", "The job's world size", "world_size"),
    ("odb_job_done", "1 once every epoch is planned", "done"),
    ("odb_planner_buffer_samples", "Samples fed to the planner, not yet in a published step",
     "planner_buffer_samples"),
    ("odb_payload_cache_samples", "Sample payloads held in memory (unacked steps + planner)",
     "payload_cache_samples"),
)


def _n(value: object) -> float:
    return float(value) if value is not None else float("nan")


class OdbCollector(Collector):
    def __init__(self, view: ServiceView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        jobs = self.view.snapshot()["jobs"]
        rank_counters = {key: CounterMetricFamily(name, doc, labels=["job_id", "rank"])
                         for name, doc, key in _RANK_COUNTERS}
        rank_gauges = {key: GaugeMetricFamily(name, doc, labels=["job_id", "rank"])
                       for name, doc, key in _RANK_GAUGES}
        job_gauges = {key: GaugeMetricFamily(name, doc, labels=["job_id"])
                      for name, doc, key in _JOB_GAUGES}
        samples_in = CounterMetricFamily("odb_samples_in", "Samples read from the job's source",
                                         labels=["job_id"])
        quarantined = CounterMetricFamily("odb_quarantined", "Records set aside, by reason",
                                          labels=["job_id", "reason"])
        failed = GaugeMetricFamily("odb_job_failed", "1 when the job's producer failed",
                                   labels=["job_id"])
        backlog = GaugeMetricFamily("odb_source_backlog_samples",
                                    "Samples preprocessed by the source, not yet read (when the "
                                    "source reports it)", labels=["job_id"])
        for job in jobs:
            jid = job["job_id"]
            for r in job["ranks"]:
                labels = [jid, str(r["rank"])]
                for key, fam in rank_counters.items():
                    fam.add_metric(labels, r[key])
                for key, fam in rank_gauges.items():
                    fam.add_metric(labels, _n(r[key]))
            for key, fam in job_gauges.items():
                fam.add_metric([jid], _n(job[key]))
            samples_in.add_metric([jid], job["samples_in"])
            for reason, n in job["quarantine"]["by_reason"].items():
                quarantined.add_metric([jid, reason], n)
            failed.add_metric([jid], 1.0 if job["error"] else 0.0)
            if job["source_backlog_samples"] is not None:
                backlog.add_metric([jid], job["source_backlog_samples"])
        start = GaugeMetricFamily("odb_service_start_time_seconds",
                                  "Unix time the metrics view of this service started")
        start.add_metric([], self.view.started_at)
        yield from rank_counters.values()
        yield from rank_gauges.values()
        yield from job_gauges.values()
        yield from (samples_in, quarantined, failed, backlog, start)


def metric_names() -> set[str]:
    """Every family name this collector can emit (as written in PromQL: counters with _total)."""
    names = {f"{n}_total" for n, _, _ in _RANK_COUNTERS}
    names |= {n for n, _, _ in _RANK_GAUGES + _JOB_GAUGES}
    names |= {"odb_samples_in_total", "odb_quarantined_total", "odb_job_failed",
              "odb_source_backlog_samples", "odb_service_start_time_seconds"}
    return names
