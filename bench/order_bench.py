"""Order benchmark: how good the epoch's shuffle is, what it costs, and what the planner's window
does to a mixture's shares (docs/data-order.md takes its figures from here).

Part `quality` (pure, no data read): a source of N rows sorted by a feature (the row index:
think sorted by date, length or source), one order per (read unit, block) size. For windows of
w consecutive positions (a step, the planner's window, 1% of the epoch) the standard deviation of
the window's mean feature, divided by that of a uniform permutation: 1.0 is a perfect shuffle,
large is clumped. Also the rank correlation of sample positions between epochs 0 and 1, the
raw bytes one block holds (the shuffle's buffer) and the reads an epoch makes per row.

Part `shares` (the real planner, synthetic lengths): two sources interleaved at their shares by
the order, fed to `StepPlanner`; per tenth of the epoch the worst deviation of a source's share
of the samples, per window of 10 steps the worst deviation of its share of the loss tokens,
and padding efficiency against the GMT oracle. What the window does to shares before any
control, and with the planner's share control (`pipeline/planner/source_shares.py`).

Run:  .venv/bin/python bench/order_bench.py [--quick] [--parts quality,shares]
Writes order_bench{,_quick}.json (`--out bench/results/order` for the committed figures) and
prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_dir import add_out_argument, out_dir  # noqa: E402

from pipeline.order.epoch_order import EpochOrder, OrderSettings, Segment  # noqa: E402
from pipeline.order.read_units import make_layout  # noqa: E402
from pipeline.planner.oracle import gmt_batches  # noqa: E402
from pipeline.planner.policy import BatchingPolicy  # noqa: E402
from pipeline.planner.step_planner import StepPlanner  # noqa: E402
from pipeline.planner.types import MeasuredSample, Step  # noqa: E402
from pipeline.preprocess.sources import SourceFile  # noqa: E402

ROW_BYTES = 1000  # a chat's JSONL line, about


def _layout(name: str, rows: int, unit: int, files: int = 1):
    per = [rows // files + (f < rows % files) for f in range(files)]
    fs = [SourceFile(f"{name}/{f}.jsonl", f"{name}/{f}.jsonl", "jsonl") for f in range(files)]
    units = [[(r, min(unit, n - r), ROW_BYTES * min(unit, n - r)) for r in range(0, n, unit)]
             for n in per]
    return make_layout(name, fs, units)


def _positions(order: EpochOrder) -> tuple[np.ndarray, np.ndarray, int]:
    """(the global row index at each position, the source at each position, reads): fast,
    with numpy, block by block (the order's own `placements` builds an object per row)."""
    offsets = [np.concatenate(([0], np.cumsum([int(lay.rows[lay.file == f].sum())
                                               for f in range(len(lay.files))])))
               for lay in order.layouts]
    rows_out, src_out, reads = [], [], 0
    for block in order.blocks():
        per_part = []
        for part in block.parts:
            reads += len({p.unit for p in part.pieces})
            rows = np.concatenate([offsets[part.source][p.file] + p.first_row
                                   + np.arange(p.num_rows) for p in part.pieces])
            per_part.append(rows[part.take])
        at = {part.source: k for k, part in enumerate(block.parts)}
        merge = block.merge[:len(block)]
        out = np.empty(len(merge), dtype=np.int64)
        for s, k in at.items():
            out[merge == s] = per_part[k][:int((merge == s).sum())]
        rows_out.append(out)
        src_out.append(merge)
    return np.concatenate(rows_out), np.concatenate(src_out), reads


def _window_ratio(feature: np.ndarray, w: int) -> float:
    """std of windows' mean feature / the same for a uniform permutation."""
    n = len(feature) // w * w
    if n < 2 * w:
        return float("nan")
    means = feature[:n].reshape(-1, w).mean(axis=1)
    ideal = math.sqrt(feature.var() / w * (1 - w / len(feature)))
    return float(means.std() / ideal) if ideal else float("nan")


def quality(quick: bool) -> list[dict]:
    n = 200_000 if quick else 1_000_000
    units = (64, 256, 1024, 4096)
    blocks = (4096, 16384, 65536, 262144)
    out = []
    for u in units:
        lay = _layout("s", n, u)
        for b in blocks:
            settings = OrderSettings(block_rows=b, block_bytes=1 << 40)
            t0 = time.perf_counter()
            e0 = EpochOrder(0, 0, [lay], [Segment(0, (n,))], settings)
            rows0, _, reads = _positions(e0)
            build_s = time.perf_counter() - t0
            rows1, _, _ = _positions(EpochOrder(0, 1, [lay], [Segment(0, (n,))], settings))
            feature = rows0 / n
            pos0 = np.empty(n)
            pos0[rows0] = np.arange(n)
            pos1 = np.empty(n)
            pos1[rows1] = np.arange(n)
            out.append({
                "unit_rows": u, "block_rows": b, "rows": n,
                "window_ratio_256": round(_window_ratio(feature, 256), 3),
                "window_ratio_4096": round(_window_ratio(feature, 4096), 3),
                "window_ratio_1pct": round(_window_ratio(feature, n // 100), 3),
                "rank_corr_epochs": round(float(np.corrcoef(pos0, pos1)[0, 1]), 4),
                "block_mb": round(b * ROW_BYTES / 2**20, 1),
                "reads_per_1k_rows": round(1000 * reads / n, 2),
                "order_seconds_per_1m_rows": round(build_s * 1e6 / n, 2),
            })
            print(out[-1], flush=True)
    return out


def _lengths(rng, n: int, mean: float, cv: float, budget: int) -> np.ndarray:
    s = math.sqrt(math.log(1 + cv * cv))
    return np.clip(rng.lognormal(math.log(mean) - s * s / 2, s, n).astype(int), 16, budget)


def _shares_case(name, n_a, n_b, mean_a, mean_b, cv_a, cv_b, budget, world, seed=0, *,
                 control: str | None = None, global_budget: int | None = None) -> dict:
    rng = np.random.default_rng(seed)
    lens = [_lengths(rng, n_a, mean_a, cv_a, budget), _lengths(rng, n_b, mean_b, cv_b, budget)]
    loss = [np.maximum(1, (x * rng.uniform(0.2, 0.8, len(x))).astype(int)) for x in lens]
    order = EpochOrder(seed, 0, [_layout("a", n_a, 64), _layout("b", n_b, 64)],
                       [Segment(0, (n_a, n_b))])
    rows, src, _ = _positions(order)
    samples = [MeasuredSample(f"{s}:{r}", int(lens[s][r]), 0, int(loss[s][r]), int(s))
               for s, r in zip(src.tolist(), rows.tolist(), strict=True)]  # rows: per source
    policy = BatchingPolicy(token_budget=budget, global_token_budget=global_budget)
    planner = StepPlanner(policy, world)
    if control is not None:  # the planner's source shares (mix_by)
        planner.set_source_targets([n_a, n_b], control)
    events = planner.feed_many(samples) + planner.end_epoch(last_epoch=True)
    steps = [e for e in events if isinstance(e, Step)]
    seq = np.array([s.source for st in steps for b in st.batches for s in b.samples])
    target = n_b / (n_a + n_b)
    tenth = max(abs(float((seq[len(seq) * t // 10: len(seq) * (t + 1) // 10] == 1).mean())
                    - target) for t in range(10))
    tok = np.array([[sum(s.loss_tokens for b in st.batches for s in b.samples if s.source == i)
                     for i in (0, 1)] for st in steps], dtype=float)
    share_tok = tok[:, 1].sum() / tok.sum()
    win = np.array([abs(w[1] / w.sum() - share_tok) for w in
                    (tok[i:i + 10].sum(axis=0) for i in range(len(steps) - 9))])
    real = sum(s.num_tokens for st in steps for b in st.batches for s in b.samples)
    padded = sum(len(b.samples) * max(s.num_tokens for s in b.samples)
                 for st in steps for b in st.batches)
    gmt = gmt_batches([s.num_tokens for s in samples], budget)
    bal = [max(b.cost for b in st.batches) / np.mean([b.cost for b in st.batches])
           for st in steps if len({b.rank for b in st.batches}) == world]
    return {"case": name, "control": control or "off",
            "global_token_budget": global_budget, "samples": n_a + n_b,
            "means": [mean_a, mean_b], "cv": [cv_a, cv_b],
            "token_budget": budget, "world_size": world, "steps": len(steps),
            "rank_balance_p50": round(float(np.median(bal)), 4),
            "tenth_share_dev_max": round(tenth, 3),
            "window10_loss_share_dev_max": round(float(win.max()), 3),
            "window10_loss_share_dev_p95": round(float(np.quantile(win, 0.95)), 3),
            "padding_eff": round(real / padded, 4),
            "gmt_padding_eff": round(sum(map(sum, gmt)) / sum(len(b) * max(b) for b in gmt), 4)}


def shares(quick: bool) -> list[dict]:
    k = 1 if quick else 4
    cases = [
        ("issue: W=2, budget 1024, alike", 3000 * k, 3000 * k, 250, 250, 0.6, 0.8, 1024, 2),
        ("W=2, budget 1024, b longer", 3000 * k, 3000 * k, 150, 400, 0.6, 0.8, 1024, 2),
        ("W=8, budget 16384, alike", 10000 * k, 10000 * k, 700, 700, 0.6, 0.8, 16384, 8),
        ("W=2, budget 16384, b 5x longer", 10000 * k, 10000 * k, 300, 1500, 0.6, 0.8, 16384, 2),
    ]
    out = []
    for c in cases:
        for control in (None, "samples", "loss_tokens"):
            out.append(_shares_case(*c, control=control))
            print(out[-1], flush=True)
        budget = c[7]
        for control in (None, "samples", "loss_tokens"):  # global steps of 8 budgets
            out.append(_shares_case(*c, control=control, global_budget=8 * budget))
            print(out[-1], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="quality,shares")
    add_out_argument(ap, "order")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    path = out_dir(args, "order") / f"order_bench{'_quick' if args.quick else ''}.json"
    # a run of some parts keeps the others' last figures
    result: dict = json.loads(path.read_text()) if path.exists() else {}
    result.update({"machine": platform.node(), "cpus": os.cpu_count(), "quick": args.quick})
    if "quality" in parts:
        result["quality"] = quality(args.quick)
    if "shares" in parts:
        result["shares"] = shares(args.quick)
    path.write_text(json.dumps(result, indent=1) + "\n")
    for part in ("quality", "shares"):
        rows = result.get(part) if part in parts else None
        if rows:
            keys = list(rows[0])
            print(f"\n| {' | '.join(keys)} |\n|{'---|' * len(keys)}")
            for r in rows:
                print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
