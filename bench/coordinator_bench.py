"""Coordinator benchmark: Redis cost per rank per step, and 1024 ranks x 200 steps on one Redis.

Every run starts its own private redis-server (never the shared one on :6379).

1. latency: one rank stepping through steps of a W=1024 job on loopback, the way a server replica
   serves it: fetch its batch (one HMGET) and ack + heartbeat (one EVALSHA). p50/p99 per call and
   per step, round trips and Redis commands per rank-step from INFO commandstats. Repeated with
   AOF `appendfsync always` (the setting docs/redis-schema.md recommends for production).
2. simulation: one planner process publishes steps (4 per script call, with its checkpoint, at
   most 16 steps ahead of the slowest rank) while P replica processes serve W ranks between them.
   Per step a replica fetches its ranks' batches in one HMGET and acks + heartbeats them in one
   pipelined round trip (a replica serving 256 ranks batches its own Redis calls: honest
   pipelining, no cross-replica batching). Wall time, Redis commands per step (INFO
   commandstats delta), Redis memory per retained step (INFO memory delta), trimming.
3. per-rank variant: the same but every rank does its own two round trips, no pipelining
   (what W independent servers would cost Redis), on fewer steps.

Run:  .venv/bin/python bench/coordinator_bench.py [--quick]
Writes bench/results/coordinator/coordinator_bench{,_quick}.json and .png, prints Markdown.
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

from pipeline.service.job_state import PlannerCheckpoint  # noqa: E402

from pipeline.coordinator import RedisJobState  # noqa: E402
from pipeline.coordinator.step_codec import encode_step  # noqa: E402
from pipeline.planner.types import Batch, MeasuredSample, Step, StepInfo  # noqa: E402
from pipeline.redis_client import connect  # noqa: E402
from pipeline.redis_server import LocalRedis  # noqa: E402

OUT_DIR = ROOT / "bench" / "results" / "coordinator"
SAMPLES_PER_BATCH = 8  # e.g. 16k token budget, ~2k-token samples
LEASE_S = 30.0
HISTORY = 16  # steps kept after every rank acked them (the simulation shows trimming)


_TEMPLATES: dict[int, tuple[Batch, ...]] = {}


def make_step(n: int, world_size: int) -> Step:
    """A realistic-size step: 8 samples per rank, ids like "shard-07:1234567". The batches are
    built once per world size and reused (building 8k objects per step would dominate the run;
    Redis stores every step's bytes separately all the same)."""
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
                                        sum(b.num_tokens for b in batches)))


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


def commandstats(client) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"]
            for k, v in client.info("commandstats").items()}


def stats_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# ----------------------------------------------------------------------------- 1. latency
def bench_latency(url: str, steps: int, world_size: int, label: str) -> dict:
    st = RedisJobState(url, f"lat-{label}", config_hash="b", world_size=world_size,
                       history_steps=8)
    others = [(r, f"rank{r}", 0) for r in range(1, world_size)]
    st.claim_rank(0, "rank0", LEASE_S)
    fetch, ack, both = [], [], []
    round_trips, delta, usec = 0, {}, {}
    chunk = 50
    for first in range(0, steps, chunk):
        # Untimed: publish the next chunk; every other rank is already through it, so the timed
        # acks of rank 0 run the trimming too.
        ns = range(first, min(steps, first + chunk))
        st.publish_steps([make_step(k, world_size) for k in ns])
        st.ack_heartbeat_many([(r, c, ns[-1]) for r, c, _ in others], LEASE_S)
        raw = st.client.info("commandstats")
        usec_before = {c: raw.get(f"cmdstat_{c}", {}).get("usec", 0) for c in ("evalsha", "hmget")}
        before, rt0 = commandstats(st.client), RoundTrips.n
        for n in ns:
            t0 = time.perf_counter()
            view = st.get_step_for(n, [0])
            t1 = time.perf_counter()
            st.ack_heartbeat(0, "rank0", n, LEASE_S)
            t2 = time.perf_counter()
            assert view is not None and view.batch_for(0) is not None
            fetch.append(t1 - t0)
            ack.append(t2 - t1)
            both.append(t2 - t0)
        round_trips += RoundTrips.n - rt0
        after_raw = st.client.info("commandstats")
        for k, v in stats_delta(before, commandstats(st.client)).items():
            delta[k] = delta.get(k, 0) + v
        for cmd in ("evalsha", "hmget"):
            row = after_raw.get(f"cmdstat_{cmd}", {})
            usec[cmd] = usec.get(cmd, 0) + row.get("usec", 0) - usec_before.get(cmd, 0)
    delta.pop("info", None)
    ms = 1000.0
    return {
        "label": label, "steps": steps, "world_size": world_size,
        "fetch_p50_ms": statistics.median(fetch) * ms, "fetch_p99_ms": pct(fetch, 99) * ms,
        "ack_p50_ms": statistics.median(ack) * ms, "ack_p99_ms": pct(ack, 99) * ms,
        "step_p50_ms": statistics.median(both) * ms, "step_p99_ms": pct(both, 99) * ms,
        # Client->Redis round trips per rank-step, counted at the socket (HMGET + EVALSHA).
        "round_trips_per_rank_step": round_trips / steps,
        # Everything Redis executed, including the commands inside the script.
        "redis_commands_per_rank_step": sum(delta.values()) / steps,
        "commandstats_delta": delta,
        # Server-side time (INFO commandstats usec): what Redis itself spends, without the
        # client, the loopback and the scheduler of a shared machine. HMGET includes the one
        # inside the ACK script (1 per ack), so it is per call of both kinds.
        "redis_usec_per_ack": usec.get("evalsha", 0) / steps,
        "redis_usec_per_hmget": usec.get("hmget", 0) / max(1, delta.get("hmget", 0)),
        "_samples": {"fetch": fetch, "ack": ack, "step": both},
    }


