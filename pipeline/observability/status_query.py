"""`odb-pipeline status` data: ask the service (gRPC GetJob), its HTTP side port (/status.json)
and Redis (the coordinator's operator reads), and merge them into one dict per job.

Each source answers different questions: GetJob is the authenticated, authoritative per-rank
position; /status.json adds emission totals, padding, quarantine reasons and records, buffers;
Redis adds heartbeats, lapses and the coordinator counters (and lists jobs without a server).
Every failure becomes one `UserError` line that names the address.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc

from pipeline.errors import UserError
from pipeline.observability.status_view import derived, job_state, rates, world_history

# Generous: a replica on a saturated machine (its Ray starting, preprocessing) still answers.
RPC_TIMEOUT_S = 15.0


@dataclass
class Sources:
    endpoint: str | None = None  # gRPC target
    metrics: str | None = None  # HTTP HOST:PORT (or base URL) of the metrics/status port
    redis_url: str | None = None
    token: str | None = None  # bearer token for every job's GetJob
    job_tokens: dict[str, str] = field(default_factory=dict)  # per job, over `token`
    status_token: str | None = None  # /status.json's bearer token (a port beyond loopback)
    grpc_skipped: dict[str, str] = field(default_factory=dict)  # job -> why GetJob is not asked
    tls: grpc.ChannelCredentials | None = None  # None: plaintext gRPC
    local: str | None = None  # the local service these addresses were found from
    jobs: list[str] = field(default_factory=list)  # empty: every job the sources list
    _channel: grpc.Channel | None = field(default=None, repr=False)  # opened on first use
    _redis: Any = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        from pipeline.redis_client import redact

        out: dict[str, Any] = {"endpoint": self.endpoint, "metrics": self.metrics,
                               "redis": redact(self.redis_url) if self.redis_url else None,
                               "tls": self.tls is not None}
        if self.local:
            out["local_service"] = self.local
        if self.grpc_skipped:
            out["grpc_skipped"] = dict(self.grpc_skipped)
        return out

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._redis is not None:
            self._redis.close()


# --- gRPC -------------------------------------------------------------------------------------
def _grpc_job(src: Sources, job_id: str) -> dict[str, Any]:
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb
    from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

    if src._channel is None:
        src._channel = (grpc.secure_channel(src.endpoint, src.tls) if src.tls is not None
                        else grpc.insecure_channel(src.endpoint))
    token = src.job_tokens.get(job_id, src.token)
    md = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        st = pb_grpc.DataServiceStub(src._channel).GetJob(
            pb.GetJobRequest(job_id=job_id), metadata=md, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            hint = ("; is the TLS root (--tls-ca) the one that signed the server's "
                    "certificate?" if src.tls is not None else "")
            raise UserError(f"cannot reach the service at {src.endpoint} "
                            f"({code.name}: {exc.details()}){hint}") from None
        raise UserError(f"service at {src.endpoint}: {code.name}: {exc.details()}") from None
    return {
        "job_id": st.job_id, "world_size": st.world_size, "mode": pb.Mode.Name(st.mode).lower(),
        "epochs": st.epochs, "published_through": st.published_through, "done": st.done,
        "error": st.error or None, "samples_in": st.samples_in,
        "quarantine": {"total": st.quarantined},
        "lapsed_ranks": list(st.lapsed_ranks),
        "ranks": [{"rank": r.rank, "acked_step": r.acked_step,
                   "replica": {"connected": r.connected, "delivered_step": r.delivered_step,
                               "client_id": r.client_id}}
                  for r in st.ranks],
        "replica": {"id": st.replica_id},
        "epoch_ends": [{"epoch": e.epoch, "steps": e.steps, "final_step": list(e.final_step),
                        "carried_over": e.carried_over} for e in st.epoch_ends],
        "worlds": [_world(w) for w in st.worlds], "reconfiguring": st.reconfiguring,
        **({"refill": _refill(st.refill), "state": "done" if st.done else "serving"}
           if st.mode == pb.REFILL else {}),
    }


def _refill(c: Any) -> dict[str, Any]:
    """A refill job's counters (docs/refill.md) as `status --json` shows them."""
    return {"in_flight": c.in_flight, "completed": c.completed, "readmitted": c.readmitted,
            "waiting": c.waiting, "enqueued": c.enqueued, "admitted": c.admitted,
            "quarantined": c.quarantined, "consumers": c.consumers, "exhausted": c.exhausted}


def _world(w: Any) -> dict[str, Any]:
    """A wire `World` as `status_view.world_history` writes one (-1 on the wire: not yet)."""
    return {"generation": w.generation, "world_size": w.world_size, "first_step": w.first_step,
            "last_step": None if w.last_step < 0 else w.last_step,
            "rank_last_steps": list(w.rank_last_steps), "reason": w.reason,
            "requested_at": w.requested_at, "returned_samples": w.returned_samples,
            "adopted_s": None if w.adopted_seconds < 0 else round(w.adopted_seconds, 4),
            "drained_s": None,
            "first_batch_s": (None if w.first_batch_seconds < 0
                              else round(w.first_batch_seconds, 4)),
            "first_batch_s_by_rank": {}}


