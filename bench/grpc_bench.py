"""gRPC data-plane benchmark: one server, 8 concurrent rank streams on loopback.

    .venv/bin/python bench/grpc_bench.py [--quick]

Measures, in one run and on the same machine:
  1. grpc: batches/s and MB/s delivered to 8 rank processes (BatchStream, decoded to torch);
  2. raw ceiling: the same serialized batch bytes over plain TCP sockets (8 connections, one
     sender thread each, receivers `recv_into` a preallocated buffer) — what loopback can carry;
  3. client decode cost per batch (protobuf parse + torch.frombuffer views);
  4. data stall: 8 simulated trainers consuming at a fixed step rate below the measured pipeline
     rate; stall = time spent waiting for the next batch / wall time.
Writes bench/results/grpc/grpc_bench.json and .png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import struct
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT_DIR = ROOT / "bench" / "results" / "grpc"
WORLD = 8
WARMUP = 8  # batches per rank: the first prefetch windows filling at connect (not steady state)


def _config(budget: int, steps: int, prefetch: int):
    from pipeline.config import ServiceConfig

    job = {"job_id": "bench", "world_size": WORLD, "source": {"paths": ["arrays"]},
           "batching": {"token_budget": budget, "max_window_samples": 256, "collate": "padded"}}
    return ServiceConfig.model_validate({"metrics_port": None,
                                         "grpc": {"port": 0, "prefetch_steps": prefetch,
                                                  "max_message_mb": 256},
                                         "jobs": [job]})


def _samples(budget: int, steps: int):
    from pipeline.preprocess.array_source import synthetic_samples

    # ~16 samples per batch of 512-1536 tokens under the budget.
    n = steps * WORLD * (budget // 1024 + 1)
    return synthetic_samples(n, min_len=512, max_len=1536, seed=0)


# --- rank processes -------------------------------------------------------------------------

def _rank_proc(address: str, rank: int, start, step_time: float, out_q) -> None:
    from trainer_client import BatchStream

    start.wait()
    s = BatchStream(address, "bench", rank, WORLD, prefetch=4)
    n = nbytes = 0
    waited = warm_waited = 0.0
    first = last = None
    it = iter(s)
    steps_done_at_warmup = None
    t_start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        if first is None:
            first = time.time()
        elif step_time > 0:
            waited += t1 - t0
            if n >= WARMUP:  # after the first window fill at connect
                warm_waited += t1 - t0
        last = time.time()
        n += 1
        if n == WARMUP:
            steps_done_at_warmup = time.perf_counter() - t_start
        nbytes += sum(t.numel() * t.element_size() for t in batch.values())
        if step_time > 0:
            time.sleep(step_time)  # the simulated forward/backward
    wall = time.perf_counter() - t_start
    warm_wall = max(1e-9, wall - (steps_done_at_warmup or 0.0))
    s.close()
    out_q.put({"rank": rank, "batches": n, "bytes": nbytes, "first": first, "last": last,
               "waited": waited, "wall": wall, "warm_waited": warm_waited,
               "warm_wall": warm_wall})


def _run_grpc(budget: int, steps: int, step_time: float) -> dict:
    from pipeline.preprocess.array_source import ArraySource
    from pipeline.service.server import start_service

    ctx = mp.get_context("spawn")
    start, out_q = ctx.Event(), ctx.Queue()
    svc = start_service(_config(budget, steps, 4),
                        sample_sources={"bench": ArraySource(_samples(budget, steps))})
    procs = [ctx.Process(target=_rank_proc, args=(svc.address, r, start, step_time, out_q))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    time.sleep(8.0)  # let the rank processes import torch/grpc before the clock starts
    start.set()
    res = [out_q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    svc.stop(grace=0.5)
    t0 = min(r["first"] for r in res)
    t1 = max(r["last"] for r in res)
    batches = sum(r["batches"] for r in res)
    nbytes = sum(r["bytes"] for r in res)
    return {"batches": batches, "bytes": nbytes, "seconds": t1 - t0,
            "batches_per_s": batches / (t1 - t0), "mb_per_s": nbytes / (t1 - t0) / 1e6,
            "stall_fraction": sum(r["waited"] for r in res) / sum(r["wall"] for r in res),
            "stall_fraction_after_warmup":
                sum(r["warm_waited"] for r in res) / sum(r["warm_wall"] for r in res),
            "per_rank": res}


# --- raw socket ceiling ---------------------------------------------------------------------

def _raw_client(port: int, start, out_q) -> None:
    start.wait()
    sock = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(256 * 1024 * 1024)
    view = memoryview(buf)
    n = nbytes = 0
    first = None
    header = bytearray(8)
    while True:
        got = 0
        while got < 8:
            k = sock.recv_into(memoryview(header)[got:], 8 - got)
            if k == 0:
                break
            got += k
        if got < 8:
            break
        (size,) = struct.unpack("<Q", header)
        if size == 0:
            break
        got = 0
        while got < size:
            got += sock.recv_into(view[got:size], size - got)
        if first is None:
            first = time.time()
        n += 1
        nbytes += size
    out_q.put({"batches": n, "bytes": nbytes, "first": first, "last": time.time()})
    sock.close()


def _run_raw(messages: list[bytes], per_rank: int) -> dict:
    ctx = mp.get_context("spawn")
    start, out_q = ctx.Event(), ctx.Queue()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(WORLD)
    port = listener.getsockname()[1]
    procs = [ctx.Process(target=_raw_client, args=(port, start, out_q)) for _ in range(WORLD)]
    for p in procs:
        p.start()
    start.set()

    def send(conn: socket.socket, offset: int) -> None:
        for i in range(per_rank):
            m = messages[(offset + i) % len(messages)]
            conn.sendall(struct.pack("<Q", len(m)))
            conn.sendall(m)
        conn.sendall(struct.pack("<Q", 0))
        conn.close()

    threads = []
    for r in range(WORLD):
        conn, _ = listener.accept()
        threads.append(threading.Thread(target=send, args=(conn, r)))
    for t in threads:
        t.start()
    res = [out_q.get(timeout=600) for _ in procs]
    for t in threads:
        t.join()
    for p in procs:
        p.join(30)
    listener.close()
    t0 = min(r["first"] for r in res)
    t1 = max(r["last"] for r in res)
    batches = sum(r["batches"] for r in res)
    nbytes = sum(r["bytes"] for r in res)
    return {"batches": batches, "bytes": nbytes, "seconds": t1 - t0,
            "batches_per_s": batches / (t1 - t0), "mb_per_s": nbytes / (t1 - t0) / 1e6}


# --- real batch bytes and decode cost -------------------------------------------------------

def _real_messages(budget: int, steps: int, count: int) -> list[bytes]:
    from pipeline.config import ServiceConfig  # noqa: F401
    from pipeline.jobstate import MemoryJobState
    from pipeline.preprocess.array_source import ArraySource
    from pipeline.service.job_runtime import JobRuntime

    cfg = _config(budget, steps, 4)
    rt = JobRuntime(cfg.jobs[0], MemoryJobState("bench"), ArraySource(_samples(budget, steps)),
                    max_ahead=10**9).start()
    deadline = time.time() + 120
    while rt.state.published_through() < count // WORLD + 1 and time.time() < deadline:
        time.sleep(0.05)
    out = []
    for s in range(rt.state.published_through() + 1):
        step = rt.state.get_step(s)
        for r in range(WORLD):
            m = rt.build_message(step, r)
            if m is not None:
                out.append(m)
        if len(out) >= count:
            break
    rt.stop()
    return out


def _decode_cost(messages: list[bytes], reps: int) -> dict:
    from trainer_client.decode import decode_batch
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    t0 = time.perf_counter()
    n = 0
    for _ in range(reps):
        for m in messages:
            decode_batch(pb.ServerMessage.FromString(m).batch)
            n += 1
    dt = time.perf_counter() - t0
    mean_bytes = sum(map(len, messages)) / len(messages)
    return {"us_per_batch": dt / n * 1e6, "mean_batch_bytes": mean_bytes,
            "gb_per_s": mean_bytes * n / dt / 1e9}


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["raw TCP\n(same bytes)", "gRPC odb.v1\n(8 streams)"]
    vals = [result["raw"]["mb_per_s"], result["grpc"]["mb_per_s"]]
    a.bar(names, vals, color=["#999", "#3a7"])
    a.set_ylabel("MB/s to 8 ranks (loopback)")
    a.set_title(f"gRPC = {result['grpc_vs_raw']:.0%} of raw")
    b.bar(["stall (all)", "after warm-up"],
          [result["stall"]["stall_fraction"] * 100,
           result["stall"]["stall_fraction_after_warmup"] * 100], color=["#c63", "#e96"])
    b.axhline(1.0, ls="--", color="k", lw=0.8)
    b.set_ylabel("% of trainer time waiting for data")
    b.set_title(f"trainer at {result['stall']['target_steps_per_s']:.1f} steps/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    ap.add_argument("--budget", type=int, default=32768, help="token budget per batch")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    steps = 80 if args.quick else 200
    budget = args.budget

    msgs = _real_messages(budget, steps, 64)
    decode = _decode_cost(msgs, 3 if args.quick else 10)
    grpc_res = _run_grpc(budget, steps, 0.0)
    raw = _run_raw(msgs, grpc_res["batches"] // WORLD)
    # A trainer slower than the pipeline: half the measured per-rank step rate.
    per_rank_rate = grpc_res["batches_per_s"] / WORLD
    target = per_rank_rate * 0.5
    stall = _run_grpc(budget, steps // 2, 1.0 / target)
    stall["target_steps_per_s"] = target
    result = {
        "command": "python bench/grpc_bench.py" + (" --quick" if args.quick else ""),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "machine": platform.machine()},
        "world_size": WORLD, "token_budget": budget, "steps": steps,
        "grpc": {k: v for k, v in grpc_res.items() if k != "per_rank"},
        "raw": raw, "grpc_vs_raw": grpc_res["mb_per_s"] / raw["mb_per_s"],
        "decode": decode,
        "stall": {k: v for k, v in stall.items() if k != "per_rank"},
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "grpc_bench.json").write_text(json.dumps(result, indent=2))
    _plot(result, OUT_DIR / "grpc_bench.png")
    print(json.dumps({k: result[k] for k in ("grpc", "raw", "grpc_vs_raw", "decode")}, indent=2))
    print(f"stall: {result['stall']['stall_fraction']:.3%} "
          f"(after warm-up {result['stall']['stall_fraction_after_warmup']:.3%}) at "
          f"{target:.2f} steps/s per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
