"""Start/stop the whole data plane for a ServiceConfig: job runtimes + gRPC server.

    svc = start_service(config, sample_sources={"job": ArraySource(samples)})
    ... svc.port ...
    svc.stop()

Jobs without an explicit source get a `RaySource` (Ray must be initialized by the caller);
jobs without an explicit JobState get `make_job_state(config, job)`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pipeline.config import ServiceConfig
from pipeline.observability import MetricsServer, start_metrics_server
from pipeline.service.auth import server_credentials
from pipeline.service.data_server import DataServicer, add_servicer
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.job_state import JobState
from pipeline.service.sources import RaySource, SampleSource
from pipeline.service.state_factory import make_job_state
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DataService"].full_name  # "odb.v1.DataService"


def grpc_options(max_message_mb: int) -> list[tuple[str, int]]:
    n = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


@dataclass
class RunningService:
    server: grpc.Server
    port: int
    runtimes: dict[str, JobRuntime]
    health: health.HealthServicer
    metrics: MetricsServer | None = None  # Prometheus /metrics + status page, if configured

    @property
    def metrics_port(self) -> int | None:
        return self.metrics.port if self.metrics is not None else None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        """Drain: report NOT_SERVING, stop producers, let streams end, close sources."""
        self.health.enter_graceful_shutdown()
        if self.metrics is not None:
            self.metrics.close()
        for rt in self.runtimes.values():
            rt.stop()
        self.server.stop(grace).wait(grace + 1.0)

    def wait(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)


def start_service(
    config: ServiceConfig,
    *,
    job_states: Mapping[str, JobState] | None = None,
    sample_sources: Mapping[str, SampleSource] | None = None,
    tokens: Mapping[str, str | None] | None = None,
    resume_grace_s: float = 2.0,
    max_workers: int | None = None,
    pool_steps: int | None = None,
) -> RunningService:
    """Start producers and the gRPC server for every job of `config`; returns once listening.

    `tokens` overrides the per-job bearer tokens (default: each job's `token_env` variable).
    `pool_steps` sets the planner's balancing pool (None: its default, ~256 batches).
    """
    job_states = dict(job_states or {})
    sample_sources = dict(sample_sources or {})
    runtimes: dict[str, JobRuntime] = {}
    toks: dict[str, str | None] = {}
    for job in config.jobs:
        state = job_states.get(job.job_id) or make_job_state(config, job)
        source = sample_sources.get(job.job_id) or RaySource(job)
        runtimes[job.job_id] = JobRuntime(job, state, source,
                                          prefetch_steps=config.grpc.prefetch_steps,
                                          pool_steps=pool_steps)
        toks[job.job_id] = tokens[job.job_id] if tokens and job.job_id in tokens else job.token()

    # One pool thread per live stream (+ unary calls): size it for every rank of every job.
    workers = max_workers or max(16, sum(j.world_size for j in config.jobs) * 2 + 8)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="odb"),
                         options=grpc_options(config.grpc.max_message_mb))
    servicer = DataServicer(runtimes, toks, lease_seconds=config.lease_seconds,
                            prefetch_steps=config.grpc.prefetch_steps,
                            resume_grace_s=resume_grace_s,
                            rank_timeout_seconds=config.rank_timeout_seconds,
                            rank_failure_policy=config.rank_failure_policy)
    add_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    addr = f"{config.grpc.host}:{config.grpc.port}"
    creds = server_credentials(config.grpc)
    port = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
    if port == 0:
        raise OSError(f"cannot listen on {addr}")
    for rt in runtimes.values():
        rt.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %d job(s) on %s (tls=%s)", len(runtimes), addr, creds is not None)
    running = RunningService(server, port, runtimes, health_servicer)
    if config.metrics_port is not None:
        running.metrics, _ = start_metrics_server(config.metrics_port, running,
                                                  host=config.grpc.host)
    return running
