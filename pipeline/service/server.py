"""Start/stop one serving replica for a ServiceConfig: per-job runtimes + the gRPC server.

    svc = start_service(config, sample_sources={"job": ArraySource(samples)})
    ... svc.port ...
    svc.stop()

Started N times with the same Redis (and Ray cluster), these replicas are one service: each
job's state lives in Redis, its producer runs once (a Ray actor for jobs preprocessed by Ray
Data; a lease-guarded thread for in-memory sources), and any replica serves any rank.
Jobs without an explicit source are preprocessed by Ray Data (Ray must be initialized by the
caller, and the job state must be Redis: the producer actor is another process).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from pipeline.config import GrpcConfig, RefillJobConfig, ServiceConfig, TrainingJobConfig
from pipeline.errors import UserError
from pipeline.jobstate.interface import JobState
from pipeline.preprocess.array_source import ArraySource
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.hosting import ActorHost, BootstrapHost, ProducerHost, ThreadHost
from pipeline.producer.producer import ProducerSettings
from pipeline.service.auth import server_credentials
from pipeline.service.batch_bound import batch_size_notice, largest_batch
from pipeline.service.data_server import DataServicer, add_servicer
from pipeline.service.exposure import enforce_exposure
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.liveness import policy_named
from pipeline.service.loop_server import LoopServer
from pipeline.service.payloads import ArrayPayloads, PayloadSource, RayPayloads
from pipeline.service.rank_stream import RankStreams, StreamSettings
from pipeline.service.readiness import ReplicaHealth, StateWatch
from pipeline.service.refill_server import RefillJob, RefillServicer, connect_refill_job
from pipeline.service.state_factory import make_job_state
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire_format import DEFAULT_PREFETCH_BYTES

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DataService"].full_name  # "odb.v1.DataService"


def grpc_options(cfg: GrpcConfig) -> list[tuple[str, int]]:
    """Message limits (batches are large, requests small) and keepalive: the server pings an
    idle connection every `keepalive_time_s` and closes it when a ping goes unanswered for
    `keepalive_timeout_s` (a frozen client, a partition: its streams end); it accepts the
    clients' own keepalive pings down to `min_client_ping_interval_s`, also between calls, so
    a client at its defaults never gets GOAWAY "too_many_pings"."""
    def ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    return [("grpc.so_reuseport", 0),  # a port in use is refused, never shared with its holder
            ("grpc.max_send_message_length", cfg.max_message_mb * 1024 * 1024),
            ("grpc.max_receive_message_length", cfg.max_request_mb * 1024 * 1024),
            ("grpc.keepalive_time_ms", ms(cfg.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(cfg.keepalive_timeout_s)),
            ("grpc.http2.ping_timeout_ms", ms(cfg.keepalive_timeout_s)),  # (what times it out)
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging an idle stream's peer
            ("grpc.http2.min_ping_interval_without_data_ms", ms(cfg.min_client_ping_interval_s))]


def new_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class RunningService:
    server: LoopServer
    port: int
    runtimes: dict[str, JobRuntime]
    health: ReplicaHealth
    replica_id: str
    on_stop: list = field(default_factory=list)  # callables run at stop (metrics server, ...)
    refill_jobs: dict[str, RefillJob] = field(default_factory=dict)  # `mode: refill` jobs
    open_jobs: frozenset[str] = frozenset()  # jobs served without a credential (no token)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        """Drain: report NOT_SERVING, stop this replica's runtimes, let streams end."""
        self.health.enter_graceful_shutdown()
        for fn in self.on_stop:
            fn()
        for rt in self.runtimes.values():
            rt.stop()
        self.server.stop(grace).wait(grace + 5.0)
        for rt in self.runtimes.values():
            rt.state.close()


def producer_settings(config: ServiceConfig) -> ProducerSettings:
    # Room for a full client window plus the step held by the trainer and the one in flight.
    return ProducerSettings(lease_seconds=config.lease_seconds,
                            max_ahead=2 * config.grpc.prefetch_steps + 2,
                            linger_seconds=max(60.0, 2 * config.rank_timeout_seconds))


