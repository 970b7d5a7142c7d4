"""A killable pipeline server process for the fault tests (run by them, not collected).

    python fault_server.py --redis-url URL --port P --config-json '{...job...}' --samples N

Starts `start_service` over RedisJobState (the config's redis_url) and an ArraySource of
deterministic synthetic samples, prints `READY <port>` and serves until killed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--job-json", required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--max-len", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full-len", type=int, default=0,
                   help="every sample this long (= the budget: one unsplittable batch each)")
    p.add_argument("--lease", type=float, default=5.0)
    args = p.parse_args()

    from fault_helpers import fault_samples

    from pipeline.config import ServiceConfig
    from pipeline.preprocess.array_source import ArraySource
    from pipeline.service.server import start_service

    job = json.loads(args.job_json)
    cfg = ServiceConfig.model_validate({
        "redis_url": args.redis_url, "lease_seconds": args.lease, "metrics_port": None,
        "grpc": {"port": args.port}, "jobs": [job]})
    samples = fault_samples(args.samples, args.seed, args.max_len, args.full_len)
    svc = start_service(cfg, sample_sources={job["job_id"]: ArraySource(samples)})
    print(f"READY {svc.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    svc.stop(grace=0.5)
    sys.exit(0)


if __name__ == "__main__":
    main()
