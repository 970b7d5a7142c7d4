"""`odb-pipeline status`: the operator's queries, answered from the service and Redis.

    odb-pipeline status --endpoint svc:50051 --metrics-endpoint svc:9464 --job sft-1
    odb-pipeline status --redis-url redis://redis:6379/0 --json
    odb-pipeline status --metrics-endpoint svc:9464 --watch 5 --quarantine

`--json` prints one object: {"generated_at", "sources", "jobs": [job...]} where a job has
job_id, state, mode, world_size, published_through, done, error, samples_in, ranks[] (rank,
delivered_step, acked_step, lag_steps, connected, stalled, lapsed, heartbeat_age_s, client_id,
*_emitted), totals, throughput, padding_efficiency, budget_utilisation, quarantine (total,
by_reason, records), planner_buffer_samples, payload_cache_samples, source_backlog_samples,
epoch_ends and, with --redis-url, redis. With --watch, one such object per line per refresh.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pipeline.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", metavar="HOST:PORT", help="the service's gRPC address")
    parser.add_argument("--metrics-endpoint", metavar="HOST:PORT",
                        help="the service's metrics port (throughput, padding, quarantine "
                        "records, buffers; /status.json)")
    parser.add_argument("--redis-url", metavar="URL", help="the coordinator's Redis")
    parser.add_argument("--job", action="append", metavar="ID",
                        help="only this job (repeatable); default: every job the sources list")
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument("--token", help="bearer token for GetJob (prefer --token-env)")
    tok.add_argument("--token-env", metavar="VAR", help="environment variable holding the token")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quarantine", action="store_true", help="list quarantined records")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                        help="refresh every SECONDS (default 2); throughput over the interval")
    parser.add_argument("--count", type=int, metavar="N",
                        help="with --watch: stop after N refreshes (default: until Ctrl-C)")


def token_from_args(args: argparse.Namespace) -> str | None:
    """The bearer token of `--token` / `--token-env` (also used by `scale`)."""
    if args.token_env:
        value = os.environ.get(args.token_env)
        if not value:
            raise UserError(f"--token-env: environment variable {args.token_env} is unset or "
                            "empty")
        return value
    return args.token


def run(args: argparse.Namespace) -> int:
    from pipeline.observability import status_format
    from pipeline.observability.status_query import Sources, add_interval_rates, collect

    if args.watch is not None and args.watch <= 0:
        raise UserError(f"--watch must be > 0 seconds, got {args.watch}")
    if args.count is not None and args.count < 1:
        raise UserError(f"--count must be >= 1, got {args.count}")
    src = Sources(endpoint=args.endpoint, metrics=args.metrics_endpoint,
                  redis_url=args.redis_url, token=token_from_args(args), jobs=args.job or [])
    try:
        before = None
        n = 0
        while True:
            status = collect(src)
            add_interval_rates(status, before)
            if not args.quarantine:
                for job in status["jobs"]:
                    (job.get("quarantine") or {}).pop("records", None)
            if args.json:
                print(json.dumps(status, default=str))
            else:
                if args.watch is not None and sys.stdout.isatty():
                    print("\033[2J\033[H", end="")  # clear the screen between refreshes
                elif n:
                    print()
                print(status_format.render(status, show_records=args.quarantine))
            sys.stdout.flush()
            n += 1
            if args.watch is None or (args.count is not None and n >= args.count):
                return 0
            before = status
            time.sleep(args.watch)
    finally:
        src.close()