# -------------------------------------------------------------------------- 2. simulation
def _publisher(url: str, job: str, world_size: int, steps: int, window: int, chunk: int,
               out: mp.Queue) -> None:
    st = RedisJobState(url, job, config_hash="b", world_size=world_size, history_steps=HISTORY)
    t_pub, polls = 0.0, 0
    n = 0
    while n < steps:
        while n > st.min_acked() + window:  # backpressure: stay a window ahead of the slowest
            polls += 1
            time.sleep(0.001)
        batch = [make_step(k, world_size) for k in range(n, min(steps, n + chunk))]
        t0 = time.perf_counter()
        st.publish_steps(batch, PlannerCheckpoint(0, (n + len(batch)) * world_size * 8,
                                                  n + len(batch)))
        t_pub += time.perf_counter() - t0
        n += len(batch)
    out.put({"role": "publisher", "publish_s": t_pub, "backpressure_polls": polls})


def _replica(url: str, job: str, world_size: int, ranks: list[int], steps: int,
             per_rank: bool, start: mp.Event, out: mp.Queue) -> None:
    st = RedisJobState(url, job, config_hash="b", world_size=world_size, history_steps=HISTORY)
    cids = {r: f"replica-{ranks[0]}:rank-{r}" for r in ranks}
    for r in ranks:
        st.claim_rank(r, cids[r], LEASE_S)
    start.wait()
    rt0 = RoundTrips.n
    waits, step_times, samples = 0, [], 0
    t_start = time.perf_counter()
    for n in range(steps):
        t0 = time.perf_counter()
        if per_rank:  # every rank on its own: fetch + ack, two round trips each
            for r in ranks:
                while (view := st.get_step_for(n, [r])) is None:
                    waits += 1
                    time.sleep(0.0005)
                samples += len(view.batch_for(r).samples)
                st.ack_heartbeat(r, cids[r], n, LEASE_S)
        else:
            while (view := st.get_step_for(n, ranks)) is None:
                waits += 1
                time.sleep(0.0005)
            samples += sum(len(b.samples) for b in view.batches)
            st.ack_heartbeat_many([(r, cids[r], n) for r in ranks], LEASE_S)
        step_times.append(time.perf_counter() - t0)
    out.put({"role": "replica", "ranks": len(ranks), "wall_s": time.perf_counter() - t_start,
             "round_trips": RoundTrips.n - rt0,
             "not_yet_published_polls": waits, "samples": samples, "step_times": step_times})


