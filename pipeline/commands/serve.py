"""`odb-pipeline serve --config FILE`: one serving replica of the jobs in the config.

Without `redis_url` it starts the embedded default: a private Redis whose AOF lives in
`state_dir` (printed at start), so restarting `serve` resumes every job where it was. With
`redis_url` (and `ray.address`) the same command started N times is one service of N replicas.
SIGINT/SIGTERM drain: health goes NOT_SERVING, open streams get UNAVAILABLE (clients reconnect to
another replica or later), then Ray is left (a private Ray is shut down). While it listens, the
replica's addresses are recorded under `state_dir` (`pipeline.local_services`), where
`odb-pipeline status` without flags finds them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline.config import ServiceConfig, load_config
from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.local_services import LocalService

log = logging.getLogger("pipeline.serve")
RAY_START_DELAY_S = 10.0  # Ray's start waits this long at most for the first steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="service config file (YAML or JSON)")
    parser.add_argument("--host", help="override grpc.host")
    parser.add_argument("--port", type=int, help="override grpc.port (0 = a free port)")


def run(args: argparse.Namespace) -> int:
    grpc_over = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    config = load_config(args.config, overrides={"grpc": grpc_over} if grpc_over else None)
    if not config.jobs:
        raise UserError(f"{args.config}: no jobs configured (add a `jobs:` list)")
    for job in config.jobs:
        job.token()  # fail now, with the variable's name, if a token is missing
    status_token = config.status_token()
    from pipeline import local_services
    from pipeline.observability import configure_logging, start_metrics_server
    from pipeline.redis_server import LocalRedis
    from pipeline.service.server import start_service

    configure_logging(config.log_format, config.log_level)
    embedded = None
    if config.redis_url is None:
        embedded = LocalRedis.durable(config.state_dir).start()
        config = config.model_copy(update={"redis_url": embedded.url})
        print(f"odb-pipeline serve: embedded Redis with its state in {embedded.data_dir}",
              flush=True)
    # A cluster is joined at once (a replica's producer is the job's Ray actor). A private Ray
    # starts after the gRPC server (it takes 5-10 s on a small machine): ranks connect at once
    # and the first steps are planned in this process meanwhile (producer.hosting.
    # BootstrapHost); Ray's start waits for them, up to RAY_START_DELAY_S, so that its
    # processes do not take the CPUs the first batch needs.
    ray_up = RayStarter(config)
    try:
        if config.ray.address:
            ray_up.join()
        try:
            svc = start_service(config, ray_ready=ray_up.ready)
        except OSError as exc:
            raise UserError(str(exc)) from None
        metrics_port = None
        if config.metrics_port is not None:
            # Bound before a private Ray starts: its processes take ports of their own.
            try:
                _, metrics_port = start_metrics_server(config.metrics_port, svc,
                                                       host=config.metrics_host,
                                                       status_token=status_token)
            except OSError as exc:
                svc.stop(grace=0)
                raise UserError(f"metrics port {config.metrics_port}: {exc.strerror}") from None
        if not config.ray.address and svc.runtimes:  # (refill jobs need no Ray)
            ray_up.start(lambda: all(rt.state.published_through() >= 0 or rt.state.is_done()
                                     for rt in svc.runtimes.values()))
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        record = local_services.register(config.state_dir, _record(args, config, svc.port,
                                                                   metrics_port))
        print(f"odb-pipeline serve: replica {svc.replica_id} listening on "
              f"{config.grpc.host}:{svc.port} for job(s) "
              f"{', '.join(j.job_id for j in config.jobs)}"
              + (f"; metrics on :{metrics_port}" if metrics_port else ""), flush=True)
        try:
            while not stop.wait(0.5):
                if ray_up.error is not None:
                    raise UserError(f"Ray did not start: {ray_up.error}")
        finally:
            local_services.unregister(record)
            print("odb-pipeline serve: draining", flush=True)
            svc.stop(grace=2.0)
    finally:
        ray_up.close()
        if embedded is not None:
            embedded.cleanup()
    print("odb-pipeline serve: stopped", flush=True)
    # Everything this command started is stopped and its state is in Redis: end the process
    # here. Interpreter finalization with gRPC's and Ray's native threads still winding down
    # can abort (SIGABRT) a clean drain's exit status.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RayStarter:
    """Joins the configured cluster, or starts a private Ray in a thread (ray.init off the main
    thread leaves our signal handlers alone); `ready` is set once Ray is up."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.ready = threading.Event()
        self.error: str | None = None
        self._private = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def join(self) -> None:
        """Join the configured cluster now (in this thread)."""
        from pipeline.ray_runtime import join_cluster

        join_cluster(self.config.ray.address)
        self.ready.set()

    def start(self, first_steps_out: Callable[[], bool]) -> None:
        """Start a private Ray in a thread once `first_steps_out()` (or after a delay)."""
        self._thread = threading.Thread(target=self._run, args=(first_steps_out,),
                                        name="ray-start", daemon=True)
        self._thread.start()

    def _run(self, first_steps_out: Callable[[], bool]) -> None:
        from pipeline.ray_runtime import PrivateRay

        deadline = time.monotonic() + RAY_START_DELAY_S
        while time.monotonic() < deadline and not self._closing.is_set():
            try:
                if first_steps_out():
                    break
            except Exception:  # the state answers later: start Ray anyway at the deadline
                log.debug("first-steps check failed", exc_info=True)
            time.sleep(0.1)

        ray_cfg = self.config.ray
        try:
            self._private = PrivateRay(num_cpus=ray_cfg.num_cpus,
                                       object_store_mb=ray_cfg.object_store_mb,
                                       prefix="odb-serve-ray-").__enter__()
        except Exception as exc:  # reported by the serve loop as a one-line error
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("Ray did not start: %s", self.error)
            return
        self.ready.set()
        log.info("Ray is up")
        # Ray's node processes die with the *thread* that started them (PR_SET_PDEATHSIG):
        # this thread lives until close() and shuts Ray down itself.
        self._closing.wait()
        self._private.close()

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(60)


def _record(args: argparse.Namespace, config: ServiceConfig, port: int,
            metrics_port: int | None) -> LocalService:
    from pipeline.local_services import LocalService, dial_host

    host, metrics_host = dial_host(config.grpc.host), dial_host(config.metrics_host)
    return LocalService(
        kind="serve", pid=os.getpid(), redis_url=config.redis_url or "",
        grpc=f"{host}:{port}",
        metrics=f"{metrics_host}:{metrics_port}" if metrics_port else None,
        tls_cert=os.path.abspath(config.grpc.tls_cert) if config.grpc.tls_cert else None,
        config=os.path.abspath(args.config),
        token_envs={j.job_id: j.token_env for j in config.jobs})
