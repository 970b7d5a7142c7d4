"""Coordinator benchmark: what Redis costs per rank per step, and W ranks x S steps served by
real `serve` replicas on one Redis.

    .venv/bin/python bench/coordinator_bench.py [--quick] [--ranks W] [--steps S] [--replicas P]

Every run starts its own private redis-server (never the shared one on :6379).
1. latency: one rank of a W-rank job stepping the way a replica serves it: read its batch of a
   step (`get_step_for`, one HMGET) and acknowledge it (`ack_many`, one EVALSHA), over steps
   the fenced producer API published. p50/p99, round trips counted at the socket, Redis
   commands per rank-step (INFO commandstats). Again with AOF `appendfsync always`.
2. memory: Redis memory per retained step at W ranks (8 samples per batch).
3. served: P real replica processes (`start_service`, one producer per job by its lease) serve
   a W-rank job of S steps of one tiny sample per batch to W `BatchStream`s (threads in P
   consumer processes, each process talking to its own replica). Wall time to the last END,
   rank-steps/s, Redis commands per step, peak Redis memory, steps retained after trimming.
Writes coordinator_bench{,_quick}.json and .png, prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis.connection

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replica_procs import Replica, StartLine, array_job, consume_threads  # noqa: E402
from results_dir import add_out_argument, out_dir  # noqa: E402

from pipeline.coordinator import RedisJobState  # noqa: E402
from pipeline.jobstate import PlannerCheckpoint, Publication, RankAck  # noqa: E402
from pipeline.planner.types import Batch, MeasuredSample, Step, StepInfo, WorldStamp  # noqa: E402
from pipeline.redis_client import connect  # noqa: E402
from pipeline.redis_server import LocalRedis  # noqa: E402

SAMPLES_PER_BATCH = 8  # e.g. 16k token budget, ~2k-token samples
LEASE_S = 30.0
_TEMPLATES: dict[int, tuple[Batch, ...]] = {}


def make_step(n: int, world_size: int) -> Step:
    """A realistic-size step: 8 samples per rank, ids like "shard-07:1234567" (batches built
    once per world size; Redis stores every step's bytes separately all the same)."""
    if world_size not in _TEMPLATES:
        batches = []
        for r in range(world_size):
            base = r * SAMPLES_PER_BATCH
            ss = tuple(MeasuredSample(f"shard-{(base + i) % 64:02d}:{1_000_000 + base + i}",
                                      1500 + (base + i) % 900) for i in range(SAMPLES_PER_BATCH))
            batches.append(Batch(r, ss, cost=SAMPLES_PER_BATCH * max(s.num_tokens for s in ss)))
        _TEMPLATES[world_size] = tuple(batches)
    batches = _TEMPLATES[world_size]
    return Step(0, n, batches, StepInfo(world_size * SAMPLES_PER_BATCH,
                                        sum(b.num_tokens for b in batches)),
                WorldStamp(0, world_size))


def _publish(st: RedisJobState, gen: int, first: int, last: int, world_size: int) -> None:
    steps = tuple(make_step(n, world_size) for n in range(first, last))
    cp = PlannerCheckpoint(epoch=0, samples_consumed=last * world_size * SAMPLES_PER_BATCH,
                           next_step=last)
    st.publish(Publication(checkpoint=cp, steps=steps), fence=gen)


class RoundTrips:
    """Counts client->Redis sends in this process: one per command, one per pipeline."""

    n = 0

    @classmethod
    def install(cls) -> None:
        orig = redis.connection.AbstractConnection.send_packed_command

        def counted(self, command, check_health=True):  # type: ignore[no-untyped-def]
            cls.n += 1
            return orig(self, command, check_health)

        redis.connection.AbstractConnection.send_packed_command = counted


def commandstats(client) -> dict[str, dict]:
    return {k.removeprefix("cmdstat_"): v for k, v in client.info("commandstats").items()}


def calls_delta(before: dict, after: dict) -> dict[str, int]:
    out = {k: v["calls"] - before.get(k, {}).get("calls", 0) for k, v in after.items()}
    out.pop("info", None)
    return {k: v for k, v in out.items() if v}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# ----------------------------------------------------------------------------- 1. latency
def bench_latency(url: str, steps: int, world_size: int, label: str) -> dict:
    st = RedisJobState(url, f"lat-{label}", config_hash="b", world_size=world_size)
    gen = st.claim_producer("bench", 600)
    st.claim_rank(0, "rank0", LEASE_S)
    others = [(r, -1) for r in range(1, world_size)]
    fetch, ack = [], []
    round_trips, delta, usec = 0, {}, {"evalsha": 0, "hmget": 0}
    chunk = 50
    for first in range(0, steps, chunk):
        last = min(steps, first + chunk)
        _publish(st, gen, first, last, world_size)  # untimed
        # Every other rank is already through these steps: rank 0's acks also trim.
        st.grant([(0, r, last - 1) for r in range(world_size)])
        st.ack_many([RankAck(r, f"rank{r}", last - 1) for r, _ in others], LEASE_S)
        before, rt0 = commandstats(st.client), RoundTrips.n
        for n in range(first, last):
            t0 = time.perf_counter()
            view = st.get_step_for(n, [0])
            t1 = time.perf_counter()
            assert st.ack_many([RankAck(0, "rank0", n)], LEASE_S) == [None]
            t2 = time.perf_counter()
            assert view is not None and view.batch_for(0) is not None
            fetch.append(t1 - t0)
            ack.append(t2 - t1)
        round_trips += RoundTrips.n - rt0
        after = commandstats(st.client)
        for k, v in calls_delta(before, after).items():
            delta[k] = delta.get(k, 0) + v
        for cmd in usec:
            usec[cmd] += (after.get(cmd, {}).get("usec", 0)
                          - before.get(cmd, {}).get("usec", 0))
    ms = 1000.0
    both = [a + b for a, b in zip(fetch, ack, strict=True)]
    return {
        "label": label, "steps": steps, "world_size": world_size,
        "fetch_p50_ms": statistics.median(fetch) * ms, "fetch_p99_ms": pct(fetch, 99) * ms,
        "ack_p50_ms": statistics.median(ack) * ms, "ack_p99_ms": pct(ack, 99) * ms,
        "step_p50_ms": statistics.median(both) * ms, "step_p99_ms": pct(both, 99) * ms,
        "round_trips_per_rank_step": round_trips / steps,
        "redis_commands_per_rank_step": sum(delta.values()) / steps,
        "commandstats_delta": delta,
        # Server-side time: what Redis itself spends, without client, loopback and scheduler.
        "redis_usec_per_ack": usec["evalsha"] / steps,
        "redis_usec_per_hmget": usec["hmget"] / max(1, delta.get("hmget", 0)),
        "_samples": {"fetch": fetch, "ack": ack, "step": both},
    }


# ------------------------------------------------------------------------------ 2. memory
def bench_memory(url: str, world_size: int, steps: int) -> dict:
    client = connect(url)
    st = RedisJobState(client, "mem", config_hash="b", world_size=world_size)
    gen = st.claim_producer("bench", 600)
    m0 = client.info("memory")["used_memory"]
    for n in range(steps):
        _publish(st, gen, n, n + 1, world_size)
    m1 = client.info("memory")["used_memory"]
    return {"world_size": world_size, "steps": steps,
            "bytes_per_retained_step": (m1 - m0) / steps,
            "bytes_per_rank_batch": (m1 - m0) / steps / world_size}


# ------------------------------------------------------------------------------ 3. served
def bench_served(url: str, world_size: int, steps: int, replicas: int, log) -> dict:
    client = connect(url)
    job = array_job(f"served-{world_size}x{steps}", world_size, 32)  # one sample per batch
    job["batching"]["max_window_samples"] = 4096
    reps = [Replica(url, job, steps, 31, lease_seconds=LEASE_S, rank_timeout_seconds=600.0)
            for _ in range(replicas)]
    ctx = mp.get_context("spawn")
    parts = [list(range(world_size))[i::replicas] for i in range(replicas)]
    line, q = StartLine(ctx, len(parts)), ctx.Queue()
    procs = [ctx.Process(target=consume_threads, args=(reps[i].address, job["job_id"], p,
                                                       world_size, line, q))
             for i, p in enumerate(parts)]
    for p in procs:
        p.start()
    line.wait_ready()  # consumer processes import grpc and torch
    mem0 = client.info("memory")["used_memory"]
    cmd0 = commandstats(client)
    cpu0 = [r.cpu() for r in reps]
    t0 = time.perf_counter()
    line.go()
    peak, outs = mem0, []
    while len(outs) < len(procs):
        try:
            outs.append(q.get(timeout=0.5))
        except Exception:  # queue.Empty: sample Redis memory meanwhile
            peak = max(peak, client.info("memory")["used_memory"])
    wall = time.perf_counter() - t0
    cpu = [r.cpu() - c for r, c in zip(reps, cpu0, strict=True)]
    cmd = calls_delta(cmd0, commandstats(client))
    for p in procs:
        p.join(30)
    for r in reps:
        r.stop()
    st = RedisJobState.attach(client, job["job_id"])
    batches = sum(o["batches"] for o in outs)
    errors = [e for o in outs for e in o["errors"]]
    planned = st.published_through() + 1
    log(f"  {batches} batches of {planned} steps x {world_size} ranks in {wall:.1f} s"
        + (f"; errors: {errors[:3]}" if errors else ""))
    return {
        "world_size": world_size, "steps": planned, "replicas": replicas, "wall_s": wall,
        "batches": batches, "complete": batches == planned * world_size and not errors,
        "rank_steps_per_s": batches / wall,
        "replica_cpu_s": cpu,
        "redis_commands_per_step": sum(cmd.values()) / max(1, planned),
        "redis_commands_per_rank_step": sum(cmd.values()) / max(1, batches),
        "commandstats_delta": cmd,
        "peak_used_memory_delta_mb": (peak - mem0) / 2**20,
        "retained_steps_after": st.published_through() - st.trimmed_through(),
        "errors": errors[:5],
    }


# ----------------------------------------------------------------------------- report
def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for lat in results["latency"]:
        for key, style in (("fetch", ":"), ("ack", "--"), ("step", "-")):
            xs = sorted(x * 1000 for x in lat["_samples"][key])
            ax.plot(xs, [i / len(xs) for i in range(len(xs))], style,
                    label=f"{key} ({lat['label']})")
    ax.set_xscale("log")
    ax.set_xlabel("latency per rank-step call (ms, loopback)")
    ax.set_ylabel("CDF")
    ax.set_title("one rank: fetch (HMGET) + ack (EVALSHA)")
    ax.legend(fontsize=7)
    ax = axes[1]
    s = results["served"]
    ax.bar(["rank-steps/s"], [s["rank_steps_per_s"]], color="#3a7")
    ax.set_title(f"{s['world_size']} ranks x {s['steps']} steps, {s['replicas']} replicas: "
                 f"{s['wall_s']:.1f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def strip(obj):
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="W=256 x 50 steps; fewer latency steps")
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--replicas", type=int, default=4)
    add_out_argument(ap, "coordinator")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    W = args.ranks or (256 if args.quick else 1024)
    S = args.steps or (50 if args.quick else 200)
    lat_steps = 300 if args.quick else 1000
    log = lambda m: print(m, flush=True)  # noqa: E731
    results: dict = {"latency": []}
    RoundTrips.install()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(data_dir=tmp) as server:
        log(f"latency at W={W} ...")
        results["latency"].append(bench_latency(server.url, lat_steps, W, "no-AOF"))
        results["memory"] = bench_memory(server.url, W, 10 if args.quick else 20)
        connect(server.url).flushall()
        log(f"{W} ranks x {S} steps on {args.replicas} real replicas ...")
        results["served"] = bench_served(server.url, W, S, args.replicas, log)
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(data_dir=tmp, appendonly=True) as srv:
        connect(srv.url).config_set("appendfsync", "always")
        results["latency"].append(bench_latency(srv.url, lat_steps // 2, W, "AOF always"))
    meta = {"command": "bench/coordinator_bench.py" + (" --quick" if args.quick else ""),
            "python": platform.python_version(), "cpus": mp.cpu_count(),
            "loadavg_1m_at_start": load, "loadavg_1m_at_end": os.getloadavg()[0],
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out_path = out_dir(args, "coordinator")
    stem = "coordinator_bench_quick" if args.quick else "coordinator_bench"
    (out_path / f"{stem}.json").write_text(json.dumps({"meta": meta, **strip(results)},
                                                     indent=1))
    plot(results, out_path / f"{stem}.png")

    print(f"\n`{meta['command']}` ({meta['cpus']} CPUs, {meta['utc']}, load avg "
          f"{load:.1f} -> {meta['loadavg_1m_at_end']:.1f})\n")
    print("| per rank-step (loopback) | fetch p50/p99 ms | ack p50/p99 ms | step p50/p99 ms | "
          "round trips | Redis cmds | Redis-side us per ack / HMGET |")
    print("|---|---|---|---|---|---|---|")
    for lat in results["latency"]:
        print(f"| W={lat['world_size']}, {lat['label']} | {lat['fetch_p50_ms']:.3f} / "
              f"{lat['fetch_p99_ms']:.3f} | {lat['ack_p50_ms']:.3f} / {lat['ack_p99_ms']:.3f} | "
              f"{lat['step_p50_ms']:.3f} / {lat['step_p99_ms']:.3f} | "
              f"{lat['round_trips_per_rank_step']:.2f} | "
              f"{lat['redis_commands_per_rank_step']:.1f} | {lat['redis_usec_per_ack']:.1f} / "
              f"{lat['redis_usec_per_hmget']:.1f} |")
    s = results["served"]
    print("\n| served | wall s | rank-steps/s | Redis cmds/step | cmds per rank-step | "
          "peak Redis MB | retained steps | complete |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {s['world_size']} ranks x {s['steps']} steps, {s['replicas']} replicas | "
          f"{s['wall_s']:.1f} | {s['rank_steps_per_s']:.0f} | "
          f"{s['redis_commands_per_step']:.0f} | {s['redis_commands_per_rank_step']:.2f} | "
          f"{s['peak_used_memory_delta_mb']:.1f} | {s['retained_steps_after']} | "
          f"{s['complete']} |")
    m = results["memory"]
    print(f"\nRedis memory per retained step (W={m['world_size']}, {SAMPLES_PER_BATCH} samples "
          f"per batch): {m['bytes_per_retained_step'] / 1024:.1f} KiB "
          f"({m['bytes_per_rank_batch']:.0f} B per rank-batch)")


if __name__ == "__main__":
    main()
