"""A killable replica serving a job of real 1024 x 1024 pictures, for the chunked failover test
(run by it, not collected):

    python vlm_replica.py --redis-url URL --job-json '{...}' --repeat N

Preprocesses the job's records for real (`vlm_data.preprocess`), serves `repeat` samples of
them over the shared Redis with `start_service` on a free port, prints `READY <port>` and serves
until killed. Every replica of a job builds the same samples.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", required=True)
    p.add_argument("--job-json", required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--chunk-kb", type=int, default=1024)
    args = p.parse_args()

    from vlm_data import preprocess, repeated

    from pipeline.config import ServiceConfig
    from pipeline.preprocess.array_source import ArraySource
    from pipeline.service.server import start_service

    job = json.loads(args.job_json)
    cfg = ServiceConfig.model_validate({
        "redis_url": args.redis_url, "lease_seconds": 3.0, "metrics_port": None,
        "grpc": {"port": 0, "chunk_kb": args.chunk_kb}, "jobs": [job]})
    samples = repeated(preprocess(job), args.repeat)
    svc = start_service(cfg, sample_sources={job["job_id"]: ArraySource(samples)})
    print(f"READY {svc.port}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
