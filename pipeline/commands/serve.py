"""`odb-pipeline serve --config FILE`: Ray preprocessing, planner and gRPC server for the jobs.

SIGINT/SIGTERM drain: health goes NOT_SERVING, producers stop, open streams get UNAVAILABLE
(clients reconnect elsewhere or later), then Ray shuts down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from pipeline.config import load_config
from pipeline.errors import UserError

log = logging.getLogger("pipeline.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="service config file (YAML or JSON)")
    parser.add_argument("--host", help="override grpc.host")
    parser.add_argument("--port", type=int, help="override grpc.port (0 = a free port)")


def _init_ray(config) -> None:
    import ray

    # A private local Ray: no token-auth files, workers not starved (see NOTES.md).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    if config.ray.address:
        ray.init(address=config.ray.address, log_to_driver=False)
    else:
        ray.init(num_cpus=config.ray.num_cpus, include_dashboard=False, log_to_driver=False,
                 object_store_memory=config.ray.object_store_mb * 1024 * 1024)


def run(args: argparse.Namespace) -> int:
    grpc_over = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    config = load_config(args.config, overrides={"grpc": grpc_over} if grpc_over else None)
    if not config.jobs:
        raise UserError(f"{args.config}: no jobs configured (add a `jobs:` list)")
    for job in config.jobs:
        job.token()  # fail now, with the variable's name, if a token is missing
    from pipeline.observability import configure_logging
    from pipeline.service.server import start_service

    configure_logging(config.log_format, config.log_level)
    embedded = None
    if config.redis_url is None:
        # The embedded default: a private Redis for this process, stopped on exit.
        from pipeline.redis_server import LocalRedis

        embedded = LocalRedis().start()
        config = config.model_copy(update={"redis_url": embedded.url})
        log.info("no redis_url configured: started an embedded Redis on port %d", embedded.port)
    _init_ray(config)
    try:
        svc = start_service(config)
    except OSError as exc:
        if embedded is not None:
            embedded.cleanup()
        raise UserError(str(exc)) from None
    # After ray.init, which installs its own SIGTERM handler (it would abort the process).
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"odb-pipeline serve: listening on {config.grpc.host}:{svc.port} "
          f"for job(s) {', '.join(j.job_id for j in config.jobs)}"
          + (f"; metrics on :{svc.metrics_port}" if svc.metrics_port else ""), flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        print("odb-pipeline serve: draining", flush=True)
        svc.stop(grace=2.0)
        import ray

        ray.shutdown()
        if embedded is not None:
            embedded.cleanup()
    print("odb-pipeline serve: stopped", flush=True)
    return 0
