"""`odb-pipeline plan`: dry-run the batching core on a lengths file.

Prints a summary (or one JSON object with --json) of the plan the service would make: steps,
padding efficiency, budget violations, over-budget handling, per-rank steps, rank balance,
carry-over. `--emit-plan OUT.jsonl` writes the plan itself, one step per line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from pipeline.errors import UserError

HELP = "dry-run batching on a dataset or a lengths file (steps, padding efficiency, balance)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths",
        required=True,
        metavar="FILE",
        help="one integer token count per line (sample id = 0-based line number), or JSONL "
        "objects with sample_id, num_tokens and optional num_visual_tokens",
    )
    parser.add_argument("--world-size", type=int, required=True, metavar="W", help="ranks")
    parser.add_argument(
        "--token-budget", type=int, required=True, metavar="T", help="max token cost per batch"
    )
    parser.add_argument("--mode", choices=["join", "quota"], default="join", help="DGAP mode")
    parser.add_argument(
        "--buffer-size", type=int, default=2048, metavar="N", help="online window (samples)"
    )
    parser.add_argument("--collate", choices=["padded", "packed"], default="padded")
    parser.add_argument(
        "--over-budget",
        choices=["truncate", "alone", "quarantine"],
        default="alone",
        help="what to do with a sample that cannot fit a batch on its own",
    )
    parser.add_argument(
        "--max-visual-tokens", type=int, default=None, metavar="V", help="cap per batch"
    )
    parser.add_argument(
        "--attn-a",
        type=float,
        default=1.0,
        help="compute model a*L + b*L^2 per sample (balances ranks; default a=1, b=0: tokens)",
    )
    parser.add_argument("--attn-b", type=float, default=0.0, help="see --attn-a")
    parser.add_argument(
        "--pool-steps",
        type=int,
        default=None,
        metavar="P",
        help="steps' worth of batches pooled for rank balancing (default: ~256 batches)",
    )
    parser.add_argument("--epochs", type=int, default=1, metavar="E")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    parser.add_argument(
        "--shuffle",
        action="store_true",
        help="shuffle the input order each epoch with (seed, epoch) (default: file order)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--emit-plan", metavar="OUT.jsonl", help="write one JSON line per step")


def _check(args: argparse.Namespace) -> None:
    if args.world_size < 1:
        raise UserError(f"--world-size must be >= 1, got {args.world_size}")
    if args.token_budget <= 0:
        raise UserError(f"--token-budget must be > 0, got {args.token_budget}")
    if args.buffer_size < 1:
        raise UserError(f"--buffer-size must be >= 1, got {args.buffer_size}")
    if args.epochs < 1:
        raise UserError(f"--epochs must be >= 1, got {args.epochs}")
    if args.pool_steps is not None and args.pool_steps < 1:
        raise UserError(f"--pool-steps must be >= 1, got {args.pool_steps}")
    if args.max_visual_tokens is not None and args.max_visual_tokens <= 0:
        raise UserError(f"--max-visual-tokens must be > 0, got {args.max_visual_tokens}")


def run(args: argparse.Namespace) -> int:
    from pipeline.planner.lengths_file import LengthsFileError, read_lengths
    from pipeline.planner.plan_report import PlanReport
    from pipeline.planner.policy import BatchingPolicy
    from pipeline.planner.step_planner import StepPlanner
    from pipeline.planner.types import Quarantined, Step

    _check(args)
    try:
        policy = BatchingPolicy(
            token_budget=args.token_budget,
            collate=args.collate,
            attn_a=args.attn_a,
            attn_b=args.attn_b,
            max_visual_tokens=args.max_visual_tokens,
            buffer_size=args.buffer_size,
            over_budget=args.over_budget,
        )
        planner = StepPlanner(policy, args.world_size, args.mode, args.seed, args.pool_steps)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        samples = read_lengths(args.lengths)
    except LengthsFileError as exc:
        raise UserError(str(exc)) from None

    out = None
    if args.emit_plan:
        try:
            out = open(args.emit_plan, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        except OSError as exc:
            raise UserError(f"cannot write --emit-plan {args.emit_plan}: {exc.strerror}") from None
    report = PlanReport(policy, args.world_size)
    quarantine_lines: list[str] = []
    t0 = time.perf_counter()
    try:
        for epoch in range(args.epochs):
            order = samples
            if args.shuffle:
                order = list(samples)
                random.Random(f"odb-plan-shuffle:{args.seed}:{epoch}").shuffle(order)
            report.samples_in += len(order)
            events = planner.feed_many(order)
            events.extend(planner.end_epoch())
            for ev in events:
                report.observe(ev)
                if out is not None and isinstance(ev, Step):
                    out.write(_step_json(ev) + "\n")
                elif isinstance(ev, Quarantined) and len(quarantine_lines) < 20:
                    quarantine_lines.append(f"  {ev.sample.sample_id}: {ev.reason}")
    finally:
        if out is not None:
            out.close()
    elapsed = time.perf_counter() - t0

    result = report.to_dict()
    result["mode"] = args.mode
    result["world_size"] = args.world_size
    result["token_budget"] = args.token_budget
    result["buffer_size"] = args.buffer_size
    result["collate"] = args.collate
    result["planning_seconds"] = round(elapsed, 4)
    result["samples_per_second"] = round(report.samples_in / elapsed) if elapsed > 0 else None
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(
            f"plan: {args.lengths}  W={args.world_size}  budget={args.token_budget}"
            f"  mode={args.mode}  collate={args.collate}  buffer={args.buffer_size}"
        )
        print(report.summary_text())
        if quarantine_lines:
            print("quarantined samples (first 20):")
            print("\n".join(quarantine_lines))
        print(f"planned in {elapsed:.3f} s ({result['samples_per_second']} samples/s)")
    return 0


def _step_json(step) -> str:
    return json.dumps(
        {
            "epoch": step.epoch,
            "step": step.step,
            "batches": [
                {
                    "rank": b.rank,
                    "samples": list(b.sample_ids),
                    "cost": b.cost,
                    **({"over_budget": True} if b.over_budget else {}),
                    **(
                        {"truncated_to": {str(k): v for k, v in b.truncated_to.items()}}
                        if b.truncated_to
                        else {}
                    ),
                }
                for b in step.batches
            ],
        },
        separators=(",", ":"),
    )
