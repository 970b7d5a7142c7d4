"""The human-readable rendering of a `StatusReport` (the default output of `status`): a training
job with its ranks, a refill job with its requests."""

from __future__ import annotations

from typing import Any

from pipeline.observability.job_status import (
    ComputeStatus,
    JobStatus,
    MixtureStatus,
    RefillStatus,
    WorldStatus,
)
from pipeline.status.report import StatusReport


def _v(x: Any, fmt: str = "{}") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return fmt.format(x)


def _step(x: int | None) -> str:
    """A step number; "-" for none yet (None, or the -1 the sources use for it)."""
    return "-" if x is None or x < 0 else str(x)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _world(w: WorldStatus) -> str:
    """`4 [0-37]` for an ended world; `2 [38-] (scale: plan 0.04s, first batch 0.31s)`."""
    span = f"[{w.first_step}-{'' if w.last_step is None else w.last_step}]"
    out = f"{w.world_size} {span}"
    if w.generation > 0:
        timing = [f"{label} {t:.2f}s" for label, t in (
            ("plan", w.adopted_s), ("drained", w.drained_s), ("first batch", w.first_batch_s))
            if t is not None]
        out += f" ({w.reason}" + (": " + ", ".join(timing) if timing else "") + ")"
    return out


def _refill(rf: RefillStatus) -> list[str]:
    epochs = (f"  epoch={rf.epoch + 1}/{rf.epochs}" if rf.epochs and rf.epochs > 1 else "")
    lines = [f"  refill: in_flight={rf.in_flight}  completed={rf.completed}  "
             f"readmitted={rf.readmitted}  waiting={rf.waiting}  "
             f"enqueued={rf.enqueued}{'' if rf.exhausted else '+'}  "
             f"consumers={rf.consumers}  lease_lapses={rf.lease_lapses}{epochs}"]
    if rf.rates is not None:
        r = rf.rates
        lines.append(f"  rates ({r.basis}, {r.window_s:.1f} s): {r.admissions_per_s:.2f} "
                     f"admissions/s  {r.completions_per_s:.2f} completions/s")
    if len(rf.by_epoch) > 1:
        lines.append("  by epoch: " + "  ".join(
            f"{e.epoch}: {e.completed}/{e.enqueued}" for e in rf.by_epoch))
    return lines


