"""`odb-pipeline status`: the operator's queries, answered from the service and Redis.

    odb-pipeline status                      # the local service `serve` / `demo` started
    odb-pipeline status --config odb.yaml --watch
    odb-pipeline status --endpoint svc:50051 --metrics-endpoint svc:9464 --job sft-1
    odb-pipeline status --redis-url redis://redis:6379/0 --json
    odb-pipeline status --metrics-endpoint svc:9464 --watch 5 --quarantine

`--json` prints one object: {"generated_at", "sources", "jobs": [job...]}, each job a
`JobStatus` (`pipeline/observability/job_status.py`: job_id, state, mode, open, world_size,
published_through, done, error, samples_in, ranks[] (rank, acked_step, lag_steps, stalled,
lapsed, heartbeat_age_s, client_id, *_emitted, replica: connected, delivered_step), totals,
throughput, padding_efficiency, budget_utilisation, quarantine (total, by_reason, records),
worlds, epoch_ends; a refill job's `refill` (waiting, in_flight, completed, readmitted,
consumers, lease_lapses, rates, by_epoch); with Redis `redis`, and for an SDO job `exposure`);
fields a source does not know are null. With --watch, one such object per line per refresh,
rates over the interval. Without an address flag, the local service is found as `serve`
configures itself (--config, the ODB_* environment, defaults; see `pipeline.status.sources`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pipeline.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeline.status import sources

    sources.add_arguments(parser)
    parser.add_argument("--job", action="append", metavar="ID",
                        help="only this job (repeatable); default: every job the sources list")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quarantine", action="store_true", help="list quarantined records")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                        help="refresh every SECONDS (default 2); throughput over the interval")
    parser.add_argument("--count", type=int, metavar="N",
                        help="with --watch: stop after N refreshes (default: until Ctrl-C)")


def run(args: argparse.Namespace) -> int:
    from pipeline.status import sources, text
    from pipeline.status.query import collect

    if args.watch is not None and args.watch <= 0:
        raise UserError(f"--watch must be > 0 seconds, got {args.watch}")
    if args.count is not None and args.count < 1:
        raise UserError(f"--count must be >= 1, got {args.count}")
    src = sources.resolve(args)
    try:
        before = None
        n = 0
        while True:
            report = collect(src).shown(before, records=args.quarantine)
            if args.json:
                print(json.dumps(report.to_dict(), default=str))
            else:
                if args.watch is not None and sys.stdout.isatty():
                    print("\033[2J\033[H", end="")  # clear the screen between refreshes
                elif n:
                    print()
                print(text.render(report, show_records=args.quarantine))
            sys.stdout.flush()
            n += 1
            if args.watch is None or (args.count is not None and n >= args.count):
                return 0
            before = report
            time.sleep(args.watch)
    finally:
        src.close()