def _job_parts(config: ServiceConfig, job: TrainingJobConfig, state: JobState,
               array: ArraySource | None, replica_id: str, settings: ProducerSettings,
               ray_ready: threading.Event | None) -> tuple[PayloadSource, ProducerHost]:
    if array is not None:
        if job.organization.kind == "sdo":
            raise UserError(f"job {job.job_id!r}: organization.kind sdo needs a job preprocessed "
                            "by Ray Data (a `source` of files: its records are embedded), not "
                            "an in-memory sample source")
        host = ThreadHost(job, state, ArrayFeed(array, job.batching.collate),
                          holder=f"replica:{replica_id}", settings=settings)
        return ArrayPayloads(array), host
    if not config.redis_url:
        raise UserError(f"job {job.job_id!r}: jobs preprocessed by Ray need a Redis "
                        "(redis_url): their producer is a Ray actor in another process")
    # SDO jobs plan visits from the whole epoch's embeddings: only their actor can (no bootstrap).
    if ray_ready is not None and not ray_ready.is_set() and job.organization.kind == "none":
        host = BootstrapHost(job, state, config.redis_url, holder=f"replica:{replica_id}",
                             settings=settings, ray_ready=ray_ready,
                             fsync_publish=config.fsync_publish)
        return RayPayloads(job, local=host.feed, timeout_s=config.payload_timeout_seconds), host
    return (RayPayloads(job, timeout_s=config.payload_timeout_seconds),
            ActorHost(job, state, config.redis_url, settings=settings,
                      fsync_publish=config.fsync_publish))


