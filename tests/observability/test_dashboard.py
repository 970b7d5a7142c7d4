"""The Grafana dashboard is valid JSON and only queries metrics the service exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from obs_helpers import served
from prometheus_client.parser import text_string_to_metric_families
from test_metrics_endpoint import scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/odb-pipeline-dashboard.json"
_METRIC = re.compile(r"\b(odb_[a-z0-9_]+)\b")


def _queries(dash: dict) -> list[str]:
    out = []
    panels = list(dash["panels"])
    while panels:
        p = panels.pop()
        panels.extend(p.get("panels", []))
        out += [t["expr"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        out.append(q["query"] if isinstance(q, dict) else str(q or ""))
    return out


def test_dashboard_queries_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    queries = _queries(dash)
    referenced = {m for q in queries for m in _METRIC.findall(q)}
    assert len(referenced) >= 15, referenced
    # Refill jobs too: waiting, in flight, completed, re-admitted, consumers, admissions per
    # second and lease lapses; the job variable lists every job, refill jobs included.
    assert {"odb_refill_waiting", "odb_refill_in_flight", "odb_refill_completed_total",
            "odb_refill_readmitted_total", "odb_refill_consumers", "odb_refill_admitted_total",
            "odb_refill_lease_lapses_total", "odb_job_info"} <= referenced, referenced
    with served() as (_svc, port):
        text = scrape(port)
    exported = {f.name for f in text_string_to_metric_families(text)}
    exported |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    # A counter family with no series yet (nothing quarantined) is listed without `_total`.
    missing = {m for m in referenced if m not in exported
               and m.removesuffix("_total") not in exported}
    assert not missing, missing
    # `job` is Prometheus' own scrape label; ours is job_id.
    assert not [q for q in queries if re.search(r"\bjob\s*[=!]~?", q)]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "odb-pipeline"
