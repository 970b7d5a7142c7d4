"""Elastic benchmark: reconfiguration latency, from the Scale request to the first batch of the
new world at every new rank (docs/elastic.md). Target: < 1 s.

Cases: 8 -> 4 and 64 -> 128 simulated ranks. One `serve`-equivalent process (start_service over a
private redis-server, an in-memory source of synthetic samples) and a few client processes, each
running many rank streams as threads (`BatchStream`, real gRPC over loopback). The old world's
ranks consume without a training delay, in lockstep as DDP ranks are (a barrier per step,
`--no-lockstep` to let them race); once every rank took `--warm` batches the bench calls
Scale (gRPC) and tells the clients. Each old rank drains to the boundary, gets END(reconfigure)
and, if its rank id exists in the new world, opens that rank of the new world at once (the same
worker re-joining, as torchrun elastic does); ranks that only exist in the new world (scale-out)
open as soon as the Scale call returned. Measured per repeat:
- client: max over the new ranks of (first batch received - request sent), and the median;
- service: the same from the job state's own records (first grant of each new rank), the time
  to the new plan (adopted) and to the last old rank's END(reconfigure) (drained);
- baseline: as many fresh streams of a job that is not reconfigured, opened at once, to their
  first batch: what that many streams cost this machine whatever the reconfiguration.

Run:  .venv/bin/python bench/elastic_bench.py [--quick] [--repeats N]
Writes elastic_bench{,_quick}.json and .png, prints Markdown. Other work
on the machine shares its cores: the load average is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_dir import add_out_argument, out_dir  # noqa: E402

JOB = "elastic-bench"
CASES = ((8, 4), (64, 128))


# ----------------------------------------------------------------------------- service process
def serve(redis_url: str, old: int, new: int, samples: int, ready: mp.Queue, stop: mp.Event
          ) -> None:
    from pipeline.config import ServiceConfig
    from pipeline.preprocess.array_source import ArraySource, synthetic_samples
    from pipeline.service.server import start_service

    cfg = ServiceConfig.model_validate({
        "redis_url": redis_url, "metrics_port": None, "grpc": {"port": 0}, "lease_seconds": 10,
        "log_level": "WARNING",
        "jobs": [{"job_id": JOB, "world_size": old, "max_world_size": max(old, new),
                  "source": {"paths": ["arrays"]},
                  "batching": {"token_budget": 1024, "max_window_samples": 64,
                               "pool_steps": 2}}]})
    items = synthetic_samples(samples, max_len=400, seed=7)
    svc = start_service(cfg, sample_sources={JOB: ArraySource(items)})
    ready.put(svc.port)
    stop.wait()
    svc.stop(grace=0.2)


# ----------------------------------------------------------------------------- client process
def client(address: str, old_ranks: list[int], new_ranks: list[int], old: int, new: int,
           warm: int, progress: mp.Queue, go: mp.Event, out: mp.Queue, step: object) -> None:
    """Old ranks consume, drain, re-open as their new rank (if any); new-only ranks open once
    `go` is set. With `step` (a barrier of the client processes) the old world runs in lockstep,
    as DDP ranks do (each step's all-reduce). Reports the new world's first batch time per rank
    and, per old rank, when it saw its END(reconfigure) and closed its stream."""
    from trainer_client import BatchStream

    # Lockstep: the process's old ranks meet at a thread barrier whose action meets the other
    # processes (a barrier of the client processes): every step waits for every old rank.
    local = (threading.Barrier(len(old_ranks), action=lambda: step.wait(60))
             if step is not None and old_ranks else None)
    firsts: dict[int, float] = {}
    drained: dict[int, int] = {}  # old rank -> batches it still received after the request
    ended: dict[int, float] = {}
    closed: dict[int, float] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def run_new(rank: int) -> None:
        with BatchStream(address, JOB, rank, new, prefetch=2, tensors="numpy",
                         backoff=(0.01, 0.1)) as s:
            for i, _ in enumerate(s):
                if i == 0:
                    with lock:
                        firsts[rank] = time.time()
                if i >= 2:
                    break

    def run_old(rank: int) -> None:
        try:
            with BatchStream(address, JOB, rank, old, prefetch=2, tensors="numpy") as s:
                after = 0
                for i, _ in enumerate(s):
                    if i + 1 == warm:
                        progress.put(rank)
                    after += go.is_set()
                    if local is not None:
                        local.wait(60)
                assert s.last_end.reason == "reconfigure", s.last_end
                drained[rank] = after
                ended[rank] = time.time()
            closed[rank] = time.time()
            if rank < new:
                run_new(rank)
        except Exception as exc:  # reported, the bench fails loudly
            errors.append(f"old rank {rank}: {type(exc).__name__}: {exc}")

    def run_joiner(rank: int) -> None:
        go.wait()
        try:
            run_new(rank)
        except Exception as exc:
            errors.append(f"new rank {rank}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run_old, args=(r,)) for r in old_ranks]
    threads += [threading.Thread(target=run_joiner, args=(r,)) for r in new_ranks
                if r >= old]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    out.put({"firsts": firsts, "drained": drained, "errors": errors, "ended": ended,
             "closed": closed})


def cold_client(address: str, ranks: list[int], world: int, go: mp.Event, out: mp.Queue
                ) -> None:
    """The baseline: fresh streams of a job that is not reconfigured, opened at `go`."""
    from trainer_client import BatchStream

    firsts: dict[int, float] = {}

    def run(rank: int) -> None:
        go.wait()
        with BatchStream(address, JOB, rank, world, prefetch=2, tensors="numpy") as s:
            for _ in s:
                firsts[rank] = time.time()
                break

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    out.put(firsts)


def cold(redis_url: str, world: int, procs: int) -> float:
    """Go to the first batch at every rank for `world` fresh streams of a job planned ahead:
    what opening that many streams costs on this machine, whatever the reconfiguration."""
    from pipeline.coordinator import registry
    from pipeline.redis_client import connect

    rc = connect(redis_url)
    registry.delete_job(rc, JOB)
    rc.close()
    ctx = mp.get_context("spawn")
    ready, out, stop, go = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    server = ctx.Process(target=serve, args=(redis_url, world, world, 60 * world * 8, ready,
                                             stop))
    server.start()
    address = f"127.0.0.1:{ready.get(timeout=120)}"
    clients = [ctx.Process(target=cold_client,
                           args=(address, [r for r in range(world) if r % procs == p], world,
                                 go, out)) for p in range(procs)]
    for c in clients:
        c.start()
    try:
        time.sleep(3.0)  # the producer plans its first steps; the clients are up
        t0 = time.time()
        go.set()
        firsts = {r: t for _ in clients for r, t in out.get(timeout=180).items()}
        assert len(firsts) == world
        return max(firsts.values()) - t0
    finally:
        stop.set()
        for c in clients:
            c.join(30)
        server.join(30)


# ----------------------------------------------------------------------------- one repeat
def one(redis_url: str, old: int, new: int, warm: int, procs: int, lockstep: bool) -> dict:
    import grpc

    from pipeline.coordinator import RedisJobState, registry
    from pipeline.redis_client import connect
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb
    from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

    rc = connect(redis_url)
    registry.delete_job(rc, JOB)
    rc.close()
    ctx = mp.get_context("spawn")
    ready, progress, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    stop, go = ctx.Event(), ctx.Event()
    step = ctx.Barrier(min(procs, old)) if lockstep else None
    samples = max(4000, 60 * max(old, new) * 8)
    server = ctx.Process(target=serve, args=(redis_url, old, new, samples, ready, stop))
    server.start()
    port = ready.get(timeout=120)
    address = f"127.0.0.1:{port}"
    clients = []
    for p in range(procs):
        mine_old = [r for r in range(old) if r % procs == p]
        mine_new = [r for r in range(new) if r % procs == p]
        c = ctx.Process(target=client, args=(address, mine_old, mine_new, old, new, warm,
                                             progress, go, out, step))
        c.start()
        clients.append(c)
    try:
        for _ in range(old):
            progress.get(timeout=180)
        with grpc.insecure_channel(address) as ch:
            t0 = time.time()
            reply = pb_grpc.DataServiceStub(ch).Scale(pb.ScaleRequest(job_id=JOB,
                                                                      world_size=new),
                                                      timeout=60)
            go.set()
        results = [out.get(timeout=180) for _ in clients]
        errors = [e for r in results for e in r["errors"]]
        if errors:
            raise RuntimeError("; ".join(errors[:5]))
        firsts = {int(r): t for res in results for r, t in res["firsts"].items()}
        assert sorted(firsts) == list(range(new)), sorted(firsts)
        lat = [t - t0 for t in firsts.values()]
        drained = [n for res in results for n in res["drained"].values()]
        st = RedisJobState.attach(redis_url, JOB)
        t = st.world_timings(1)
        prev = st.worlds()[0]
        st.close()
        return {
            "client_max_s": max(lat), "client_p50_s": statistics.median(lat),
            "service_first_batch_s": t.first_batch_seconds(new),
            "adopted_s": t.adopted_at - t.requested_at,
            "drained_s": max(t.left_at.values()) - t.requested_at,
            "boundary_step": reply.previous.last_step, "first_step": reply.world.first_step,
            "returned_samples": prev.returned_samples,
            "drain_batches_max": max(drained), "drain_batches_total": sum(drained),
            # Client side of the drain: when the last old rank saw its END(reconfigure), and
            # when the last old stream was closed (the new ones open after that).
            "client_end_max_s": max(t for res in results for t in res["ended"].values()) - t0,
            "client_closed_max_s": max(t for res in results
                                       for t in res["closed"].values()) - t0,
            "rejoin_p50_s": statistics.median(
                firsts[r] - closed for res in results for r, closed in res["closed"].items()
                if r < new),
        }
    finally:
        stop.set()
        for c in clients:
            c.join(30)
            if c.is_alive():
                c.kill()
        server.join(30)
        if server.is_alive():
            server.kill()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, client, service, adopted = [], [], [], []
    for case in results["cases"]:
        labels.append(f"{case['old']} -> {case['new']}")
        client.append([r["client_max_s"] for r in case["repeats"]])
        service.append([r["service_first_batch_s"] for r in case["repeats"]])
        adopted.append([r["adopted_s"] for r in case["repeats"]])
    x = range(len(labels))
    base = [case["cold_start_s"] for case in results["cases"]]
    for off, data, name in ((-0.3, adopted, "new plan published"),
                            (-0.1, service, "first batch at every new rank (service)"),
                            (0.1, client, "first batch at every new rank (client)"),
                            (0.3, base, "baseline: as many fresh streams, static job")):
        ax.bar([i + off for i in x], [statistics.median(d) for d in data], 0.2, label=name,
               yerr=[[statistics.median(d) - min(d) for d in data],
                     [max(d) - statistics.median(d) for d in data]], capsize=3)
    ax.axhline(1.0, color="red", ls="--", lw=1, label="target 1 s")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("world size change (simulated ranks)")
    ax.set_ylabel("seconds from the Scale request")
    ax.set_title("Reconfiguration latency (median, min-max over repeats)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat per case")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warm", type=int, default=4, help="batches per old rank before the scale")
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--no-lockstep", action="store_true",
                    help="old ranks consume independently (not in DDP lockstep)")
    add_out_argument(ap, "elastic")
    args = ap.parse_args()
    from pipeline.redis_server import LocalRedis

    repeats = 1 if args.quick else args.repeats
    load_before = os.getloadavg()
    results: dict = {"cases": []}
    with LocalRedis() as server:
        for old, new in CASES:
            reps = [one(server.url, old, new, args.warm, args.procs, not args.no_lockstep)
                    for _ in range(repeats)]
            base = [cold(server.url, new, args.procs) for _ in range(repeats)]
            results["cases"].append({"old": old, "new": new, "repeats": reps,
                                     "cold_start_s": base})
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(),
            "load_before": load_before, "load_after": os.getloadavg(), "repeats": repeats,
            "warm": args.warm, "client_processes": args.procs, "target_s": 1.0,
            "lockstep": not args.no_lockstep,
            "command": "bench/elastic_bench.py" + (" --quick" if args.quick else "")}
    out_path = out_dir(args, "elastic")
    stem = "elastic_bench_quick" if args.quick else "elastic_bench"
    (out_path / f"{stem}.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    plot(results, out_path / f"{stem}.png")
    print("| change | new plan (adopted) | old ranks drained | first batch everywhere "
          "(service) | first batch everywhere (client) | p50 new rank (client) | baseline: "
          "that many fresh streams of a static job |")
    print("|---|---|---|---|---|---|---|")
    for case in results["cases"]:
        med = {k: statistics.median(r[k] for r in case["repeats"])
               for k in ("adopted_s", "drained_s", "service_first_batch_s", "client_max_s",
                         "client_p50_s")}
        print(f"| {case['old']} -> {case['new']} | {med['adopted_s']:.3f} s | "
              f"{med['drained_s']:.3f} s | {med['service_first_batch_s']:.3f} s | "
              f"{med['client_max_s']:.3f} s | {med['client_p50_s']:.3f} s | "
              f"{statistics.median(case['cold_start_s']):.3f} s |")
    print(f"load average before/after: {load_before} / {meta['load_after']}")


if __name__ == "__main__":
    main()