def bench_simulation(url: str, world_size: int, steps: int, replicas: int,
                     per_rank: bool) -> dict:
    client = connect(url)
    job = f"sim-{world_size}x{steps}-{'per-rank' if per_rank else 'replica'}"
    # Register up front.
    RedisJobState(client, job, config_hash="b", world_size=world_size, history_steps=HISTORY)
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    start = ctx.Event()
    parts = [list(range(world_size))[i::replicas] for i in range(replicas)]
    procs = [ctx.Process(target=_replica, args=(url, job, world_size, p, steps, per_rank, start,
                                                out)) for p in parts]
    for p in procs:
        p.start()
    time.sleep(0.5 + 0.002 * world_size)  # replicas claim their ranks
    mem0 = client.info("memory")["used_memory"]
    cmd0 = commandstats(client)
    pub = ctx.Process(target=_publisher, args=(url, job, world_size, steps, 16, 4, out))
    t0 = time.perf_counter()
    pub.start()
    start.set()
    peak_mem, results = mem0, []
    while len(results) < replicas + 1:
        try:
            results.append(out.get(timeout=0.2))
        except Exception:  # queue.Empty: sample memory while waiting
            peak_mem = max(peak_mem, client.info("memory")["used_memory"])
    wall = time.perf_counter() - t0
    for p in [*procs, pub]:
        p.join(10)
    cmd = stats_delta(cmd0, commandstats(client))
    cmd.pop("info", None)
    st = RedisJobState.attach(client, job)
    reps = [r for r in results if r["role"] == "replica"]
    # Step 0 includes the publisher's start-up: leave it out of the per-step figures.
    step_times = [t for r in reps for t in r["step_times"][1:]]
    rts = sum(r["round_trips"] for r in reps)
    assert sum(r["samples"] for r in reps) == world_size * steps * SAMPLES_PER_BATCH
    assert st.min_acked() == steps - 1
    top = {k: v for k, v in cmd.items() if k in ("evalsha", "hmget", "hget", "zrange", "exec",
                                                 "multi", "get")}
    return {
        "world_size": world_size, "steps": steps, "replicas": replicas, "per_rank": per_rank,
        "wall_s": wall,
        "rank_steps_per_s": world_size * steps / wall,
        "redis_commands_total": sum(cmd.values()),
        "redis_commands_per_step": sum(cmd.values()) / steps,
        "redis_commands_per_rank_step": sum(cmd.values()) / steps / world_size,
        "top_level_calls_per_step": sum(top.values()) / steps,
        # Replica round trips (incl. polls for a step not yet published) per rank-step.
        "replica_round_trips_per_rank_step": rts / steps / world_size,
        "commandstats_delta": cmd,
        "replica_step_p50_ms": statistics.median(step_times) * 1000,
        "replica_step_p99_ms": pct(step_times, 99) * 1000,
        "not_yet_published_polls": sum(r["not_yet_published_polls"] for r in reps),
        "publisher": next(r for r in results if r["role"] == "publisher"),
        "peak_used_memory_delta_mb": (peak_mem - mem0) / 2**20,
        "trimmed_through": st.trimmed_through(),
        "retained_steps_after": st.published_through() - st.trimmed_through(),
        "_step_times": [r["step_times"] for r in reps],
    }


