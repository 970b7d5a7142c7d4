"""Preprocessing throughput: Ray Data pipeline vs one plain process vs multiprocessing.Pool(2).

    .venv/bin/python bench/preprocess_bench.py [--quick] [--n N]

Same data, same `Processor` code, same chunking, side by side in one run, each contender twice:
"cold" pays its own start-up (processes importing transformers, loading the tokenizer), "warm"
runs the same epoch again on the already started workers (what every later epoch of a
long-running service gets; a new Ray Data actor pool is created per dataset, so actors are only
ever cold). Ray runs on an already started local Ray (2 CPUs, worker niceness 0).
CPU per sample counts the processes a contender runs on (plain: this process; Pool: + its
workers; Ray: + its workers, daemons and actors) and is also given against the plain loop and
the Pool of the same warm round, with the median over the rounds.
TOKENIZERS_PARALLELISM=false everywhere, so one process = one core of tokenizer work.
Writes preprocess_bench.{json,png} (`_text` suffix with
--image-frac 0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from results_dir import add_out_argument, out_dir

from pipeline.config import TrainingJobConfig
from pipeline.preprocess.sample import ProcessedSample

CHUNK_ROWS = 256


def tree_cpu() -> dict[int, float]:
    """CPU seconds (user+sys) of this process and each live descendant: Pool workers, and the
    local Ray cluster (gcs, raylet, workers) that ray.init started under this process. Load on
    the shared machine stretches wall time but not CPU per sample: the fair overhead measure."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(fields[1])
        cpu[int(d)] = (int(fields[11]) + int(fields[12])) / tick
    me = os.getpid()
    out = {}
    for pid, c in cpu.items():
        p = pid
        while p > 1 and p != me:
            p = parent.get(p, 0)
        if p == me:
            out[pid] = c
    return out


def _role(pid: int) -> str:
    """What a process of the tree is: this driver, a Pool worker, a Ray worker (task or actor:
    the Processor's work), one of Ray's own daemons and actors, or other."""
    if pid == os.getpid():
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "multiprocessing.spawn" in cmd:
        return "pool workers"
    if cmd.startswith(("ray::IDLE", "ray::MapBatches", "ray::MapWorker")):
        return "ray workers"
    return "ray daemons" if "ray" in cmd else "other"


# The processes each contender runs on: the others' idle processes are not its cost.
ROLES = {"plain": ("driver",), "pool": ("driver", "pool workers"),
         "ray": ("driver", "ray workers", "ray daemons")}


def cpu_since(before: dict[int, float], roles: tuple[str, ...]) -> dict[str, float]:
    """CPU used since `before` by the live processes of `roles`, by role (processes that
    exited meanwhile are lost)."""
    out = dict.fromkeys(roles, 0.0)
    for pid, c in tree_cpu().items():
        role = _role(pid)
        if role in out:
            out[role] += c - before.get(pid, 0.0)
    return out


class Meter:
    def __init__(self) -> None:
        self.cpu0 = tree_cpu()
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.n = self.samples = self.tokens = 0

    def add(self, item) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.n += 1
        if isinstance(item, ProcessedSample):
            self.samples += 1
            self.tokens += item.num_tokens

    def result(self, name: str, phase: str, contender: str) -> dict:
        wall = time.perf_counter() - self.t0
        by_role = cpu_since(self.cpu0, ROLES[contender])  # exited actors are not counted
        cpu = sum(by_role.values())
        per_sample = 1000 / max(1, self.samples)
        return {
            "cpu_s": round(cpu, 2),
            "cpu_ms_per_sample": round(per_sample * cpu, 2),
            "cpu_ms_per_sample_by_role": {k: round(per_sample * v, 3)
                                          for k, v in by_role.items()},
            "name": name, "phase": phase, "items": self.n, "samples": self.samples,
            "tokens": self.tokens, "wall_s": round(wall, 3),
            "first_item_s": round((self.t_first or self.t0) - self.t0, 3),
            "samples_per_s": round(self.samples / wall, 1),
            "tokens_per_s": round(self.tokens / wall),
        }


def _chunks(job: TrainingJobConfig):
    from pipeline.preprocess.sources import expand_sources, plan_chunks

    return plan_chunks(expand_sources(job.source), CHUNK_ROWS)


