"""One JSON-able picture of the jobs a running service serves: the single source for `/metrics`,
`/status.json`, the HTML page and `odb-pipeline status`, so every view shows the same numbers.

Everything is read from the live `JobRuntime`s at call time (no double bookkeeping); emission
totals come from the published plan (`plan_totals.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.observability.plan_totals import STALL_AFTER_S, PlanTotals
from pipeline.observability.quarantine import PLANNER_REASONS, by_reason, parse_record

if TYPE_CHECKING:
    from pipeline.service.job_runtime import JobRuntime

TOTAL_KEYS = ("batches_emitted", "samples_emitted", "tokens_emitted", "padded_tokens",
              "batch_cost")
MAX_RECORDS = 1000  # quarantine records listed per job (the count is always exact)


def job_state(*, error: str | None, done: bool, published_through: int, epochs: int,
              final_steps: Sequence[int] | None, acked: Sequence[int]) -> str:
    """failed | finished (every rank acked its last step) | draining (planning over, ranks still
    consuming) | running | waiting (nothing published yet)."""
    if error:
        return "failed"
    if done:
        if final_steps is not None and all(a >= f for a, f in zip(acked, final_steps,
                                                                  strict=False)):
            return "finished"
        return "draining"
    return "running" if published_through >= 0 else "waiting"


def derived(totals: Mapping[str, int], token_budget: int | None) -> dict[str, float | None]:
    """Padding efficiency = real tokens / (real + pad) tokens; budget utilisation = mean batch
    cost / token budget."""
    tokens, pad = totals.get("tokens_emitted", 0), totals.get("padded_tokens", 0)
    batches, cost = totals.get("batches_emitted", 0), totals.get("batch_cost", 0)
    return {
        "padding_efficiency": tokens / (tokens + pad) if tokens + pad else None,
        "budget_utilisation": cost / (batches * token_budget) if batches and token_budget
        else None,
    }


def rates(now: Mapping[str, int], before: Mapping[str, int] | None, window_s: float,
          basis: str) -> dict[str, Any]:
    base = before or {}
    w = max(window_s, 1e-9)
    return {
        "basis": basis, "window_s": round(window_s, 3),
        "samples_per_s": (now.get("samples_emitted", 0) - base.get("samples_emitted", 0)) / w,
        "tokens_per_s": (now.get("tokens_emitted", 0) - base.get("tokens_emitted", 0)) / w,
        "batches_per_s": (now.get("batches_emitted", 0) - base.get("batches_emitted", 0)) / w,
    }


def _last_finals(rt: JobRuntime) -> list[int] | None:
    ends = sorted(rt.state.epoch_ends(), key=lambda e: e.epoch)
    if len(ends) < rt.job.epochs:
        return None
    return [-1 if s is None else s for s in ends[-1].final_step]


class ServiceView:
    """Snapshots of `runtimes` (RunningService.runtimes); one PlanTotals per job."""

    def __init__(self, runtimes: Mapping[str, JobRuntime]) -> None:
        self.runtimes = runtimes
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._totals: dict[str, PlanTotals] = {}
        for job_id in list(runtimes):
            self._tracker(job_id)

    def _tracker(self, job_id: str) -> PlanTotals:
        with self._lock:
            rt = self.runtimes[job_id]
            pt = self._totals.get(job_id)
            if pt is None or pt.rt is not rt:
                pt = self._totals[job_id] = PlanTotals(rt)
            return pt

    def job_ids(self) -> list[str]:
        return sorted(self.runtimes)

    def snapshot(self, *, job: str | None = None, quarantine: bool = False) -> dict[str, Any]:
        ids = [job] if job is not None else self.job_ids()
        return {"generated_at": time.time(), "service_started_at": self.started_at,
                "jobs": [self.job(j, quarantine=quarantine) for j in ids if j in self.runtimes]}

    def job(self, job_id: str, *, quarantine: bool = False) -> dict[str, Any]:
        rt = self.runtimes[job_id]
        pt = self._tracker(job_id)
        st = rt.state
        # One read of every cursor (RedisJobState has a batch call; W calls otherwise).
        acked = (st.acked_all() if hasattr(st, "acked_all")
                 else [st.acked(r) for r in range(rt.world_size)])
        pt.update(acked)
        now = time.time()
        lapsed = set(st.lapsed_ranks())
        health = {h.rank: h for h in st.rank_health()} if hasattr(st, "rank_health") else {}
        ranks = []
        for r, info in enumerate(rt.ranks):
            tot = pt.ranks[r]
            lag = pt.lag(r)
            quiet = pt.seconds_since_progress(r, now)
            h = health.get(r)
            ranks.append({
                "rank": r, "client_id": info.client_id, "connected": info.connected,
                "delivered_step": info.delivered, "acked_step": acked[r], "lag_steps": lag,
                "seconds_since_progress": round(quiet, 3),
                "stalled": lag > 0 and quiet >= STALL_AFTER_S,
                "lapsed": r in lapsed,
                "heartbeat_age_s": h.heartbeat_age if h is not None else None,
                "batches_emitted": tot.batches, "samples_emitted": tot.samples,
                "tokens_emitted": tot.tokens, "padded_tokens": tot.padded_tokens,
                "batch_cost": tot.cost,
            })
        totals = {k: sum(r[k] for r in ranks) for k in TOTAL_KEYS}
        records = list(rt.quarantined)  # a copy: the producer appends concurrently
        reasons = by_reason(records)
        planner_q = sum(n for reason, n in reasons.items() if reason in PLANNER_REASONS)
        done = st.is_done()
        # Fed to the planner but not yet in a published step (window + balancing pool).
        buffer = 0 if done else max(0, rt.samples_in - pt.published_samples - planner_q)
        backlog = getattr(rt.source, "backlog", None)  # optional SourceSample hook (Ray queue)
        uptime = now - pt.started_at
        budget = rt.job.batching.token_budget
        out: dict[str, Any] = {
            "job_id": job_id, "mode": rt.mode, "world_size": rt.world_size,
            "epochs": rt.job.epochs, "collate": rt.collate, "token_budget": budget,
            "state": job_state(error=rt.error, done=done,
                               published_through=st.published_through(),
                               epochs=rt.job.epochs, final_steps=_last_finals(rt),
                               acked=[r["acked_step"] for r in ranks]),
            "published_through": st.published_through(), "done": done, "error": rt.error,
            "samples_in": rt.samples_in, "uptime_s": round(uptime, 3),
            "ranks": ranks, "lapsed_ranks": sorted(lapsed), "totals": totals,
            **derived(totals, budget),
            "throughput": rates(totals, None, uptime, "uptime"),
            "quarantine": {"total": len(records), "by_reason": reasons},
            "planner_buffer_samples": buffer,
            "payload_cache_samples": rt.cache_size(),
            "source_backlog_samples": backlog() if callable(backlog) else None,
            "epoch_ends": [{"epoch": e.epoch, "steps": e.steps,
                            "final_step": [-1 if s is None else s for s in e.final_step],
                            "carried_over": len(e.carried_over)}
                           for e in sorted(st.epoch_ends(), key=lambda e: e.epoch)],
        }
        if quarantine:
            out["quarantine"]["records"] = [parse_record(t).as_dict()
                                            for t in records[:MAX_RECORDS]]
        return out
