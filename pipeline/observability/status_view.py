"""One JSON-able picture of the jobs a replica serves: the single source for `/metrics`,
`/status.json`, the HTML page and `odb-pipeline status`, so every view shows the same numbers.

Job-wide facts are read from each job's state (the same on every replica: plan, cursors,
counters, quarantine, producer lease, errors); consumption totals are derived from the plan up
to each rank's acknowledged step (`plan_totals.py`), so they are exact with N replicas. What only
this replica knows (which ranks are connected *here*, what it delivered, which payloads it
fetched) comes from the runtimes' published `facts()` and sits under `replica` keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.observability.plan_totals import STALL_AFTER_S, PlanTotals

if TYPE_CHECKING:
    from pipeline.jobstate.interface import JobState
    from pipeline.service.job_runtime import JobRuntime

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


def world_history(state: JobState) -> list[dict[str, Any]]:
    """The job's worlds by generation, with the timings of each switch (docs/elastic.md):
    request -> plan adopted -> every old rank left (drained) / first batch at every new rank."""
    out = []
    for w in state.worlds():
        t = state.world_timings(w.generation)

        def since(at: float | None, t=t) -> float | None:
            return None if at is None or t is None else round(at - t.requested_at, 4)

        first = {} if t is None else t.first_batch_at
        left = {} if t is None else t.left_at
        out.append({
            "generation": w.generation, "world_size": w.world_size, "first_step": w.first_step,
            "last_step": w.last_step, "rank_last_steps": list(w.last_steps or []),
            "reason": w.reason.value, "requested_at": w.requested_at,
            "returned_samples": w.returned_samples,
            "adopted_s": since(t.adopted_at) if t else None,
            "drained_s": since(max(left.values())) if left else None,
            "first_batch_s": (None if t is None or t.first_batch_seconds(w.world_size) is None
                              else round(t.first_batch_seconds(w.world_size), 4)),
            "first_batch_s_by_rank": {r: since(at) for r, at in sorted(first.items())},
        })
    return out


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


class ServiceView:
    """Snapshots of a replica's jobs (`RunningService.runtimes`); one PlanTotals per job."""

    def __init__(self, runtimes: Mapping[str, JobRuntime], replica_id: str = "") -> None:
        self.runtimes = runtimes
        self.replica_id = replica_id
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._totals: dict[str, PlanTotals] = {}
        for rt in runtimes.values():  # count from the cursors as they are now
            self._tracker(rt)

    def _tracker(self, rt: JobRuntime) -> PlanTotals:
        with self._lock:
            pt = self._totals.get(rt.job.job_id)
            if pt is None or pt.state is not rt.state:
                pt = self._totals[rt.job.job_id] = PlanTotals(rt.state, rt.collate)
            return pt

    def job_ids(self) -> list[str]:
        return sorted(self.runtimes)

    def snapshot(self, *, job: str | None = None, quarantine: bool = False) -> dict[str, Any]:
        ids = [job] if job is not None else self.job_ids()
        return {"generated_at": time.time(), "service_started_at": self.started_at,
                "replica_id": self.replica_id,
                "jobs": [self.job(j, quarantine=quarantine) for j in ids if j in self.runtimes]}

    def job(self, job_id: str, *, quarantine: bool = False) -> dict[str, Any]:
        rt = self.runtimes[job_id]
        st = rt.state
        pt = self._tracker(rt)
        health = st.rank_health()  # every cursor, lease and heartbeat at one instant
        acked = [h.acked for h in health]
        pt.update(acked)
        now = time.time()
        lapsed = set(st.lapsed_ranks())
        facts = rt.facts()
        ranks = []
        for h in health:
            r = h.rank
            tot = pt.ranks[r]
            lag = pt.lag(r)
            quiet = pt.seconds_since_progress(r, now)
            conn = facts.ranks.get(r)
            ranks.append({
                "rank": r, "acked_step": h.acked, "lag_steps": lag,
                "seconds_since_progress": round(quiet, 3),
                "stalled": lag > 0 and quiet >= STALL_AFTER_S,
                "lapsed": r in lapsed, "client_id": h.client_id or "",
                "heartbeat_age_s": h.heartbeat_age,
                "batches_emitted": tot.batches, "samples_emitted": tot.samples,
                "tokens_emitted": tot.tokens, "padded_tokens": tot.padded_tokens,
                "batch_cost": tot.cost,
                "replica": {"connected": bool(conn and conn.connected),
                            "delivered_step": conn.delivered if conn else -1,
                            "samples_fetched": facts.fetched_by_rank.get(r, 0)},
            })
        # Over every rank id the job had (a reconfiguration may have ended some).
        totals = {f"{k}_emitted": sum(getattr(t, k) for t in pt.ranks.values())
                  for k in ("batches", "samples", "tokens")}
        totals["padded_tokens"] = sum(t.padded_tokens for t in pt.ranks.values())
        totals["batch_cost"] = sum(t.cost for t in pt.ranks.values())
        counts = st.counters()
        done = st.is_done()
        ends = st.epoch_ends()
        finals = ([-1 if s is None else s for s in ends[-1].final_step]
                  if len(ends) >= rt.job.epochs else None)
        lease = st.producer_lease()
        error = st.error()
        uptime = now - pt.started_at
        budget = rt.job.batching.token_budget
        out: dict[str, Any] = {
            "job_id": job_id, "mode": rt.mode, "world_size": len(health),
            "worlds": world_history(st),
            "epochs": rt.job.epochs, "collate": rt.collate, "token_budget": budget,
            "state": job_state(error=error, done=done, published_through=pt.scanned_through,
                               epochs=rt.job.epochs, final_steps=finals, acked=acked),
            "published_through": pt.scanned_through, "done": done, "error": error,
            "samples_in": counts.samples_in,
            "planned": {"samples": counts.samples_planned, "tokens": counts.tokens_planned},
            "producer": None if lease is None else {
                "generation": lease.generation, "holder": lease.holder,
                "live": lease.expires_at > now},
            "uptime_s": round(uptime, 3),
            "ranks": ranks, "lapsed_ranks": sorted(lapsed), "totals": totals,
            **derived(totals, budget),
            "throughput": rates(totals, None, uptime, "uptime"),
            "quarantine": {"total": counts.quarantined,
                           "by_reason": dict(counts.quarantined_by_reason)},
            "epoch_ends": [{"epoch": e.epoch, "steps": e.steps,
                            "final_step": [-1 if s is None else s for s in e.final_step],
                            "carried_over": len(e.carried_over)} for e in ends],
            "replica": {"id": self.replica_id, "uptime_s": round(facts.uptime_s, 3)},
        }
        if quarantine:
            out["quarantine"]["records"] = [
                {"sample_id": q.sample_id, "reason": q.reason, "detail": q.detail}
                for q in st.quarantine(MAX_RECORDS)]
        return out
