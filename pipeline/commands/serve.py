"""`odb-pipeline serve --config FILE`: one serving replica of the jobs in the config.

Without `redis_url` it starts the embedded default: a private Redis whose AOF lives in
`state_dir` (printed at start), so restarting `serve` resumes every job where it was. With
`redis_url` (and `ray.address`) the same command started N times is one service of N replicas.
SIGINT/SIGTERM, at any moment from the start on, drain within `--stop-grace` (`pipeline.
stop_signals`): health goes NOT_SERVING, open streams get UNAVAILABLE (clients reconnect to
another replica or later), the producers stop, then Ray is left (a private Ray is stopped) and
the embedded Redis stops last; the exit status is 0. The embedded Redis and the private Ray run
in sessions of their own, so a signal to serve's whole process group reaches serve alone.
While it listens, the replica's addresses are recorded under `state_dir`
(`pipeline.local_services`), where `odb-pipeline status` without flags finds them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import TYPE_CHECKING

from pipeline.config import ServiceConfig, load_config
from pipeline.errors import JobMismatch, UserError
from pipeline.stop_signals import DEFAULT_GRACE_S, StopSignals

if TYPE_CHECKING:
    from pipeline.local_services import LocalService
    from pipeline.ray_runtime import PrivateRay
    from pipeline.service.job_runtime import JobRuntime

log = logging.getLogger("pipeline.serve")
# Ray's start waits for the first steps planned in this process, this long at most (a safety
# cap: a bootstrap producer publishes its first step in seconds, or fails and says so).
RAY_START_DELAY_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="service config file (YAML or JSON)")
    parser.add_argument("--host", help="override grpc.host")
    parser.add_argument("--port", type=int, help="override grpc.port (0 = a free port)")
    parser.add_argument("--stop-grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, drain and stop within this long, else stop at "
                             f"once and exit 1 (default {DEFAULT_GRACE_S:g})")


def run(args: argparse.Namespace) -> int:
    if args.stop_grace <= 0:
        raise UserError(f"--stop-grace must be > 0, got {args.stop_grace}")
    # First thing: from here on a signal is an orderly stop of whatever has started.
    stop = StopSignals(args.stop_grace).install()
    grpc_over = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    config = load_config(args.config, overrides={"grpc": grpc_over} if grpc_over else None)
    if not config.jobs:
        raise UserError(f"{args.config}: no jobs configured (add a `jobs:` list)")
    problems = config.client_problems()
    if problems:
        raise UserError(f"{args.config}: settings the trainers' clients cannot work with: "
                        + "; ".join(problems))
    for job in config.jobs:
        job.token()  # fail now, with the variable's name, if a token is missing
    _check_sources(config)
    status_token = config.status_token()
    from pipeline import local_services
    from pipeline.observability import configure_logging, start_metrics_server
    from pipeline.redis_server import LocalRedis
    from pipeline.service.server import start_service

    _refuse_ports_in_use(config)  # before the embedded Redis, any state or lease

    configure_logging(config.log_format, config.log_level)
    # Stopped in reverse order of start: the status record, the service (streams drained, the
    # producers stopped at a checkpoint), Ray, then Redis last (its own stop fsyncs the AOF).
    embedded_state = config.state_dir if config.redis_url is None else None
    with ExitStack() as started:
        if config.redis_url is None:
            embedded = LocalRedis.durable(config.state_dir)
            started.callback(embedded.cleanup)
            embedded.start()
            stop.on_fast_stop(embedded.stop)
            config = config.model_copy(update={"redis_url": embedded.url})
            print(f"odb-pipeline serve: embedded Redis with its state in {embedded.data_dir}",
                  flush=True)
        # A cluster is joined at once (a replica's producer is the job's Ray actor). A private
        # Ray starts after the gRPC server (it takes 5-10 s on a small machine): ranks connect
        # at once and the first steps are planned in this process meanwhile (producer.hosting.
        # BootstrapHost); Ray's start waits for them (`_first_steps_out`), so that its
        # processes do not take the CPUs the first batch needs.
        ray_up = RayStarter(config)
        started.callback(ray_up.close)
        stop.on_fast_stop(ray_up.kill)
        if config.ray.address and not stop.requested.is_set():
            ray_up.join()
        if stop.requested.is_set():
            return _stopped(started)
        try:
            svc = start_service(config, ray_ready=ray_up.ready)
        except OSError as exc:
            raise UserError(str(exc)) from None
        except JobMismatch as exc:
            raise JobMismatch(f"{exc}. {_how_to_proceed(exc.job_id, args.config, embedded_state)}",
                              job_id=exc.job_id) from None
        started.callback(svc.stop, grace=2.0)
        metrics_port = None
        if config.metrics_port is not None:
            try:
                _, metrics_port = start_metrics_server(config.metrics_port, svc,
                                                       host=config.metrics_host,
                                                       status_token=status_token)
            except OSError as exc:
                raise UserError(f"metrics port {config.metrics_port}: {exc.strerror}") from None
        if stop.requested.is_set():
            return _stopped(started)
        private_ray = not config.ray.address and bool(svc.runtimes)  # (refill jobs need none)
        record = local_services.register(config.state_dir, _record(args, config, svc.port,
                                                                   metrics_port))
        started.callback(local_services.unregister, record)
        print(f"odb-pipeline serve: replica {svc.replica_id} listening on "
              f"{config.grpc.host}:{svc.port} for job(s) "
              f"{', '.join(j.job_id for j in config.jobs)}"
              + (f"; metrics on :{metrics_port}" if metrics_port else ""), flush=True)
        while not stop.requested.wait(0.2):
            if private_ray:
                ray_up.poll(lambda: _first_steps_out(svc.runtimes.values()))
            if ray_up.error is not None:
                raise UserError(f"Ray did not start: {ray_up.error}")
        return _stopped(started)


def _check_sources(config: ServiceConfig) -> None:
    """Every job's sources exist, are readable and their first row parses: a misspelt path is
    refused here, not found by the producer after `serve` said it listens."""
    from pipeline.preprocess.sources import check_sources

    for job in config.jobs:
        try:
            check_sources(job.source)
        except UserError as exc:
            raise UserError(f"job {job.job_id!r}: {exc}") from None


def _refuse_ports_in_use(config: ServiceConfig) -> None:
    """Each configured port, bound and released at once: one in use is refused before anything
    starts. (The gRPC port is then bound for good, unshared, before any job's state is
    touched: `start_service`; this check only makes the refusal come first.)"""
    from pipeline.service.server import port_in_use

    ports = [(config.grpc.host, config.grpc.port, "grpc.port", "--port")]
    if config.metrics_port is not None:
        ports.append((config.metrics_host, config.metrics_port, "metrics_port", None))
    for host, port, setting, flag in ports:
        if port and _in_use(host, port):
            raise UserError(port_in_use(f"{host}:{port}", setting, flag))


def _in_use(host: str, port: int) -> bool:
    """Whether binding `host:port` (as gRPC and the HTTP server do: SO_REUSEADDR, no
    SO_REUSEPORT) fails because the port is taken (any other failure is the real bind's to
    report)."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError:
        return False
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _how_to_proceed(job_id: str, config_path: str, state_dir: str | None) -> str:
    """What to do about a job whose stored config differs: the command that starts it over,
    or a new job id; and where the embedded default keeps it."""
    where = f" (its state is in {state_dir})" if state_dir else ""
    return (f"To start {job_id!r} over with this config{where}: `odb-pipeline job reset "
            f"{job_id} --config {config_path}`; to keep it, give this config another job_id")