def bench_memory(url: str, world_size: int, steps: int) -> dict:
    client = connect(url)
    st = RedisJobState(client, "mem", config_hash="b", world_size=world_size)
    payload = 0
    m0 = client.info("memory")["used_memory"]
    for n in range(steps):
        s = make_step(n, world_size)
        h, blobs = encode_step(s)
        payload += len(h) + sum(len(b) for _, b in blobs)
        st.publish_step(s)
    m1 = client.info("memory")["used_memory"]
    return {"world_size": world_size, "steps": steps,
            "bytes_per_retained_step": (m1 - m0) / steps,
            "encoded_bytes_per_step": payload / steps,
            "bytes_per_rank_batch": (m1 - m0) / steps / world_size}


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
    ax.axvline(2.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("latency per rank-step call (ms, loopback)")
    ax.set_ylabel("CDF")
    ax.set_title("one rank: fetch (HMGET) + ack/heartbeat (EVALSHA)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for sim in results["simulation"]:
        per = [statistics.median(ts) * 1000 for ts in zip(*sim["_step_times"], strict=True)]
        ax.plot(per, label=f"W={sim['world_size']} {'per-rank' if sim['per_rank'] else 'replica'}"
                           f" ({sim['replicas']} procs, {sim['wall_s']:.1f}s)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("replica time per step (ms, median over replicas)")
    ax.set_title("simulation: W ranks on one Redis")
    ax.legend(fontsize=7)
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
    args = ap.parse_args()
    W = args.ranks or (256 if args.quick else 1024)
    S = args.steps or (50 if args.quick else 200)
    lat_steps = 300 if args.quick else 1000
    per_rank_steps = 5 if args.quick else 20
    results: dict = {"latency": [], "simulation": []}
    RoundTrips.install()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(data_dir=tmp) as server:
        results["latency"].append(bench_latency(server.url, lat_steps, W, "no-AOF"))
        results["memory"] = bench_memory(server.url, W, 10 if args.quick else 20)
        connect(server.url).flushall()
        results["simulation"].append(bench_simulation(server.url, W, S, args.replicas, False))
        connect(server.url).flushall()
        results["simulation"].append(
            bench_simulation(server.url, W, per_rank_steps, args.replicas, True))
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(data_dir=tmp, appendonly=True) as srv:
        connect(srv.url).config_set("appendfsync", "always")
        results["latency"].append(bench_latency(srv.url, lat_steps // 2, W, "AOF always"))
    meta = {"command": "bench/coordinator_bench.py" + (" --quick" if args.quick else ""),
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": mp.cpu_count(), "loadavg_1m_at_start": load,
            "loadavg_1m_at_end": os.getloadavg()[0],
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stem = "coordinator_bench_quick" if args.quick else "coordinator_bench"
    (OUT_DIR / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, **strip(results)}, indent=1))
    plot(results, OUT_DIR / f"{stem}.png")

    print(f"\n`{meta['command']}` ({meta['cpus']} CPUs, {meta['utc']}, load avg "
          f"{load:.1f} -> {meta['loadavg_1m_at_end']:.1f})\n")
    print("| per rank-step (loopback) | fetch p50/p99 ms | ack+hb p50/p99 ms | "
          "step p50/p99 ms | round trips | Redis cmds | Redis-side us per ack / HMGET |")
    print("|---|---|---|---|---|---|---|")
    for lat in results["latency"]:
        print(f"| W={lat['world_size']}, {lat['label']} | {lat['fetch_p50_ms']:.3f} / "
              f"{lat['fetch_p99_ms']:.3f} | {lat['ack_p50_ms']:.3f} / {lat['ack_p99_ms']:.3f} | "
              f"{lat['step_p50_ms']:.3f} / {lat['step_p99_ms']:.3f} | "
              f"{lat['round_trips_per_rank_step']:.2f} | "
              f"{lat['redis_commands_per_rank_step']:.1f} | {lat['redis_usec_per_ack']:.1f} / "
              f"{lat['redis_usec_per_hmget']:.1f} |")
    print("\n| simulation | wall s | rank-steps/s | Redis cmds/step | cmds per rank-step | "
          "replica RTTs per rank-step | replica step p50/p99 ms | peak mem MB | "
          "retained steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for sim in results["simulation"]:
        kind = "per-rank RTTs" if sim["per_rank"] else "replica-pipelined"
        print(f"| {sim['world_size']} ranks x {sim['steps']} steps, {sim['replicas']} procs, "
              f"{kind} | {sim['wall_s']:.1f} | {sim['rank_steps_per_s']:.0f} | "
              f"{sim['redis_commands_per_step']:.0f} | "
              f"{sim['redis_commands_per_rank_step']:.2f} | "
              f"{sim['replica_round_trips_per_rank_step']:.3f} | "
              f"{sim['replica_step_p50_ms']:.1f} / "
              f"{sim['replica_step_p99_ms']:.1f} | {sim['peak_used_memory_delta_mb']:.1f} | "
              f"{sim['retained_steps_after']} |")
    m = results["memory"]
    print(f"\nRedis memory per retained step (W={m['world_size']}, {SAMPLES_PER_BATCH} samples "
          f"per batch): {m['bytes_per_retained_step'] / 1024:.1f} KiB "
          f"({m['bytes_per_rank_batch']:.0f} B per rank-batch; encoded payload "
          f"{m['encoded_bytes_per_step'] / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
