"""A read-only HTML status page: server-rendered from a ServiceView snapshot, no JavaScript.

A `<meta http-equiv="refresh">` reloads it, so it works in any browser (and in headless tests
via --dump-dom); every cell has a class so tests and scrapers can find values without layout.
"""

from __future__ import annotations

from html import escape
from typing import Any

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.5em}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ccc;padding:.25em .6em}
th{background:#f3f3f3;text-align:left} td.num{text-align:right;font-variant-numeric:tabular-nums}
.failed{color:#b00020;font-weight:bold} tr.is-stalled,tr.is-lapsed{background:#fde2e2}
.muted{color:#777}
"""


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _cell(cls: str, value: Any, num: bool = True) -> str:
    return f'<td class="{cls}{" num" if num else ""}">{escape(str(value))}</td>'


def _job(job: dict[str, Any]) -> str:
    jid = escape(job["job_id"])
    t = job["throughput"]
    q = job["quarantine"]
    head = (
        f'<h2>job <span class="job-id">{jid}</span> — '
        f'<span class="state {escape(job["state"])}">{escape(job["state"])}</span></h2>'
        f'<p>mode {escape(job["mode"])}, world size {job["world_size"]}, '
        f'published through step <b class="published">{job["published_through"]}</b>, '
        f'{job["samples_in"]} samples in, '
        f'padding efficiency {_pct(job["padding_efficiency"])}, '
        f'budget utilisation {_pct(job["budget_utilisation"])}, '
        f'{t["samples_per_s"]:.1f} samples/s, {t["tokens_per_s"]:.0f} tokens/s '
        f'<span class="muted">(since start)</span>; '
        f'{job["planned"]["samples"]} samples planned; '
        f'quarantined {q["total"]} '
        + escape(", ".join(f"{k}={v}" for k, v in q["by_reason"].items())) + "</p>"
    )
    if job["error"]:
        head += f'<p class="failed">producer failed: {escape(job["error"])}</p>'
    rows = []
    for r in job["ranks"]:
        cls = " ".join(c for c in ("is-stalled" if r["stalled"] else "",
                                   "is-lapsed" if r["lapsed"] else "") if c)
        rows.append(
            f'<tr data-rank="{r["rank"]}" class="{cls}">' + "".join([
                _cell("rank", r["rank"]),
                _cell("delivered", r["replica"]["delivered_step"]),
                _cell("acked", r["acked_step"]), _cell("lag", r["lag_steps"]),
                _cell("connected", "yes" if r["replica"]["connected"] else "no", num=False),
                _cell("stalled", "yes" if r["stalled"] else "no", num=False),
                _cell("batches", r["batches_emitted"]), _cell("samples", r["samples_emitted"]),
                _cell("tokens", r["tokens_emitted"]),
                _cell("client", r["client_id"] or "—", num=False),
            ]) + "</tr>")
    table = (
        f'<table class="ranks" data-job="{jid}"><tr><th>rank</th>'
        "<th>delivered step (this replica)</th><th>acked step</th><th>lag (steps)</th>"
        "<th>connected here</th><th>stalled</th>"
        "<th>batches</th><th>samples</th><th>tokens</th><th>client</th></tr>"
        + "".join(rows) + "</table>"
    )
    return f'<section class="job" data-job="{jid}">{head}{table}</section>'


def render(snapshot: dict[str, Any], refresh_s: int = 2) -> str:
    jobs = "".join(_job(j) for j in snapshot["jobs"]) or "<p>no jobs</p>"
    return (
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="refresh" content="{int(refresh_s)}">'
        f"<title>odb-pipeline status</title><style>{_CSS}</style></head><body>"
        "<h1>odb-pipeline status</h1>"
        f'<p class="muted">refreshes every {int(refresh_s)} s · '
        '<a href="/metrics">/metrics</a> · <a href="/status.json">/status.json</a></p>'
        f"{jobs}</body></html>"
    )
