"""The figure of docs/elastic.md's "An elastic run that trains like a fixed one": the loss per
optimizer step of the fixed W=2 run and of the elastic 2 -> 1 -> 2 run, and how far apart they
are, from the `losses.json` that tests/elastic/test_torchrun_example.py writes into its
temporary directory.

    .venv/bin/python -m pytest -n0 tests/elastic/test_torchrun_example.py --basetemp=/tmp/el
    .venv/bin/python bench/elastic_loss_plot.py /tmp/el [--out docs/images]

(A directory is searched for its newest losses.json.) Writes elastic-losses.png into `--out`
(the committed figure: `--out docs/images`; default: the cache dir, as every benchmark). The
losses do not depend on the machine's speed or load: the figure can be made on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from results_dir import add_out_argument, out_dir  # noqa: E402

NAME = "elastic_loss"
FIGURE = "elastic-losses.png"
# Where a relative difference of exactly 0 is drawn on the log scale.
EQUAL = 1e-18


def find(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.rglob("losses.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no losses.json under {path}: run the test with --basetemp={path}")
    return found[-1]


def plot(data: dict, out: Path, tolerance: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = dict(data["fixed"])
    first_w1, first_w2 = data["switches"]
    phases = [("W=2", "tab:blue", lambda e: e["step"] < first_w1),
              ("W=1 (a node lost)", "tab:red", lambda e: first_w1 <= e["step"] < first_w2),
              ("W=2 (the node back)", "tab:green", lambda e: e["step"] >= first_w2)]
    runs = Counter(e["opt"] for e in data["elastic"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    opts = sorted(fixed)
    top.plot(opts, [fixed[o] for o in opts], color="black", lw=1.2, label="fixed W=2")
    for label, color, member in phases:
        pts = [e for e in data["elastic"] if member(e)]
        top.scatter([e["opt"] for e in pts], [e["loss"] for e in pts], s=22, color=color,
                    label=f"elastic, {label}", zorder=3)
        bottom.scatter([e["opt"] for e in pts],
                       [max(abs(e["loss"] - fixed[e["opt"]]) / fixed[e["opt"]], EQUAL)
                        for e in pts], s=22, color=color, zorder=3)
    for opt in sorted(o for o, n in runs.items() if n > 1):
        top.axvline(opt, color="gray", ls=":", lw=0.8)
        bottom.axvline(opt, color="gray", ls=":", lw=0.8)
    top.set_ylabel("loss (mean over the step's loss tokens)")
    top.set_title("The same job, uninterrupted at W=2 and elastic 2 -> 1 -> 2 "
                  "(torchrun, DCP resharding)\ndotted: optimizer steps run twice (after a "
                  "switch, from the last checkpoint)", fontsize=10)
    top.legend(fontsize=8)
    bottom.axhline(tolerance, color="tab:red", ls="--", lw=1, label=f"test bound {tolerance:g}")
    bottom.set_yscale("log")
    bottom.set_ylim(EQUAL / 3, 1e-10)
    bottom.set_ylabel(f"|elastic - fixed| / fixed\n(equal: drawn at {EQUAL:g})")
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}: {len(opts)} optimizer steps, {len(data['elastic'])} elastic losses, "
          f"largest relative difference {data['max_relative_difference']:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("losses", type=Path, help="losses.json, or a directory holding one")
    add_out_argument(p, NAME)
    p.add_argument("--tolerance", type=float, default=1e-12, help="the test's LOSS_RTOL")
    args = p.parse_args()
    plot(json.loads(find(args.losses).read_text()), out_dir(args, NAME) / FIGURE,
         args.tolerance)


if __name__ == "__main__":
    main()
