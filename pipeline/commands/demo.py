"""`odb-pipeline demo`: embedded Redis, local Ray, the service and N real trainer ranks.

Ctrl-C or SIGTERM at any moment ends it non-zero with nothing it started left running
(`pipeline.demo.ctrl_c`); its Redis and Ray run in sessions of their own, so a signal to the
demo's process group reaches the demo, which stops them in order.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from pipeline.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks (gloo DDP), default 2")
    parser.add_argument("--data", action="append", metavar="FILE",
                        help="JSONL/Parquet chats (default: the shipped sample dataset)")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--max-window-samples", type=int, default=128,
                        help="planner window cap in samples (small: the first step comes sooner)")
    parser.add_argument("--collate", choices=["padded", "packed"], default="padded")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--standard", action="store_true",
                        help="also run fixed-size batches (B by p99 length) side by side")
    parser.add_argument("--redis-url", help="use this Redis instead of an embedded one")
    parser.add_argument("--out", default="demo-out", help="directory for logs, summary, plot")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from pipeline.demo.ctrl_c import CtrlC
    from pipeline.demo.report import format_table
    from pipeline.demo.run_demo import DemoOptions, run_demo
    from pipeline.sample_data import sample_chats_path

    if args.ranks < 1:
        raise UserError(f"--ranks must be >= 1, got {args.ranks}")
    if args.token_budget <= 0:
        raise UserError(f"--token-budget must be > 0, got {args.token_budget}")
    data = args.data or [sample_chats_path()]
    for path in data:
        if not Path(path).exists():
            raise UserError(f"data file not found: {path}")
    out_dir = Path(args.out).resolve()
    with CtrlC() as ctrl_c:
        report = run_demo(DemoOptions(
            data=data, out_dir=out_dir, ranks=args.ranks, token_budget=args.token_budget,
            max_window_samples=args.max_window_samples, collate=args.collate,
            epochs=args.epochs, seed=args.seed, standard=args.standard,
            redis_url=args.redis_url,
        ), ctrl_c)
        if args.json:
            print(json.dumps(report, indent=2, default=str))
        else:
            print(format_table(report))
            print(f"\nsummary: {out_dir / 'summary.txt'}\nplot:    {out_dir / 'demo.png'}")
        sys.stdout.flush()
    # Everything the demo started is stopped: from here a Ctrl-C or SIGTERM ends the process
    # by the signal itself (exit status 130 or 143 from the shell), never as a run that
    # succeeded.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not report["coverage_ok"]:
        print("demo: identity coverage check FAILED", file=sys.stderr)
        return 1
    return 0