def _ranks(job: JobStatus) -> list[str]:
    lines = []
    worlds = job.worlds or ()
    if len(worlds) > 1:
        lines.append("  world sizes: " + " -> ".join(_world(w) for w in worlds)
                     + ("  (reconfiguring)" if job.reconfiguring else ""))
    t = job.throughput
    if t:
        extra = f"  {t.steps_per_s:.2f} steps/s" if t.steps_per_s is not None else ""
        lines.append(f"  throughput ({t.basis}, {t.window_s:.1f} s): "
                     f"{t.samples_per_s:.1f} samples/s  {t.tokens_per_s:.0f} tokens/s  "
                     f"{t.batches_per_s:.2f} batches/s{extra}")
    if job.totals:
        budget = (f"token budget {_v(job.token_budget)}" if job.global_token_budget is None
                  else f"token budget {_v(job.token_budget)} per micro-batch, global token "
                  f"budget {job.global_token_budget} per step; "
                  f"{_v(job.totals.batches_emitted)} micro-batches consumed")
        lines.append(f"  padding efficiency {_pct(job.padding_efficiency)}  "
                     f"budget utilisation {_pct(job.budget_utilisation)}  ({budget})")
    prod = job.producer
    if prod:
        lines.append(f"  producer generation {prod.generation} "
                     f"({'live' if prod.live else 'no live lease'}) held by {prod.holder}")
    trouble = job.producer_trouble
    if trouble:
        lines.append(f"  producer retrying ({trouble.cause}, {trouble.attempts} failure(s) so "
                     f"far): {trouble.message}")
    header = ("rank", "delivered*", "acked", "lag", "connected*", "heartbeat", "stalled",
              "lapsed", "client")
    rows = [header]
    for r in job.ranks or ():
        rows.append((
            str(r.rank), _step(r.replica.delivered_step if r.replica else None),
            _step(r.acked_step), _v(r.lag_steps), _v(r.replica.connected if r.replica else None),
            _v(r.heartbeat_age_s, "{:.1f}s"), _v(r.stalled), _v(r.lapsed), r.client_id or "-",
        ))
        rows += [(  # a rank served to a model-parallel group: every member under it
            f"{r.rank}.{m.member}", _step(m.replica.delivered_step if m.replica else None),
            _step(m.acked_step), _v(m.lag_steps), _v(m.replica.connected if m.replica else None),
            _v(m.heartbeat_age_s, "{:.1f}s"), "", _v(bool(m.lapsed_for_s)),
            m.client_id or ("(released)" if m.released else "-"),
        ) for m in r.members or ()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    lines.append(f"  * as seen by replica {job.replica.id if job.replica else '-'}"
                 + ("; r.m: member m of rank r's group, its lag behind the group's most "
                    "advanced member" if any(r.members for r in job.ranks or ()) else ""))
    return lines


def _job(job: JobStatus, show_records: bool) -> list[str]:
    where = ("" if job.refill is not None else
             f"  world_size={_v(job.world_size)}  published_through="
             f"{_step(job.published_through)}")
    lines = [f"job {job.job_id}  state={job.state}  mode={job.mode}{where}  "
             f"samples_in={_v(job.samples_in)}"
             + ("  OPEN (served without a credential)" if job.open else "")]
    if job.error:
        lines.append(f"  ERROR: {job.error}")
    if job.batch_size_notice:
        lines.append(f"  batch size: {job.batch_size_notice}")
    lines += _refill(job.refill) if job.refill is not None else _ranks(job)
    q = job.quarantine
    if q is not None:
        reasons = q.by_reason
        lines.append(f"  quarantined {q.total}"
                     + (": " + ", ".join(f"{k}={n}" for k, n in reasons.items())
                        if reasons else ""))
        if show_records:
            if q.records is None:
                lines.append("    (records are listed by the service's metrics endpoint and "
                             "Redis: give --metrics-endpoint or --redis-url)")
            for rec in q.records or ():
                detail = "" if rec.detail in ("", rec.reason) else f"  {rec.detail}"
                lines.append(f"    {rec.sample_id}  {rec.reason}{detail}")
    ex = job.exposure
    if ex:
        lines.append(f"  exposure (sdo ledger) after {ex['epochs']} planned epoch(s): min "
                     f"{ex['min']}  p50 {ex['p50']}  max {ex['max']} visits per sample; "
                     f"longest unseen run {ex['max_epochs_unseen']} epoch(s)")
    if job.compute is not None:
        lines += _compute(job.compute)
    if job.sources is not None:
        lines += _mixture(job.sources)
    if job.coordinator is not None:
        c = job.coordinator
        lines.append(f"  redis: state={c.state}  retained_steps={c.retained_steps}  "
                     f"min_acked={_step(c.min_acked)}")
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


def render(report: StatusReport, show_records: bool = False) -> str:
    body = ("\n\n".join("\n".join(_job(j, show_records)) for j in report.jobs)
            if report.jobs else "no jobs")
    return "\n".join([*_sources(report.sources), body])


def _compute(c: ComputeStatus) -> list[str]:
    """Compute balancing: what balances the ranks, the fit, the measured imbalance."""
    fit = (f"last fit error {c.last_error:.1%}" if c.last_error is not None else "no fit yet")
    if c.gate_open:
        head = (f"  compute balancing: by fitted time (error {c.error:.1%} over {c.reports} "
                f"reports)")
    else:
        head = f"  compute balancing: by tokens until the fit passes its gate ({fit})"
    lines = [head + f"; reports accepted {c.accepted}, rejected {c.rejected}, warm-up "
             f"{c.warmup}, stale {c.stale}; refits after drift {c.drifts}"
             + (f"; fits failed {c.fit_failures}" if c.fit_failures else "")]
    if c.coefficients:
        lines.append("    seconds per unit: " + "  ".join(
            f"{k}={v:.3g}" for k, v in c.coefficients.items() if v))
    if c.imbalance_steps:
        lines.append(f"    measured imbalance (max/mean rank compute) over {c.imbalance_steps} "
                     f"steps: p50 {c.imbalance_p50:.3f}  p90 {c.imbalance_p90:.3f}  last "
                     f"{c.imbalance_last:.3f}")
    if c.rank_measured_s:
        pred = c.rank_predicted_s or {}
        lines.append(f"    step {c.last_step} per rank, measured (predicted) s: " + "  ".join(
            f"{r}: {m:.3g}" + (f" ({pred[r]:.3g})" if r in pred else "")
            for r, m in sorted(c.rank_measured_s.items())))
    return lines


def _mixture(m: MixtureStatus) -> list[str]:
    """Each source's part of the epoch's plan: share against target (in mix_by)."""
    lines = [f"  sources (epoch {m.epoch}, shares of {m.mix_by.replace('_', ' ')}):"]
    for x in m.sources:
        lines.append(f"    {x.name:<16} samples={x.samples}  loss_tokens={x.loss_tokens}  "
                     f"share={x.share:.3f}  target={x.target:.3f}  "
                     f"quarantined={x.quarantined}")
    for c in m.changes:
        weights = ", ".join(f"{n}={w:g}" for n, w in c.weights.items())
        lines.append(f"    {c.by} from step {c.step}: {weights}")
    return lines
