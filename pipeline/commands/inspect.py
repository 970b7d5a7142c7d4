"""`odb-pipeline inspect DATA`: run the real Ray preprocessing on a dataset and show the result.

Per sample: id, row, tokens, visual tokens and cost; quarantined records with their reason;
counts. `--json` prints one JSON object (`--ids` adds each sample's input_ids and labels, -100
where not trained); otherwise a table and the first sample decoded (image token runs
collapsed) with the text it trains on. Starts a private local Ray (unless one is already up)
and stops it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from pipeline.commands.cli_job import job_config, progress
from pipeline.config import JobConfig
from pipeline.errors import UserError
from pipeline.ray_runtime import PrivateRay

_TABLE_ROWS = 25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", nargs="?", default=None, metavar="DATA",
                        help="JSONL/Parquet file, folder or URI (default: the shipped sample "
                             "dataset)")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML/JSON: a service config (a job's preprocess/batching/seed are "
                             "used; see --job) or a single job mapping")
    parser.add_argument("--job", metavar="ID", help="job of the config file to take settings from")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="only the first N records (in file order)")
    parser.add_argument("--epoch", type=int, default=0, help="epoch (augmentation seed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--ids", action="store_true",
                        help="with --json: each sample's input_ids and labels too")


def _job(args: argparse.Namespace, data: str) -> JobConfig:
    # A look at the data as it lies: file order, so `--limit N` is the file's first N records
    # (`plan --data` shows the epoch's shuffled order).
    return job_config(args.config, args.job, [data], default_job_id="inspect",
                      overrides={"source": {"shuffle": False}})


def collect(job: JobConfig, epoch: int, limit: int | None) -> tuple[list, dict]:
    from pipeline.preprocess.pipeline import PreprocessStats, iter_samples

    stats = PreprocessStats()
    items = list(iter_samples(job, epoch, limit=limit, stats=stats))
    return items, stats.to_dict()


def run(args: argparse.Namespace) -> int:
    from pipeline.preprocess.sample import QuarantinedRecord
    from pipeline.preprocess.sources import expand_sources

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    if args.data is None:
        from pipeline.sample_data import sample_chats_path

        args.data = sample_chats_path()
    job = _job(args, args.data)
    expand_sources(job.source)  # missing input: fail in one line before starting Ray
    progress("inspect", "starting a private Ray (a few seconds)")
    with PrivateRay(prefix="odb-inspect-ray-"):
        progress("inspect", f"preprocessing {args.data}"
                 + (f" (first {args.limit} records)" if args.limit else ""))
        items, counts = collect(job, args.epoch, args.limit)
    samples = [i for i in items if not isinstance(i, QuarantinedRecord)]
    quarantined = [i for i in items if isinstance(i, QuarantinedRecord)]
    if args.json:
        out = {
            "samples": [{"sample_id": s.sample_id, "row": s.row, "num_tokens": s.num_tokens,
                         "num_visual_tokens": s.num_visual_tokens, "cost": s.cost,
                         **({"input_ids": s.input_ids.tolist(), "labels": s.labels.tolist()}
                            if args.ids else {})}
                        for s in samples],
            "quarantined": [{"sample_id": q.sample_id, "row": q.row, "reason": q.reason,
                             "detail": q.detail} for q in quarantined],
            "counts": counts,
        }
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    _print_table(items, counts)
    if samples:
        import numpy as np

        from pipeline.preprocess.tokenizer import load_tokenizer

        tok = load_tokenizer(job.preprocess)
        first = samples[0]
        text = tok.decode(first.input_ids.tolist(), skip_special_tokens=False)
        text = re.sub(r"(?:<\|image_pad\|>)+",
                      lambda m: f"<|image_pad|>x{m.group(0).count('<|image_pad|>')}", text)
        trained = (first.labels != -100).astype(np.int8)
        print(f"\nfirst sample {first.sample_id} decoded ({first.num_tokens} tokens, "
              f"{int(trained.sum())} trained):\n{text}\ntrained on (each run of labels):")
        # Starts and ends of the runs of trained tokens, alternating.
        edges = np.flatnonzero(np.diff(np.concatenate(([0], trained, [0]))))
        for a, b in edges.reshape(-1, 2):
            print(f"  {tok.decode(first.input_ids[a:b].tolist())!r}")
    return 0


def _print_table(items: list, counts: dict) -> None:
    from pipeline.preprocess.sample import QuarantinedRecord

    print(f"{'row':>6}  {'tokens':>7}  {'visual':>6}  {'cost':>8}  status")
    for it in items[:_TABLE_ROWS]:
        if isinstance(it, QuarantinedRecord):
            print(f"{it.row:>6}  {'-':>7}  {'-':>6}  {'-':>8}  quarantined: {it.reason}: "
                  f"{it.detail[:60]}")
        else:
            flag = " (truncated)" if it.truncated else ""
            print(f"{it.row:>6}  {it.num_tokens:>7}  {it.num_visual_tokens:>6}  {it.cost:>8}  "
                  f"ok{flag}")
    if len(items) > _TABLE_ROWS:
        print(f"   ... {len(items) - _TABLE_ROWS} more rows")
    hidden = [it for it in items[_TABLE_ROWS:] if isinstance(it, QuarantinedRecord)]
    for q in hidden:
        print(f"{q.row:>6}  {'-':>7}  {'-':>6}  {'-':>8}  quarantined: {q.reason}: "
              f"{q.detail[:60]}")
    reasons = ", ".join(f"{k}={v}" for k, v in counts["quarantined_by_reason"].items())
    print(f"\n{counts['rows']} rows: {counts['samples']} samples, {counts['quarantined']} "
          f"quarantined{f' ({reasons})' if reasons else ''}; {counts['num_tokens']} tokens, "
          f"{counts['num_visual_tokens']} visual, {counts['truncated']} truncated")
