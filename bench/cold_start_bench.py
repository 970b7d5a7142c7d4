"""Cold start: `odb-pipeline serve` launch to the first batch at a rank, and a new epoch's first
batch after the previous END.

    .venv/bin/python bench/cold_start_bench.py [--quick] [--repeats N]

Each repeat launches a real `serve` process (embedded Redis in a fresh state dir, private local
Ray, the README's kind of config) on generated chats, and 2 rank streams in this process (its
imports done beforehand, as a trainer's are when it asks for its first batch) that open as soon
as the server prints that it listens. Measured from the launch: the server listening, the first
batch at any rank and at every rank; then, per rank, the gap between the END of epoch 0 and the
first batch of epoch 1. Writes cold_start_bench{,_quick}.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from results_dir import add_out_argument, out_dir  # noqa: E402

from pipeline.sample_data.generate import generate  # noqa: E402
from trainer_client import BatchStream  # noqa: E402

WORLD = 2


def _config(tmp: Path, rows: int) -> Path:
    data = tmp / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n"
                            for r in generate(rows, 3, mean_tokens=120, image_frac=0.0)))
    cfg = {"grpc": {"host": "127.0.0.1", "port": 0}, "ray": {"num_cpus": 2},
           "state_dir": str(tmp / "state"), "metrics_port": None,
           "jobs": [{"job_id": "cold", "world_size": WORLD, "epochs": 2,
                     "source": {"paths": [str(data)]}, "preprocess": {"max_seq_len": 1024},
                     "batching": {"token_budget": 4096}}]}
    path = tmp / "odb.json"
    path.write_text(json.dumps(cfg))
    return path


def one_run(rows: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="odb-cold-") as d:
        path = _config(Path(d), rows)
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--config",
                                 str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        listening = threading.Event()
        port: list[str] = []
        log: list[str] = []

        def read() -> None:
            for line in proc.stdout:
                log.append(line)
                if "listening on" in line and not listening.is_set():
                    port.append(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
                    listening.set()

        threading.Thread(target=read, daemon=True).start()
        first: dict[int, float] = {}
        gaps: dict[int, float] = {}
        errors: list[str] = []

        def rank(r: int) -> None:
            try:
                with BatchStream(f"127.0.0.1:{port[0]}", "cold", r, WORLD,
                                 tensors="numpy") as s:
                    ended = None
                    while not s.done:
                        for _ in s:
                            now = time.monotonic()
                            first.setdefault(r, now)
                            if ended is not None and r not in gaps:
                                gaps[r] = now - ended
                        ended = time.monotonic()
            except Exception as exc:  # reported with the server's log
                errors.append(f"rank {r}: {exc!r}")

        try:
            if not listening.wait(120):
                raise RuntimeError("serve did not listen:\n" + "".join(log[-30:]))
            t_listen = time.monotonic()
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            if errors or len(first) < WORLD:
                raise RuntimeError(f"{errors}\n" + "".join(log[-30:]))
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        return {"listening_s": t_listen - t0,
                "first_batch_any_rank_s": min(first.values()) - t0,
                "first_batch_every_rank_s": max(first.values()) - t0,
                "epoch1_first_batch_after_end_s": [gaps[r] for r in sorted(gaps)]}


def _plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    keys = [("listening_s", "serve listening"), ("first_batch_any_rank_s", "first batch, any rank"),
            ("first_batch_every_rank_s", "first batch, every rank")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (k, label) in enumerate(keys):
        a.scatter([i] * len(runs), [r[k] for r in runs], label=label)
    a.axhline(5.0, color="red", linestyle="--", label="target 5 s")
    a.set_xticks(range(len(keys)), [lbl for _, lbl in keys], fontsize=8)
    a.set_ylabel("seconds after `serve` launch")
    a.legend(fontsize=7)
    gaps = [g for r in runs for g in r["epoch1_first_batch_after_end_s"]]
    b.scatter(range(len(gaps)), gaps)
    b.axhline(1.0, color="red", linestyle="--", label="target 1 s")
    b.set_xlabel("rank x repeat")
    b.set_ylabel("epoch 1's first batch after END (s)")
    b.legend(fontsize=7)
    fig.suptitle("Cold start (" + result["command"] + ")", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, a smaller dataset")
    ap.add_argument("--repeats", type=int, default=None, help="launches (default 5, quick 1)")
    add_out_argument(ap, "cold_start")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)
    rows = 1500 if args.quick else 3000
    runs = []
    for i in range(repeats):
        runs.append(one_run(rows))
        r = runs[-1]
        print(f"[{i + 1}/{repeats}] listening {r['listening_s']:.2f} s, first batch "
              f"{r['first_batch_any_rank_s']:.2f} s (every rank "
              f"{r['first_batch_every_rank_s']:.2f} s), epoch 1 after END "
              f"{max(r['epoch1_first_batch_after_end_s']):.3f} s", flush=True)
    med = {k: statistics.median(r[k] for r in runs)
           for k in ("listening_s", "first_batch_any_rank_s", "first_batch_every_rank_s")}
    med["epoch1_first_batch_after_end_s"] = statistics.median(
        g for r in runs for g in r["epoch1_first_batch_after_end_s"])
    result = {"command": "python bench/cold_start_bench.py" + (" --quick" if args.quick else ""),
              "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_avg_at_end": os.getloadavg()[0]},
              "rows": rows, "world_size": WORLD, "runs": runs, "median": med}
    out_path = out_dir(args, "cold_start")
    stem = "cold_start_bench_quick" if args.quick else "cold_start_bench"
    (out_path / f"{stem}.json").write_text(json.dumps(result, indent=2))
    _plot(result, out_path / f"{stem}.png")
    print(json.dumps(med, indent=2))


if __name__ == "__main__":
    main()