def _stopped(started: ExitStack) -> int:
    """Stop everything started (in order), then end the process: status 0, or 1 if a part of
    the stop failed (said in the log; the rest was still stopped)."""
    print("odb-pipeline serve: draining", flush=True)
    status = 0
    try:
        started.close()
    except Exception:
        log.exception("the stop failed")
        status = 1
    print("odb-pipeline serve: stopped", flush=True)
    # Everything this command started is stopped and its state is in Redis: end the process
    # here. Interpreter finalization with gRPC's and Ray's native threads still winding down
    # can abort (SIGABRT) a clean drain's exit status.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _first_steps_out(runtimes: Iterable[JobRuntime]) -> bool:
    """Whether every job planned in this process until Ray is up (a bootstrap producer) has
    published its first step, or ended (done, or failed: the error is the job's to report)."""
    from pipeline.producer.hosting import BootstrapHost

    return all(rt.state.published_through() >= 0 or rt.state.is_done()
               or rt.state.error() is not None
               for rt in runtimes if isinstance(rt.host, BootstrapHost))


class RayStarter:
    """Joins the configured cluster, or starts a private Ray (`PrivateRay`: a node process of
    its own, joined as a driver from a thread, so serve's threads stay free meanwhile); `ready`
    is set once Ray is up."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.ready = threading.Event()
        self.error: str | None = None
        self._private: PrivateRay | None = None
        self._deadline: float | None = None

    def join(self) -> None:
        """Join the configured cluster now (in this thread)."""
        from pipeline.ray_runtime import join_cluster

        join_cluster(self.config.ray.address)
        self.ready.set()

    def poll(self, first_steps_out: Callable[[], bool]) -> None:
        """Called from the main thread's loop: start the private Ray once `first_steps_out()`,
        or RAY_START_DELAY_S after the first call. The node process starts here, in the main
        thread (it dies with the thread that started it); joining it runs in a thread."""
        if self._private is not None:
            return
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + RAY_START_DELAY_S
        if now < self._deadline:
            try:
                if not first_steps_out():
                    return
            except Exception:  # the state answers later: start Ray anyway at the deadline
                log.debug("first-steps check failed", exc_info=True)
                return
        from pipeline.ray_runtime import PrivateRay

        ray_cfg = self.config.ray
        self._private = PrivateRay(num_cpus=ray_cfg.num_cpus,
                                   object_store_mb=ray_cfg.object_store_mb,
                                   prefix="odb-serve-ray-")
        try:
            self._private.start()
        except Exception as exc:  # reported by the serve loop as a one-line error
            self._failed(exc)
            return
        threading.Thread(target=self._connect, name="ray-connect", daemon=True).start()

    def _connect(self) -> None:
        assert self._private is not None
        try:
            self._private.connect()
        except Exception as exc:
            self._failed(exc)
            return
        self.ready.set()
        log.info("Ray is up")

    def _failed(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.error("Ray did not start: %s", self.error)

    def close(self) -> None:
        if self._private is not None:
            self._private.close()

    def kill(self) -> None:
        if self._private is not None:
            self._private.kill()


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
