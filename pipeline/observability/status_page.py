"""A read-only HTML status page: server-rendered from the replica's `ServiceStatus`, no
JavaScript.

A `<meta http-equiv="refresh">` reloads it, so it works in any browser (and in headless tests
via --dump-dom); every cell has a class so tests and scrapers can find values without layout.
A training job shows its ranks; a refill job its requests (waiting, in flight, completed, ...).
"""

from __future__ import annotations

from html import escape
from typing import Any

from pipeline.observability.job_status import JobStatus, RefillStatus, ServiceStatus

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.5em}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ccc;padding:.25em .6em}
th{background:#f3f3f3;text-align:left} td.num{text-align:right;font-variant-numeric:tabular-nums}
.failed{color:#b00020;font-weight:bold} tr.is-stalled,tr.is-lapsed{background:#fde2e2}
.muted{color:#777} .open{color:#b06000}
"""


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _cell(cls: str, value: Any, num: bool = True) -> str:
    return f'<td class="{cls}{" num" if num else ""}">{escape(str(value))}</td>'


def _quarantine(job: JobStatus) -> str:
    q = job.quarantine
    if q is None:
        return ""
    return f"quarantined {q.total} " + escape(", ".join(
        f"{k}={v}" for k, v in (q.by_reason or {}).items()))


def _training(job: JobStatus) -> str:
    t = job.throughput
    rate = ("" if t is None else f'{t.samples_per_s:.1f} samples/s, {t.tokens_per_s:.0f} '
            'tokens/s <span class="muted">(since start)</span>; ')
    head = (
        f'<p>mode {escape(job.mode)}, world size {job.world_size}, '
        f'published through step <b class="published">{job.published_through}</b>, '
        f'{job.samples_in} samples in, '
        f'padding efficiency {_pct(job.padding_efficiency)}, '
        f'budget utilisation {_pct(job.budget_utilisation)}, {rate}'
        f'{job.planned.samples if job.planned else 0} samples planned; {_quarantine(job)}</p>'
    )
    rows = []
    for r in job.ranks or ():
        cls = " ".join(c for c in ("is-stalled" if r.stalled else "",
                                   "is-lapsed" if r.lapsed else "") if c)
        rep = r.replica
        rows.append(
            f'<tr data-rank="{r.rank}" class="{cls}">' + "".join([
                _cell("rank", r.rank),
                _cell("delivered", rep.delivered_step if rep else "—"),
                _cell("acked", r.acked_step), _cell("lag", r.lag_steps),
                _cell("connected", "yes" if rep and rep.connected else "no", num=False),
                _cell("stalled", "yes" if r.stalled else "no", num=False),
                _cell("batches", r.batches_emitted), _cell("samples", r.samples_emitted),
                _cell("tokens", r.tokens_emitted),
                _cell("client", r.client_id or "—", num=False),
            ]) + "</tr>")
        for m in r.members or ():  # a model-parallel group: every member, its lag
            mrep = m.replica
            rows.append(
                f'<tr data-rank="{r.rank}" data-member="{m.member}" class="member'
                f'{" is-lapsed" if m.lapsed_for_s else ""}">' + "".join([
                    _cell("rank", f"{r.rank}.{m.member}", num=False),
                    _cell("delivered", mrep.delivered_step if mrep else "—"),
                    _cell("acked", m.acked_step), _cell("lag", m.lag_steps),
                    _cell("connected", "yes" if mrep and mrep.connected else "no", num=False),
                    _cell("stalled", "—", num=False), _cell("batches", "—", num=False),
                    _cell("samples", "—", num=False), _cell("tokens", "—", num=False),
                    _cell("client", m.client_id or ("released" if m.released else "—"),
                          num=False),
                ]) + "</tr>")
    table = (
        f'<table class="ranks" data-job="{escape(job.job_id)}"><tr><th>rank</th>'
        "<th>delivered step (this replica)</th><th>acked step</th><th>lag (steps)</th>"
        "<th>connected here</th><th>stalled</th>"
        "<th>batches</th><th>samples</th><th>tokens</th><th>client</th></tr>"
        + "".join(rows) + "</table>"
    )
    return head + table + _sources(job)


def _sources(job: JobStatus) -> str:
    """A mixture job's sources: each one's share of the epoch's plan against its target."""
    m = job.sources
    if m is None:
        return ""
    rows = "".join(
        f'<tr data-source="{escape(x.name)}">' + _cell("source", x.name, num=False)
        + _cell("samples", x.samples) + _cell("loss-tokens", x.loss_tokens)
        + _cell("share", f"{x.share:.3f}") + _cell("target", f"{x.target:.3f}")
        + _cell("quarantined", x.quarantined) + "</tr>" for x in m.sources)
    changes = "".join(
        f'<p class="mix-change">{escape(c.by)} from step {c.step}: '
        + escape(", ".join(f"{n}={w:g}" for n, w in c.weights.items())) + "</p>"
        for c in m.changes)
    return (f'<table class="sources" data-job="{escape(job.job_id)}"><tr><th>source (epoch '
            f'{m.epoch})</th><th>samples</th><th>loss tokens</th><th>share of '
            f'{escape(m.mix_by.replace("_", " "))}</th><th>target</th><th>quarantined</th></tr>'
            + rows + "</table>" + changes)


_REFILL_CELLS = (("waiting", "waiting"), ("in_flight", "in flight"), ("completed", "completed"),
                 ("readmitted", "re-admitted"), ("admitted", "admitted"),
                 ("consumers", "consumers"), ("lease_lapses", "lease lapses"),
                 ("enqueued", "enqueued"))


def _refill(job: JobStatus, rf: RefillStatus) -> str:
    rate = ("" if rf.rates is None else f"{rf.rates.admissions_per_s:.2f} admissions/s, "
            f'{rf.rates.completions_per_s:.2f} completions/s <span class="muted">(since '
            "start)</span>; ")
    epochs = f"epoch {rf.epoch + 1} of {rf.epochs}, " if rf.epochs and rf.epochs > 1 else ""
    head = (f"<p>mode refill, {epochs}source {'read' if rf.exhausted else 'being read'}, "
            f"{rate}{_quarantine(job)}</p>")
    cells = "".join(_cell(key.replace("_", "-"), getattr(rf, key)) for key, _ in _REFILL_CELLS)
    table = (f'<table class="refill" data-job="{escape(job.job_id)}"><tr>'
             + "".join(f"<th>{label}</th>" for _, label in _REFILL_CELLS)
             + f"</tr><tr>{cells}</tr></table>")
    if len(rf.by_epoch) > 1:
        table += ('<table class="refill-epochs"><tr><th>epoch</th><th>enqueued</th>'
                  "<th>completed</th><th>quarantined</th></tr>" + "".join(
                      f'<tr data-epoch="{e.epoch}">' + _cell("epoch", e.epoch)
                      + _cell("enqueued", e.enqueued) + _cell("completed", e.completed)
                      + _cell("quarantined", e.quarantined) + "</tr>" for e in rf.by_epoch)
                  + "</table>")
    return head + table


def _job(job: JobStatus) -> str:
    jid = escape(job.job_id)
    state = escape(job.state)
    head = (f'<h2>job <span class="job-id">{jid}</span> — '
            f'<span class="state {state}">{state}</span>'
            + (' <span class="open">(open: no credential)</span>' if job.open else "")
            + "</h2>")
    if job.error:
        head += f'<p class="failed">producer failed: {escape(job.error)}</p>'
    if job.producer_trouble:
        t = job.producer_trouble
        head += (f'<p class="trouble">producer retrying ({escape(t.cause)}, {t.attempts} '
                 f"failure(s) so far): {escape(t.message)}</p>")
    body = _refill(job, job.refill) if job.refill is not None else _training(job)
    return f'<section class="job" data-job="{jid}">{head}{body}</section>'


def render(status: ServiceStatus, refresh_s: int = 2) -> str:
    jobs = "".join(_job(j) for j in status.jobs) or "<p>no jobs</p>"
    return (
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="refresh" content="{int(refresh_s)}">'
        f"<title>odb-pipeline status</title><style>{_CSS}</style></head><body>"
        "<h1>odb-pipeline status</h1>"
        f'<p class="muted">refreshes every {int(refresh_s)} s · '
        '<a href="/metrics">/metrics</a> · <a href="/status.json">/status.json</a></p>'
        f"{jobs}</body></html>"
    )