def _plain_pass(proc, job: TrainingJobConfig, phase: str, m: Meter | None = None) -> dict:
    from pipeline.preprocess.sources import read_chunk

    m = m or Meter()
    for c in _chunks(job):
        for it in proc.process(c.file, read_chunk(c)):
            m.add(it)
    return m.result("plain (1 process)", phase, "plain")


_worker_proc = None


def _init(job_json: str) -> None:
    global _worker_proc
    from pipeline.preprocess.process import Processor

    _worker_proc = Processor(TrainingJobConfig.model_validate_json(job_json), 0)


def _work(chunk):
    from pipeline.preprocess.sources import read_chunk

    return _worker_proc.process(chunk.file, read_chunk(chunk))


def _pool_pass(pool, job: TrainingJobConfig, phase: str, m: Meter | None = None) -> dict:
    m = m or Meter()
    for items in pool.imap(_work, _chunks(job), chunksize=1):
        for it in items:
            m.add(it)
    return m.result("multiprocessing.Pool(2)", phase, "pool")


def _ray_pass(job: TrainingJobConfig, compute: str, phase: str) -> dict:
    from pipeline.preprocess.pipeline import iter_samples

    m = Meter()
    for it in iter_samples(job, 0, chunk_rows=CHUNK_ROWS, compute=compute, concurrency=2):
        m.add(it)
    return m.result(f"Ray Data, {'task' if compute == 'tasks' else 'actor'} pool", phase, "ray")


