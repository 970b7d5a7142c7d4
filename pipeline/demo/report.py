"""The demo's summary, computed from the trainer ranks' own per-step logs.

Nothing here trusts the service's counters: coverage is checked from the sample ids the ranks
actually trained on.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def read_rank_logs(log_dir: Path) -> list[list[dict]]:
    logs = []
    for path in sorted(log_dir.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:])):
        logs.append([json.loads(line) for line in path.read_text().splitlines() if line])
    return logs


def summarize_run(name: str, run: dict[str, Any]) -> dict[str, Any]:
    logs = read_rank_logs(run["logs"])
    rows = [r for rank in logs for r in rank]
    ids = Counter(sid for r in rows for sid in r["sample_ids"])
    real = sum(r["real_tokens"] for r in rows)
    padded = sum(r["padded_tokens"] for r in rows)
    # Training wall time: from the first batch request of any rank to the last step's end.
    start = min(r["t"] - r["wait_s"] - r["compute_s"] for r in rows) if rows else 0.0
    end = max(r["t"] for r in rows) if rows else 0.0
    train_s = max(end - start, 1e-9)
    per_step: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in rows:
        per_step[(r["epoch"], r["step"])].append(r["padded_tokens"])
    balance = [max(v) / (sum(v) / len(v)) for v in per_step.values() if len(v) > 1]
    # Steady-state stall: the first wait is start-up (preprocessing the first buffer), which is
    # reported on its own as time to first batch.
    stall = [sum(r["wait_s"] for r in rank[1:]) / max(1e-9, sum(r["wait_s"] + r["compute_s"]
             for r in rank[1:])) for rank in logs if len(rank) > 1]
    first_batch_s = max((rank[0]["wait_s"] for rank in logs if rank), default=0.0)
    epochs = run.get("epochs", 1)
    duplicates = sum(c - epochs for c in ids.values() if c > epochs)
    expected = run["expected_samples"]
    return {
        "run": name,
        "ranks": len(logs),
        "steps": len(per_step),
        "steps_per_rank": [len(rank) for rank in logs],
        "samples": sum(ids.values()),
        "unique_samples": len(ids),
        "expected_samples": expected,
        "duplicates": duplicates,
        # Identity coverage: every sample exactly once per epoch, across all ranks.
        "coverage_exact": len(ids) == expected and all(c == epochs for c in ids.values()),
        "train_s": train_s,
        "samples_per_s": sum(ids.values()) / train_s,
        "tokens_per_s": real / train_s,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_efficiency": real / padded if padded else 0.0,
        "rank_balance_p50": float(np.percentile(balance, 50)) if balance else 1.0,
        "rank_balance_p95": float(np.percentile(balance, 95)) if balance else 1.0,
        "data_stall": float(np.mean(stall)) if stall else 0.0,
        "first_batch_s": first_batch_s,
        "quarantined": len(run["quarantined"]),
        "final_loss": float(np.mean([rank[-1]["loss"] for rank in logs if rank])) if rows else None,
        **({"batch_size": run["batch_size"]} if "batch_size" in run else {}),
    }


def build_report(runs: dict[str, dict], opts) -> dict[str, Any]:
    summaries = {name: summarize_run(name, run) for name, run in runs.items()}
    odb = summaries["odb"]
    report = {
        "ranks": opts.ranks, "token_budget": opts.token_budget, "collate": opts.collate,
        "epochs": opts.epochs, "runs": summaries,
        "coverage_ok": odb["coverage_exact"],
        "quarantine": runs["odb"]["quarantined"],
    }
    if "standard" in summaries:
        std = summaries["standard"]
        report["speedup_samples_per_s"] = odb["samples_per_s"] / max(std["samples_per_s"], 1e-9)
    return report


_ROWS = [
    ("steps", "steps", "{:d}"),
    ("steps per rank", "steps_per_rank", "{}"),
    ("samples trained", "samples", "{:d}"),
    ("samples / s", "samples_per_s", "{:.1f}"),
    ("real tokens / s", "tokens_per_s", "{:.0f}"),
    ("padding efficiency", "padding_efficiency", "{:.3f}"),
    ("rank balance p50 / p95", None, None),
    ("time to first batch (s)", "first_batch_s", "{:.1f}"),
    ("data stall after it", "data_stall", "{:.1%}"),
    ("quarantined records", "quarantined", "{:d}"),
    ("duplicated samples", "duplicates", "{:d}"),
    ("final loss", "final_loss", "{:.3f}"),
]


def format_table(report: dict[str, Any]) -> str:
    runs = report["runs"]
    names = list(runs)
    header = ["", *(("odb-pipeline" if n == "odb" else
                     f"standard (B={runs[n].get('batch_size')})") for n in names)]
    lines = []
    for label, key, fmt in _ROWS:
        cells = [label]
        for n in names:
            s = runs[n]
            if key is None:
                cells.append(f"{s['rank_balance_p50']:.3f} / {s['rank_balance_p95']:.3f}")
            else:
                cells.append(fmt.format(s[key]) if s[key] is not None else "-")
        lines.append(cells)
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]

    def fmt_row(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    out = [fmt_row(header), "  ".join("-" * w for w in widths), *map(fmt_row, lines)]
    odb = runs["odb"]
    out.append("")
    verdict = "PASS" if report["coverage_ok"] else "FAIL"
    out.append(f"identity coverage: {verdict} ({odb['unique_samples']} unique of "
               f"{odb['expected_samples']} expected, {odb['duplicates']} duplicated)")
    if "speedup_samples_per_s" in report:
        out.append(f"odb-pipeline vs standard: {report['speedup_samples_per_s']:.2f}x samples/s")
    return "\n".join(out)


def _steps_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers


def _efficiency_per_step(logs: list[list[dict]]) -> tuple[list[int], list[float]]:
    steps: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for rows in logs:
        for r in rows:
            steps[r["step"]][0] += r["real_tokens"]
            steps[r["step"]][1] += r["padded_tokens"]
    xs = sorted(steps)
    return xs, [steps[x][0] / max(1, steps[x][1]) for x in xs]


def _samples_over_time(logs: list[list[dict]]) -> tuple[list[float], list[int]]:
    rows = sorted((r for rank in logs for r in rank), key=lambda r: r["t"])
    if not rows:
        return [], []
    start = min(r["t"] - r["wait_s"] - r["compute_s"] for r in rows)
    return [r["t"] - start for r in rows], list(np.cumsum([len(r["sample_ids"]) for r in rows]))


def _label(name: str, run: dict[str, Any]) -> str:
    return "odb-pipeline" if name == "odb" else f"standard (B={run.get('batch_size')})"


def figure(runs: dict[str, dict]) -> Any:
    """The demo's plot. One row per run: tokens per step per rank, padding efficiency per step.
    With the Standard run, a last row compares the two on shared axes: samples trained over
    time and padding efficiency per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = {name: read_rank_logs(run["logs"]) for name, run in runs.items()}
    compare = "standard" in runs
    fig, axes = plt.subplots(len(runs) + compare, 2, figsize=(12, 3.6 * (len(runs) + compare)),
                             squeeze=False)
    for row, (name, run) in enumerate(runs.items()):
        label = _label(name, run)
        ax = axes[row][0]
        for rank, rows in enumerate(logs[name]):
            ax.plot([r["step"] for r in rows], [r["padded_tokens"] for r in rows], lw=1,
                    label=f"rank {rank} padded")
            ax.plot([r["step"] for r in rows], [r["real_tokens"] for r in rows], lw=1, ls="--",
                    label=f"rank {rank} real")
        ax.set_title(f"{label}: tokens per step per rank")
        ax.set_ylabel("tokens")
        _steps_axis(ax)
        ax.legend(fontsize=7)
        ax = axes[row][1]
        ax.plot(*_efficiency_per_step(logs[name]), color="tab:green")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{label}: padding efficiency per step")
        ax.set_ylabel("real / padded tokens")
        _steps_axis(ax)
    if compare:
        over_time, per_step = axes[-1]
        for name, run in runs.items():
            over_time.plot(*_samples_over_time(logs[name]), label=_label(name, run))
            per_step.plot(*_efficiency_per_step(logs[name]), label=_label(name, run))
        over_time.set_title("odb-pipeline vs standard: samples trained")
        over_time.set_xlabel("seconds since the first batch request")
        over_time.set_ylabel("samples")
        over_time.legend(fontsize=8)
        per_step.set_title("odb-pipeline vs standard: padding efficiency per step")
        per_step.set_ylim(0, 1.05)
        per_step.set_ylabel("real / padded tokens")
        _steps_axis(per_step)
        per_step.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(runs: dict[str, dict], path: Path) -> None:
    fig = figure(runs)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: dict[str, Any], runs: dict[str, dict], out_dir: Path) -> None:
    (out_dir / "summary.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "summary.txt").write_text(format_table(report) + "\n")
    plot(runs, out_dir / "demo.png")