# --- HTTP side port ---------------------------------------------------------------------------
def _http_snapshot(src: Sources, job: str | None) -> dict[str, Any]:
    base = src.metrics if "://" in (src.metrics or "") else f"http://{src.metrics}"
    url = f"{base.rstrip('/')}/status.json?quarantine=1" + (f"&job={job}" if job else "")
    try:
        auth = {"Authorization": f"Bearer {src.status_token}"} if src.status_token else {}
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth),
                                    timeout=RPC_TIMEOUT_S) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            msg = json.load(exc).get("error", str(exc))
        except ValueError:
            msg = str(exc)
        raise UserError(f"metrics endpoint {base}: {msg}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"cannot reach the metrics endpoint at {base} ({reason})") from None


# --- Redis ------------------------------------------------------------------------------------
def _redis(src: Sources) -> Any:
    from redis.exceptions import RedisError

    from pipeline.errors import StateUnavailable
    from pipeline.redis_client import connect, redact

    if src._redis is None:
        try:
            src._redis = connect(src.redis_url, retries=1, socket_timeout=RPC_TIMEOUT_S)
            src._redis.ping()
        except (StateUnavailable, OSError, RedisError) as exc:
            raise UserError(f"cannot reach Redis at {redact(src.redis_url)} ({exc})") from None
    return src._redis


def _redis_call(src: Sources, fn: Any, *args: Any) -> Any:
    from pipeline.redis_client import redact

    try:
        return fn(_redis(src), *args)
    except UserError:
        raise
    except Exception as exc:  # StateUnavailable and redis-py errors: one line
        raise UserError(f"Redis at {redact(src.redis_url)}: {exc}") from None


def _redis_worlds(client: Any, job_id: str) -> list[dict[str, Any]]:
    from pipeline.coordinator import RedisJobState

    return world_history(RedisJobState.attach(client, job_id))


def _redis_job(src: Sources, job_id: str) -> dict[str, Any] | None:
    from pipeline.coordinator import job_summary

    s = _redis_call(src, job_summary, job_id)
    if s is None:
        return None
    c = s.counters
    return {
        "state": s.job.state, "world_size": s.job.world_size, "mode": s.job.mode,
        "published_through": s.job.published_through,
        "trimmed_through": s.job.trimmed_through, "retained_steps": s.retained_steps,
        "min_acked": s.min_acked, "epoch_ends": s.epoch_ends,
        "samples_in": c.samples_in, "planned": {"samples": c.samples_planned,
                                                "tokens": c.tokens_planned},
        "quarantine": {"total": c.quarantined, "by_reason": dict(c.quarantined_by_reason)},
        "lease_lapses": c.lease_lapses, "error": s.error,
        "producer": None if s.producer is None else {
            "generation": s.producer.generation, "holder": s.producer.holder,
            "live": s.producer.expires_at > time.time()},
        "lapsed_ranks": s.lapsed_ranks, "created_at": s.job.created_at,
        "exposure": s.exposure,
        "worlds": _redis_call(src, _redis_worlds, job_id),
        "ranks": [{"rank": h.rank, "acked_step": h.acked, "client_id": h.client_id,
                   "heartbeat_age_s": h.heartbeat_age, "lapsed_for_s": h.lapsed_for}
                  for h in s.ranks],
    }


# --- merging ----------------------------------------------------------------------------------
def _from_redis_only(job_id: str, r: dict[str, Any]) -> dict[str, Any]:
    return {
        "job_id": job_id, "world_size": r["world_size"], "mode": r["mode"],
        "published_through": r["published_through"], "done": r["state"] == "done",
        "error": r["error"], "lapsed_ranks": r["lapsed_ranks"], "samples_in": r["samples_in"],
        "planned": r["planned"], "producer": r["producer"], "quarantine": r["quarantine"],
        "worlds": r["worlds"],
        "ranks": [{"rank": h["rank"], "acked_step": h["acked_step"],
                   "client_id": h["client_id"] or ""} for h in r["ranks"]],
    }


def _merge(job_id: str, grpc_job: dict | None, http_job: dict | None,
           redis_job: dict | None) -> dict[str, Any]:
    out: dict[str, Any] = {"job_id": job_id}
    if redis_job is not None and grpc_job is None and http_job is None:
        out.update(_from_redis_only(job_id, redis_job))
    for part in (http_job, grpc_job):  # GetJob last: the authenticated, authoritative view
        if part is None:
            continue
        ranks = {r["rank"]: dict(r) for r in out.get("ranks", [])}
        for r in part.get("ranks", []):
            ranks.setdefault(r["rank"], {}).update(r)
        quarantine = {**out.get("quarantine", {}), **part.get("quarantine", {})}
        out.update({k: v for k, v in part.items() if k not in ("ranks", "quarantine")})
        out["ranks"], out["quarantine"] = [ranks[k] for k in sorted(ranks)], quarantine
    if redis_job is not None:
        out["redis"] = {k: v for k, v in redis_job.items() if k != "ranks"}
        if redis_job["exposure"] is not None:  # an SDO job: its ledger, written with the plan
            out["exposure"] = redis_job["exposure"]
        by_rank = {h["rank"]: h for h in redis_job["ranks"]}
        for r in out.get("ranks", []):
            h = by_rank.get(r["rank"], {})
            r["heartbeat_age_s"] = h.get("heartbeat_age_s")
            r["lapsed_for_s"] = h.get("lapsed_for_s", 0.0)
            r.setdefault("lapsed", h.get("lapsed_for_s", 0.0) > 0)
    pt = out.get("published_through", -1)
    for r in out.get("ranks", []):
        r.setdefault("lag_steps", max(0, pt - r.get("acked_step", -1)))
        r.setdefault("replica", None)
        r.setdefault("stalled", None)
        r.setdefault("lapsed", r["rank"] in out.get("lapsed_ranks", []))
    if ("state" not in out or http_job is None) and "refill" not in out:  # refill: no plan
        ends = out.get("epoch_ends")
        finals = (ends[-1]["final_step"] if isinstance(ends, list) and ends
                  and len(ends) >= out.get("epochs", 1) else None)
        out["state"] = job_state(error=out.get("error"), done=bool(out.get("done")),
                                 published_through=pt, epochs=out.get("epochs", 1),
                                 final_steps=finals,
                                 acked=[r.get("acked_step", -1) for r in out.get("ranks", [])])
    out.setdefault("totals", None)
    if out["totals"] is not None and "padding_efficiency" not in out:
        out.update(derived(out["totals"], out.get("token_budget")))
    return out


def job_ids(src: Sources) -> list[str]:
    if src.jobs:
        return list(src.jobs)
    ids: set[str] = set()
    if src.metrics:
        ids |= {j["job_id"] for j in _http_snapshot(src, None)["jobs"]}
    if src.redis_url:
        from pipeline.coordinator import list_jobs

        ids |= set(_redis_call(src, list_jobs))
    if not ids and not (src.metrics or src.redis_url):
        raise UserError("the gRPC API has no job listing: give --job ID, or --metrics-endpoint "
                        "or --redis-url to list the jobs")
    return sorted(ids)


def collect(src: Sources) -> dict[str, Any]:
    """One status object: {"generated_at", "sources", "jobs": [...]} (see the command's doc)."""
    if not (src.endpoint or src.metrics or src.redis_url):
        raise UserError("nothing to ask: give --endpoint HOST:PORT, --metrics-endpoint "
                        "HOST:PORT and/or --redis-url URL")
    jobs = []
    http_jobs: dict[str, dict] = {}
    if src.metrics:
        snap = _http_snapshot(src, src.jobs[0] if len(src.jobs) == 1 else None)
        http_jobs = {j["job_id"]: j for j in snap["jobs"]}
    for jid in job_ids(src):
        g = _grpc_job(src, jid) if src.endpoint and jid not in src.grpc_skipped else None
        h = http_jobs.get(jid)
        r = _redis_job(src, jid) if src.redis_url else None
        if g is None and h is None and r is None:
            where = [w for w in (src.metrics and f"metrics endpoint {src.metrics}",
                                 src.redis_url and "Redis") if w]
            raise UserError(f"unknown job {jid!r}: not found at {' or '.join(where)}")
        jobs.append(_merge(jid, g, h, r))
    return {"generated_at": time.time(), "sources": src.describe(), "jobs": jobs}


def add_interval_rates(now: dict[str, Any], before: dict[str, Any] | None) -> None:
    """Replace since-start throughput by the rate over the watch interval, when we can."""
    if before is None:
        return
    prev = {j["job_id"]: j for j in before["jobs"]}
    dt = now["generated_at"] - before["generated_at"]
    for job in now["jobs"]:
        p = prev.get(job["job_id"])
        if p is None or not job.get("totals") or not p.get("totals"):
            continue
        job["throughput"] = rates(job["totals"], p["totals"], dt, "interval")
        steps_now = max((r.get("acked_step", -1) for r in job["ranks"]), default=-1)
        steps_before = max((r.get("acked_step", -1) for r in p["ranks"]), default=-1)
        job["throughput"]["steps_per_s"] = (steps_now - steps_before) / max(dt, 1e-9)