def run_all(job: TrainingJobConfig, rounds: int, tmp: Path) -> list[dict]:
    """Cold runs once each; then `rounds` interleaved warm rounds (plain, Pool, Ray), so the
    shared machine's load swings hit every contender alike; best warm round is reported."""
    import ray

    results = []
    m = Meter()  # cold plain run: importing transformers and building the Processor count
    from pipeline.preprocess.process import Processor

    proc = Processor(job, 0)
    results.append(_plain_pass(proc, job, "cold", m))
    # spawn: fresh workers that import and load everything themselves, like Ray's workers.
    ctx = mp.get_context("spawn")
    with ctx.Pool(2, initializer=_init, initargs=(job.model_dump_json(),)) as pool:
        results.append(_pool_pass(pool, job, "cold", Meter()))
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp / "ray"),
                 log_to_driver=False, configure_logging=False,
                 object_store_memory=512 * 1024 * 1024)
        try:
            results.append(_ray_pass(job, "tasks", "cold"))
            warm: dict[str, list[dict]] = {}
            for _ in range(rounds):
                plain, two = _plain_pass(proc, job, "warm"), _pool_pass(pool, job, "warm")
                for r in (plain, two, _ray_pass(job, "tasks", "warm")):
                    # Against the same round's plain loop and Pool (two processes at once, as
                    # Ray's two workers): this machine's speed drifts between rounds.
                    r["cpu_vs_plain"] = round(r["cpu_s"] / plain["cpu_s"], 3)
                    r["cpu_vs_pool2"] = round(r["cpu_s"] / two["cpu_s"], 3)
                    warm.setdefault(r["name"], []).append(r)
            # Actors are new for every dataset (epoch), so they are only ever cold. Last: their
            # workers push the idle task workers over Ray's soft limit and Ray kills those.
            results.append(_ray_pass(job, "actors", "cold"))
        finally:
            ray.shutdown()
    for runs in warm.values():
        best = max(runs, key=lambda r: r["samples_per_s"])
        best["phase"] = f"warm, best of {len(runs)}"
        best["all_samples_per_s"] = [r["samples_per_s"] for r in runs]
        best["all_cpu_ms_per_sample"] = [r["cpu_ms_per_sample"] for r in runs]
        best["all_cpu_vs_plain"] = [r["cpu_vs_plain"] for r in runs]
        best["median_cpu_vs_plain"] = statistics.median(best["all_cpu_vs_plain"])
        best["all_cpu_vs_pool2"] = [r["cpu_vs_pool2"] for r in runs]
        best["median_cpu_vs_pool2"] = statistics.median(best["all_cpu_vs_pool2"])
        results.append(best)
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cx) = plt.subplots(1, 2, figsize=(15, 4.5), width_ratios=(3, 2))
    names = [f"{r['name']} [{r['phase']}]" for r in results]
    vals = [r["samples_per_s"] for r in results]
    colors = ["#4a7" if r["phase"].startswith("warm") else "#999" for r in results]
    bars = ax.barh(names, vals, color=colors)
    ax.bar_label(bars, fmt="%.0f")
    ax.set_xlabel("samples/s (end to end; cold = incl. worker start-up)")
    ax.invert_yaxis()
    ax.set_title("odb-pipeline preprocessing on a 2-core machine (same Processor code)")
    paired = [r for r in results if "all_cpu_vs_plain" in r and not r["name"].startswith("plain")]
    for r, color in zip(paired, ("#58c", "#c63"), strict=False):
        ratios = r["all_cpu_vs_plain"]
        cx.plot(range(1, len(ratios) + 1), ratios, "o-", color=color,
                label=f"{r['name']} (median {r['median_cpu_vs_plain']:.2f}x)")
    cx.axhline(1.1, ls="--", color="k", lw=0.8, label="target 1.1x")
    cx.axhline(1.0, color="#999", lw=0.8)
    cx.set_xticks(range(1, len(paired[0]["all_cpu_vs_plain"]) + 1))
    cx.set_xlabel("warm round")
    cx.set_ylabel("CPU per sample / the same round's plain loop")
    cx.set_title("CPU against the plain loop, paired by round")
    cx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="1500 records and 2 warm rounds instead of 4000 and 5")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--image-frac", type=float, default=0.15)
    ap.add_argument("--rounds", type=int, default=None, help="warm rounds (default 5, quick 2)")
    add_out_argument(ap, "preprocess")
    args = ap.parse_args()
    n = args.n or (1500 if args.quick else 4000)
    args.rounds = args.rounds or (2 if args.quick else 5)

    from pipeline.sample_data.generate import generate, write_jsonl

    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="odb-prep-bench-"))
    try:
        data = tmp / "chats.jsonl"
        from pipeline.sample_data import IMAGES_DIR

        prefix = os.path.relpath(IMAGES_DIR, tmp)
        write_jsonl(data, generate(n, seed=1, image_frac=args.image_frac, image_prefix=prefix),
                    [])
        job = TrainingJobConfig(job_id="bench", world_size=1, source={"paths": [str(data)]})
        results = run_all(job, args.rounds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = {(r["name"], r["phase"]): r["samples_per_s"] for r in results}
    for r in results:
        r["vs_plain"] = round(r["samples_per_s"] / base[("plain (1 process)", r["phase"])], 2)
        r["vs_pool2"] = round(r["samples_per_s"] / base[("multiprocessing.Pool(2)", r["phase"])],
                              2)
    out_path = out_dir(args, "preprocess")
    meta = {"records": n, "image_frac": args.image_frac, "chunk_rows": CHUNK_ROWS,
            "warm_rounds": args.rounds, "loadavg_start": load0,
            "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(),
            "python": sys.version.split()[0], "platform": platform.platform(),
            "command": " ".join(["python", "bench/preprocess_bench.py", *sys.argv[1:]])}
    stem = "preprocess_bench" + ("_text" if args.image_frac == 0 else "")
    (out_path / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    plot(results, out_path / f"{stem}.png")
    print(f"{n} records, {results[0]['samples']} samples, {results[0]['tokens']} tokens; "
          f"1-min load avg {load0[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print("| contender | run | wall s | first item s | samples/s | tokens/s | vs plain | "
          "vs Pool(2) | CPU ms/sample |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['phase']} | {r['wall_s']} | {r['first_item_s']} | "
              f"{r['samples_per_s']} | {r['tokens_per_s']} | {r['vs_plain']}x | "
              f"{r['vs_pool2']}x | {r['cpu_ms_per_sample']} |")
    print("\nwarm rounds, CPU against the same round's plain loop and Pool(2) (medians), and "
          "the best round's CPU ms/sample by process:")
    for r in results:
        if "all_cpu_vs_plain" in r:
            print(f"  {r['name']}: vs plain {r['all_cpu_vs_plain']} (median "
                  f"{r['median_cpu_vs_plain']}x), vs Pool(2) {r['all_cpu_vs_pool2']} (median "
                  f"{r['median_cpu_vs_pool2']}x); {r['cpu_ms_per_sample_by_role']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
