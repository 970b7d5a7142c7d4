"""Planner benchmark: ODB planning quality and speed against baselines, side by side.

Workloads: three synthetic log-normal length distributions shaped like the ODB paper's data
(CV 0.29 mean 700; CV 0.48 mean 1400; CV 1.00 mean 1000), clipped to [16, 8192]; token budget
16384, padded collate. Methods:

- standard: fixed batch size B = budget // p99(length), input order (what a plain DataLoader does);
- GMT oracle: the whole epoch sorted by length, cut greedily longest-first (offline bound);
- BMT oracle: whole epoch in geometric length buckets (8% wide), fixed size per bucket;
- peer: `online-dynamic-batching` 0.1.2 (`odb`), its single-process grouping path
  (`odb.grouping.grouping_data` with no process group, driven the way `odb.collate` drives it:
  warm-up ramp of the buffer, overflow recycling, one output slot per fetched index);
- ours: `pipeline.planner.StepPlanner` at world size 1 and 8 (join mode).

Run:  .venv/bin/python bench/planner_bench.py [--quick]
Writes bench/results/planner/planner_bench{,_quick}.json and .png, prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.planner.plan_report import PlanReport  # noqa: E402
from pipeline.planner.policy import BatchingPolicy  # noqa: E402
from pipeline.planner.step_planner import StepPlanner  # noqa: E402
from pipeline.planner.types import MeasuredSample  # noqa: E402

BUDGET = 16384
WORKLOADS = [
    ("cv0.29_mean700", 0.29, 700),
    ("cv0.48_mean1400", 0.48, 1400),
    ("cv1.00_mean1000", 1.0, 1000),
]
OUT_DIR = ROOT / "bench" / "results" / "planner"
# CPU time of this (single-threaded) process: planning throughput on one core, robust to other
# jobs sharing the machine (wall-clock figures swung 2x with the dev machine's load).
_clock = time.process_time


def workload(cv: float, mean: float, n: int, seed: int) -> np.ndarray:
    sigma2 = math.log(1 + cv * cv)
    mu = math.log(mean) - sigma2 / 2
    x = np.random.default_rng(seed).lognormal(mu, math.sqrt(sigma2), n)
    return np.clip(np.rint(x), 16, 8192).astype(np.int64)


def batch_stats(batches: list[list[int]], elapsed: float, n_in: int, world: int = 1) -> dict:
    real = sum(sum(b) for b in batches)
    padded = sum(len(b) * max(b) for b in batches)
    emitted = sum(len(b) for b in batches)
    return {
        "world_size": world,
        "batches": len(batches),
        "steps": math.ceil(len(batches) / world),
        "padding_efficiency": real / padded if padded else 1.0,
        "budget_fill": real / (len(batches) * BUDGET) if batches else 0.0,
        "budget_violations": sum(len(b) * max(b) > BUDGET for b in batches),
        "dropped_samples": n_in - emitted,
        "rank_balance_p50": None,
        "rank_balance_p95": None,
        "samples_per_s": n_in / elapsed if elapsed > 0 else None,
    }


def standard(lengths: list[int]) -> tuple[list[list[int]], float]:
    t = _clock()
    p99 = int(np.percentile(lengths, 99))
    bs = max(1, BUDGET // p99)
    out = [lengths[i : i + bs] for i in range(0, len(lengths), bs)]
    return out, _clock() - t


def gmt(lengths: list[int]) -> tuple[list[list[int]], float]:
    t = _clock()
    s = sorted(lengths, reverse=True)
    out, i = [], 0
    while i < len(s):
        k = max(1, BUDGET // s[i])
        out.append(s[i : i + k])
        i += k
    return out, _clock() - t


def bmt(lengths: list[int], width: float = 1.08) -> tuple[list[list[int]], float]:
    t = _clock()
    buckets: dict[int, list[int]] = {}
    for n in lengths:
        buckets.setdefault(int(math.log(n) / math.log(width)), []).append(n)
    out = []
    for key in sorted(buckets, reverse=True):
        upper = math.ceil(width ** (key + 1))
        k = max(1, BUDGET // upper)
        items = buckets[key]
        out.extend(items[i : i + k] for i in range(0, len(items), k))
    return out, _clock() - t


def peer(lengths: list[int], buffer_size: int) -> tuple[list[list[int]], float] | None:
    """Drive odb 0.1.2's single-process grouping exactly as odb.collate.collate_loop_odb does."""
    try:
        import torch
        from odb.grouping import grouping_data
    except ImportError:
        return None
    # Real tensors so odb measures lengths with its own get_input_length (uint8: cheap).
    items = [{"input_ids": torch.empty(n, dtype=torch.uint8), "_len": n} for n in lengths]
    t = _clock()
    out: list[list[int]] = []
    idx_buffer: list[int] = []
    data_buffer: list[list[dict]] = []
    counter = 0.0  # odb's warm-up: the grouping threshold ramps from 0 to buffer_size

    def collate_once(is_finished: bool) -> None:
        grouped, overflow, _, skip = grouping_data(
            data_buffer,
            BUDGET,
            None,
            is_finished=is_finished,
            idx_budget=len(idx_buffer),
            max_groups=buffer_size,
        )
        data_buffer.clear()
        data_buffer.extend([[s] for s in overflow])
        if skip:
            return
        # One output slot per fetched index; groups beyond the slots are not emitted (odb).
        for g in grouped[: len(idx_buffer)]:
            out.append([s["_len"] for s in g])
        idx_buffer.clear()

    for i, item in enumerate(items):
        idx_buffer.append(i)
        data_buffer.append([item])
        if len(idx_buffer) >= int(buffer_size * counter):
            collate_once(False)
            counter = min(1.0, counter + 0.05)
    if idx_buffer:
        collate_once(False)
    collate_once(True)  # odb: no index slots left at the very end -> leftovers are not emitted
    return out, _clock() - t


