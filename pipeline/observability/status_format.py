"""The human-readable rendering of a `status_query.collect()` object (the default output)."""

from __future__ import annotations

from typing import Any


def _v(x: Any, fmt: str = "{}") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return fmt.format(x)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _world(w: dict[str, Any]) -> str:
    """`4 [0-37]` for an ended world; `2 [38-] (scale: plan 0.04s, first batch 0.31s)`."""
    span = f"[{w['first_step']}-{'' if w['last_step'] is None else w['last_step']}]"
    out = f"{w['world_size']} {span}"
    if w["generation"] > 0:
        timing = [f"{label} {w[key]:.2f}s" for label, key in (
            ("plan", "adopted_s"), ("drained", "drained_s"), ("first batch", "first_batch_s"))
            if w.get(key) is not None]
        out += f" ({w['reason']}" + (": " + ", ".join(timing) if timing else "") + ")"
    return out


def _job(job: dict[str, Any], show_records: bool) -> list[str]:
    lines = [
        f"job {job['job_id']}  state={job.get('state')}  mode={job.get('mode', '-')}  "
        f"world_size={job.get('world_size', '-')}  published_through="
        f"{job.get('published_through', '-')}  samples_in={_v(job.get('samples_in'))}"
    ]
    if job.get("error"):
        lines.append(f"  ERROR: {job['error']}")
    rf = job.get("refill")
    if rf:  # a refill job has consumers, not ranks
        lines.append(f"  refill: in_flight={rf['in_flight']}  completed={rf['completed']}  "
                     f"readmitted={rf['readmitted']}  waiting={rf['waiting']}  "
                     f"enqueued={rf['enqueued']}{'' if rf['exhausted'] else '+'}  "
                     f"consumers={rf['consumers']}")
    worlds = job.get("worlds") or []
    if len(worlds) > 1:
        lines.append("  world sizes: " + " -> ".join(_world(w) for w in worlds)
                     + ("  (reconfiguring)" if job.get("reconfiguring") else ""))
    t = job.get("throughput")
    if t:
        extra = f"  {t['steps_per_s']:.2f} steps/s" if "steps_per_s" in t else ""
        lines.append(f"  throughput ({t['basis']}, {t['window_s']:.1f} s): "
                     f"{t['samples_per_s']:.1f} samples/s  {t['tokens_per_s']:.0f} tokens/s  "
                     f"{t['batches_per_s']:.2f} batches/s{extra}")
    if job.get("totals"):
        lines.append(f"  padding efficiency {_pct(job.get('padding_efficiency'))}  "
                     f"budget utilisation {_pct(job.get('budget_utilisation'))}  "
                     f"(token budget {_v(job.get('token_budget'))})")
    prod = job.get("producer")
    if prod:
        lines.append(f"  producer generation {prod['generation']} "
                     f"({'live' if prod['live'] else 'no live lease'}) held by {prod['holder']}")
    header = ("rank", "delivered*", "acked", "lag", "connected*", "heartbeat", "stalled",
              "lapsed", "client")
    rows = [header] + [(
        str(r["rank"]), _v((r.get("replica") or {}).get("delivered_step")),
        _v(r.get("acked_step")), _v(r.get("lag_steps")),
        _v((r.get("replica") or {}).get("connected")),
        _v(r.get("heartbeat_age_s"), "{:.1f}s"), _v(r.get("stalled")), _v(r.get("lapsed")),
        r.get("client_id") or "-",
    ) for r in job.get("ranks", [])]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    replica = (job.get("replica") or {}).get("id")
    lines.append(f"  * as seen by replica {replica or '-'}")
    q = job.get("quarantine") or {}
    reasons = q.get("by_reason")
    lines.append(f"  quarantined {q.get('total', 0)}"
                 + (": " + ", ".join(f"{k}={n}" for k, n in reasons.items()) if reasons else ""))
    if show_records:
        records = q.get("records")
        if records is None:
            lines.append("    (records are listed by the service's metrics endpoint: "
                         "give --metrics-endpoint)")
        for rec in records or []:
            detail = "" if rec["detail"] == rec["reason"] else f"  {rec['detail']}"
            lines.append(f"    {rec['sample_id']}  {rec['reason']}{detail}")
    ex = job.get("exposure")
    if ex:
        lines.append(f"  exposure (sdo ledger) after {ex['epochs']} planned epoch(s): min "
                     f"{ex['min']}  p50 {ex['p50']}  max {ex['max']} visits per sample; "
                     f"longest unseen run {ex['max_epochs_unseen']} epoch(s)")
    if "redis" in job:
        rd = job["redis"]
        lines.append(f"  redis: state={rd['state']}  retained_steps={rd['retained_steps']}  "
                     f"min_acked={rd['min_acked']}")
    return lines


def _sources(src: dict[str, Any]) -> list[str]:
    """Where the answers came from, when `status` found the service itself."""
    if not src.get("local_service"):
        return []
    lines = [f"service: {src['local_service']}  grpc={_v(src.get('endpoint'))}"
             f"{' (tls)' if src.get('tls') else ''}  metrics={_v(src.get('metrics'))}"]
    lines += [f"  GetJob not asked for job {job}: {why}"
              for job, why in (src.get("grpc_skipped") or {}).items()]
    return [*lines, ""]


def render(status: dict[str, Any], show_records: bool = False) -> str:
    body = ("\n\n".join("\n".join(_job(j, show_records)) for j in status["jobs"])
            if status["jobs"] else "no jobs")
    return "\n".join([*_sources(status.get("sources") or {}), body])
