"""`odb-pipeline status` data: ask the service (gRPC GetJob), its HTTP side port (/status.json)
and Redis (the coordinator's operator reads), each answer read into a `JobStatus`
(`pipeline.observability.job_status`), then merged into one per job (`merge.py`).

Each source answers different questions: GetJob is the authenticated, authoritative per-rank
position; /status.json adds emission totals, padding, quarantine reasons and records, rates;
Redis adds retention and the coordinator's records (and lists jobs without a server). Every
failure becomes one `UserError` line that names the address.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from pipeline.errors import UserError
from pipeline.observability.job_status import CoordinatorStatus, JobStatus
from pipeline.observability.status_json import job_from_dict
from pipeline.status.merge import merge
from pipeline.status.report import StatusReport

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
def _grpc_job(src: Sources, job_id: str) -> JobStatus:
    from pipeline.observability.status_proto import from_proto
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
    return from_proto(st)


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


def _redis_job_status(client: Any, job_id: str) -> JobStatus | None:
    """A job from Redis alone, built as a replica builds it (but its connections and totals),
    with what only the registry records."""
    from pipeline.coordinator import RedisJobState, job_summary
    from pipeline.observability.status_view import (
        MAX_RECORDS,
        refill_job_status,
        training_job_status,
    )

    s = job_summary(client, job_id)
    if s is None:
        return None
    if s.refill is not None:
        return refill_job_status(job_id, s.refill, records=s.refill_records)
    job = training_job_status(job_id, RedisJobState.attach(client, job_id),
                              records=MAX_RECORDS)
    return replace(job, exposure=s.exposure, coordinator=CoordinatorStatus(
        state=s.job.state, published_through=s.job.published_through,
        trimmed_through=s.job.trimmed_through, retained_steps=s.retained_steps,
        min_acked=s.min_acked, epoch_ends=s.epoch_ends, lease_lapses=s.counters.lease_lapses,
        created_at=s.job.created_at))


# --- asking every source -----------------------------------------------------------------------
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


def collect(src: Sources) -> StatusReport:
    """Every job the sources know (or `src.jobs`), each merged from GetJob, the metrics port
    and Redis, in that order of authority."""
    if not (src.endpoint or src.metrics or src.redis_url):
        raise UserError("nothing to ask: give --endpoint HOST:PORT, --metrics-endpoint "
                        "HOST:PORT and/or --redis-url URL")
    jobs = []
    http_jobs: dict[str, JobStatus] = {}
    if src.metrics:
        snap = _http_snapshot(src, src.jobs[0] if len(src.jobs) == 1 else None)
        http_jobs = {j["job_id"]: job_from_dict(j) for j in snap["jobs"]}
    for jid in job_ids(src):
        g = _grpc_job(src, jid) if src.endpoint and jid not in src.grpc_skipped else None
        h = http_jobs.get(jid)
        r = _redis_call(src, _redis_job_status, jid) if src.redis_url else None
        parts = [p for p in (g, h, r) if p is not None]
        if not parts:
            where = [w for w in (src.metrics and f"metrics endpoint {src.metrics}",
                                 src.redis_url and "Redis") if w]
            raise UserError(f"unknown job {jid!r}: not found at {' or '.join(where)}")
        jobs.append(merge(parts))
    return StatusReport(time.time(), src.describe(), tuple(jobs))