def start_service(
    config: ServiceConfig,
    *,
    job_states: Mapping[str, JobState] | None = None,
    sample_sources: Mapping[str, ArraySource] | None = None,
    tokens: Mapping[str, str | None] | None = None,
    resume_grace_s: float | None = None,
    replica_id: str | None = None,
    ray_ready: threading.Event | None = None,
) -> RunningService:
    """Start this replica's runtimes and gRPC server for every job of `config`; returns once
    listening. `tokens` overrides the per-job bearer tokens (default: each job's `token_env`
    variable). `ray_ready`: an event set once Ray is initialized, for a caller that starts Ray
    meanwhile (None: Ray is up already); until then Ray jobs are planned in this process."""
    enforce_exposure(config, tokens)  # no job open beyond loopback unless opted in (#28)
    # Rank streams and health watches are coroutines of the server's loop; threads serve the
    # unary calls and Refill (a refill consumer holds one: room for 32 per job), and the
    # streams' blocking reads and writes (grouped: a few threads serve any number of streams).
    # (Threads are started on demand, so the bounds cost nothing until used.)
    replica_id = replica_id or new_replica_id()
    n_refill = sum(isinstance(job, RefillJobConfig) for job in config.jobs)
    server = LoopServer(grpc_options(config.grpc), handler_threads=16 + 32 * n_refill,
                        io_threads=8)
    try:
        # The port first: one in use is refused before any job's state or lease is touched.
        addr, port, tls = _listen(server, config.grpc)
        runtimes, refill_jobs, toks = _jobs(config, job_states or {}, sample_sources or {},
                                            tokens, replica_id, ray_ready)
    except BaseException:
        server.stop(None).wait(10.0)
        raise
    settings = StreamSettings(
        lease_seconds=config.lease_seconds, prefetch_steps=config.grpc.prefetch_steps,
        resume_grace_s=(config.resume_grace_seconds if resume_grace_s is None
                        else resume_grace_s),
        state_timeout_seconds=config.state_timeout_seconds,
        payload_timeout_seconds=config.payload_timeout_seconds)
    streams = RankStreams(settings, policy_named(config.rank_failure_policy,
                                                 config.rank_timeout_seconds), server.io)
    replica_health = ReplicaHealth(server, services=("", SERVICE_NAME))
    # NOT_SERVING while a job's state cannot be reached (/healthz follows: readiness).
    watch = StateWatch(replica_health, {j: rt.state for j, rt in runtimes.items()},
                       timeout_s=config.state_timeout_seconds)
    servicer = DataServicer(runtimes, toks, streams=streams, replica_id=replica_id,
                            refill=_refill_servicer(refill_jobs, toks, runtimes),
                            state_reachable=lambda: watch.serving)
    add_servicer(servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    server.start()  # listening before any producer starts: ranks may connect at once
    replica_health.set(serving=True)
    for rt in runtimes.values():
        rt.start()
    on_stop = [watch.start().stop]
    if servicer.refill is not None:
        servicer.refill.start()
        on_stop.append(servicer.refill.stop)
    log.info("replica %s serving %d job(s) on %s (tls=%s)", replica_id,
             len(runtimes) + len(refill_jobs), addr, tls)
    return RunningService(server, port, runtimes, replica_health, replica_id, on_stop,
                          refill_jobs, frozenset(j for j, t in toks.items() if t is None))


def _listen(server: LoopServer, cfg: GrpcConfig) -> tuple[str, int, bool]:
    """Bind the gRPC port (never shared: `grpc.so_reuseport` is off); (address, port, tls)."""
    addr = f"{cfg.host}:{cfg.port}"
    creds = server_credentials(cfg)
    try:
        port = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
    except RuntimeError:  # grpc.aio: "Failed to bind to address ..."
        port = 0
    if port == 0:  # (gRPC does not say why)
        raise OSError(port_in_use(addr, "grpc.port", "--port",
                                  also=f", or {cfg.host} is no address of this machine"))
    return addr, port, creds is not None


def port_in_use(addr: str, setting: str, flag: str | None = None, also: str = "") -> str:
    """What a port that cannot be bound means and what to do (another service holds it)."""
    port = addr.rsplit(":", 1)[-1]
    env = "ODB_" + setting.upper().replace(".", "__")
    how = f"{setting}{f' / {flag}' if flag else ''} / {env}"
    return (f"cannot listen on {addr}: the port is in use (another `odb-pipeline serve`, or "
            f"another program: `ss -ltnp 'sport = :{port}'` shows which){also}; stop it, or "
            f"give this service another port ({how})")


def _jobs(config: ServiceConfig, job_states: Mapping[str, JobState],
          sample_sources: Mapping[str, ArraySource], tokens: Mapping[str, str | None] | None,
          replica_id: str, ray_ready: threading.Event | None
          ) -> tuple[dict[str, JobRuntime], dict[str, RefillJob], dict[str, str | None]]:
    """Every job's runtime (a training job) or registration (a refill job), and its token."""
    settings = producer_settings(config)
    runtimes: dict[str, JobRuntime] = {}
    refill_jobs: dict[str, RefillJob] = {}
    toks: dict[str, str | None] = {}
    for job in config.jobs:
        toks[job.job_id] = tokens[job.job_id] if tokens and job.job_id in tokens else job.token()
        if isinstance(job, RefillJobConfig):
            refill_jobs[job.job_id] = connect_refill_job(config, job, replica_id)
            continue
        if job.job_id in job_states:
            state = job_states[job.job_id]
        else:
            state, job = make_job_state(config, job)  # the job as served (registry.py)
        payloads, host = _job_parts(config, job, state, sample_sources.get(job.job_id),
                                    replica_id, settings, ray_ready)
        runtimes[job.job_id] = JobRuntime(job, state, payloads, host,
                                          chunk_bytes=config.grpc.chunk_kb * 1024,
                                          batch_notice=_batch_notice(config, job))
    return runtimes, refill_jobs, toks


def _batch_notice(config: ServiceConfig, job: TrainingJobConfig) -> str | None:
    """What the job's largest batch means for its trainers, logged at start (and in status)
    when it is beyond a message or a trainer's default byte window."""
    notice = batch_size_notice(
        job, largest_batch(job), prefetch_bytes=DEFAULT_PREFETCH_BYTES,
        prefetch_steps=config.grpc.prefetch_steps,
        max_message_bytes=config.grpc.max_message_mb * 1024 * 1024,
        chunk_bytes=config.grpc.chunk_kb * 1024)
    if notice:
        log.info("%s", notice, extra={"job": job.job_id})
    return notice


def _refill_servicer(jobs: dict[str, RefillJob], tokens: dict[str, str | None],
                     runtimes: Mapping[str, JobRuntime]) -> RefillServicer | None:
    if not jobs:
        return None
    return RefillServicer(jobs, tokens, {j: rt.mode for j, rt in runtimes.items()})