def ours(lengths: list[int], world: int, buffer_size: int, repeats: int) -> dict:
    policy = BatchingPolicy(BUDGET, buffer_size=buffer_size)
    samples = [MeasuredSample(i, n) for i, n in enumerate(lengths)]
    best = math.inf
    for _ in range(repeats):
        planner = StepPlanner(policy, world, "join", seed=0)
        t = _clock()
        events = planner.feed_many(samples)
        events.extend(planner.end_epoch())
        best = min(best, _clock() - t)
    rep = PlanReport(policy, world)
    rep.samples_in = len(samples)
    for e in events:
        rep.observe(e)
    d = rep.to_dict()
    return {
        "world_size": world,
        "batches": d["batches"],
        "steps": d["steps"],
        "padding_efficiency": d["padding_efficiency"],
        "budget_fill": d["budget_fill"],
        "budget_violations": d["budget_violations"],
        "dropped_samples": len(samples) - d["emitted_samples"],
        "rank_balance_p50": d["rank_balance_p50"] if world > 1 else None,
        "rank_balance_p95": d["rank_balance_p95"] if world > 1 else None,
        "samples_per_s": len(samples) / best,
    }


def run(n: int, buffer_size: int, peer_buffers: list[int], repeats: int) -> dict:
    results: dict = {}
    for name, cv, mean in WORKLOADS:
        lengths = workload(cv, mean, n, seed=12345).tolist()
        rows: dict[str, dict] = {}
        b, dt = standard(lengths)
        rows["standard (B by p99)"] = batch_stats(b, dt, n)
        b, dt = gmt(lengths)
        rows["GMT oracle"] = batch_stats(b, dt, n)
        b, dt = bmt(lengths)
        rows["BMT oracle"] = batch_stats(b, dt, n)
        for pb in peer_buffers:
            got = peer(lengths, pb)
            if got is not None:
                rows[f"peer odb 0.1.2 (buf {pb})"] = batch_stats(got[0], got[1], n)
        rows[f"ours W=1 (buf {buffer_size})"] = ours(lengths, 1, buffer_size, repeats)
        rows[f"ours W=8 (buf {buffer_size})"] = ours(lengths, 8, buffer_size, repeats)
        rows[f"ours W=8 (buf {buffer_size // 2})"] = ours(lengths, 8, buffer_size // 2, repeats)
        g = rows["GMT oracle"]["batches"]
        for r in rows.values():
            r["batches_vs_gmt"] = r["batches"] / g
            # What training time follows: steps against the oracle's steps at the same W.
            r["steps_vs_gmt"] = r["steps"] / math.ceil(g / r["world_size"])
        results[name] = {"cv": cv, "mean": mean, "n": n, "rows": rows}
        print(f"  {name}: done", file=sys.stderr)
    return results


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict) -> str:
    head = (
        "| workload | method | batches | steps | steps vs GMT | pad eff | budget fill | violations "
        "| dropped | balance p50/p95 | samples/s |"
    )
    lines = [head, "|" + "---|" * 11]
    for name, w in results.items():
        for method, r in w["rows"].items():
            bal = (
                "-"
                if r["rank_balance_p50"] is None
                else f"{r['rank_balance_p50']:.3f} / {r['rank_balance_p95']:.3f}"
            )
            lines.append(
                f"| {name} | {method} | {r['batches']} | {r['steps']} | {r['steps_vs_gmt']:.3f} "
                f"| {r['padding_efficiency']:.4f} | {r['budget_fill']:.3f} "
                f"| {r['budget_violations']} | {r['dropped_samples']} | {bal} "
                f"| {fmt(r['samples_per_s'], ',.0f')} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    methods = list(next(iter(results.values()))["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    width = 0.8 / len(methods)
    limits = [(0.85, 1.0), (0.95, 1.3)]
    keys = ["padding_efficiency", "steps_vs_gmt"]
    titles = [
        "padding efficiency (higher is better)",
        "steps / GMT oracle steps at the same W (lower is better)",
    ]
    for ax, key, (lo, hi), title in zip(axes, keys, limits, titles, strict=True):
        for i, m in enumerate(methods):
            xs = [j + i * width for j in range(len(names))]
            vals = [results[n]["rows"][m][key] for n in names]
            ax.bar(xs, [min(max(v, lo), hi) for v in vals], width, label=m)
            for x, v in zip(xs, vals, strict=True):
                if v < lo or v > hi:  # off-scale bars (standard batching) get their value
                    ax.text(
                        x,
                        hi if v > hi else lo,
                        f"{v:.2f}",
                        rotation=90,
                        fontsize=7,
                        ha="center",
                        va="top" if v > hi else "bottom",
                    )
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
        ax.set_ylim(lo, hi)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[1].axhline(1.03, color="k", lw=0.8, ls="--")
    axes[0].axhline(0.98, color="k", lw=0.8, ls="--")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"planner: token budget {BUDGET}, padded collate")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4000 samples per workload, 1 repeat")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--buffer-size", type=int, default=2048)
    args = ap.parse_args(argv)
    n = args.samples or (4000 if args.quick else 20000)
    repeats = 1 if args.quick else 5
    peer_buffers = [256, args.buffer_size]
    t0 = time.perf_counter()
    results = run(n, args.buffer_size, peer_buffers, repeats)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stem = "planner_bench_quick" if args.quick else "planner_bench"
    meta = {
        "command": "bench/planner_bench.py" + (" --quick" if args.quick else ""),
        "token_budget": BUDGET,
        "samples_per_workload": n,
        "buffer_size": args.buffer_size,
        "throughput": f"planning only, CPU time of one core (process_time), best of {repeats}",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    (OUT_DIR / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, OUT_DIR / f"{stem}.png")
    print(table(results))
    print(f"\nwrote {OUT_DIR / (stem + '.json')} and .png ({meta['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
