"""Delivery benchmark: real `serve` replicas on one Redis feeding real rank processes over gRPC.

    .venv/bin/python bench/delivery_bench.py [--quick]

Measured side by side in one run, on loopback:
  1. delivery: MB/s and batches/s to 8 rank processes (BatchStream, decoded to torch) from 1 and
     from 2 replica processes (ranks split between them), against raw TCP carrying the very
     same serialized batch bytes to 8 processes (what loopback can carry) and a bare gRPC
     server stream of those bytes to 8 clients that only receive them (gRPC's own ceiling),
     from a sync and from a `grpc.aio` server; each reference is the median of 3 rounds of
     ~1 GB;
  2. data stall: 8 trainers consuming at half the measured per-rank rate (1 replica);
  3. CPU per delivered batch of one replica as the world grows (W = 8, 64, 256 simulated ranks,
     threads in 2 consumer processes, the same number of steps each): it must not grow with W;
  4. TLS: the 1-replica delivery of 1. with gRPC over TLS (a CA and certificate made at run time
     by deploy/tls/make-certs.sh, the ranks verifying it), its rounds alternated with the
     plaintext ones, reported side by side (MB/s, CPU per batch by role);
  5. VLM-size batches (`--part vlm`, issue #32): 10-80 MB of uint8 patches in 1 MiB chunks,
     raw TCP and bare gRPC carrying the same chunked bytes to 4 clients: MB/s, the sender's CPU
     per MB and the clients' RSS.
Replicas are separate processes (`start_service` over a private redis-server) serving an
in-memory synthetic job: delivery, not preprocessing, is measured. Every replica holds the same
deterministic samples; the job's producer is a process of its own (as its Ray actor is when
deployed) and the measured replicas only serve; any replica serves any rank.
Writes delivery_bench{,_quick}.json and .png, and delivery_vlm{,_quick}.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replica_procs import (  # noqa: E402
    VLM_SAMPLE_TOKENS,
    Replica,
    StartLine,
    array_job,
    consume_threads,
    job_samples,
    start_producer,
    vlm_samples,
)
from results_dir import add_out_argument, out_dir  # noqa: E402

from pipeline.service.chunk_framing import DEFAULT_CHUNK_BYTES  # noqa: E402

RANKS = 8
WARMUP = 8  # batches per rank: the first prefetch windows filling at connect


# --- trainer rank processes ------------------------------------------------------------------

def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + sys) of another process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rank(address: str, job: str, rank: int, world: int, line: StartLine, step_time: float,
          q, ca: bytes | None) -> None:
    import torch  # noqa: F401  (a trainer has torch loaded: its import is not delivery)

    from trainer_client import BatchStream

    line.arrive()
    cpu0 = _cpu_s()
    n = nbytes = 0
    waited = warm_waited = 0.0
    first = last = None
    warm_at = None
    t_start = time.perf_counter()
    with BatchStream(address, job, rank, world, prefetch=4, root_certificates=ca) as s:
        it = iter(s)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            if first is None:
                first = time.time()
            else:
                waited += t1 - t0
                if n >= WARMUP:
                    warm_waited += t1 - t0
            last = time.time()
            n += 1
            if n == WARMUP:
                warm_at = time.perf_counter()
            nbytes += sum(t.numel() * t.element_size() for t in batch.values())
            if step_time > 0:
                time.sleep(step_time)  # the simulated forward/backward
    end = time.perf_counter()
    q.put({"rank": rank, "batches": n, "bytes": nbytes, "first": first, "last": last,
           "waited": waited, "wall": end - t_start, "warm_waited": warm_waited,
           "warm_wall": end - (warm_at or t_start), "cpu_s": _cpu_s() - cpu0})


def _deliver(redis_url: str, redis_pid: int, job_id: str, replicas: int, steps: int,
             budget: int, max_len: int, step_time: float = 0.0,
             tls: Path | None = None) -> dict:
    """One delivery run; `cpu_ms_per_batch` splits the machine's CPU over the run by role
    (the replicas, the 8 rank processes, the producer, Redis): on 2 cores they all compete.
    `tls`: a folder of make-certs.sh's files; the replicas serve TLS, the ranks verify it."""
    job = array_job(job_id, RANKS, budget)
    producer = start_producer(redis_url, job, steps, max_len)
    grpc_tls = {} if tls is None else {"grpc": {
        "host": "127.0.0.1", "port": 0, "max_message_mb": 256,
        "tls_cert": str(tls / "tls.crt"), "tls_key": str(tls / "tls.key")}}
    ca = None if tls is None else (tls / "ca.crt").read_bytes()
    reps = [Replica(redis_url, job, steps, max_len, **grpc_tls) for _ in range(replicas)]
    ctx = mp.get_context("spawn")
    line, q = StartLine(ctx, RANKS), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(reps[r % replicas].address, job_id, r, RANKS,
                                             line, step_time, q, ca)) for r in range(RANKS)]
    for p in procs:
        p.start()
    line.wait_ready()  # the rank processes import torch and grpc before the clock starts
    cpu0 = [r.cpu() for r in reps]
    producer0, redis0 = producer.cpu(), _proc_cpu_s(redis_pid)
    line.go()
    res = [q.get(timeout=900) for _ in procs]
    cpu = [r.cpu() - c for r, c in zip(reps, cpu0, strict=True)]
    producer_cpu, redis_cpu = producer.cpu() - producer0, _proc_cpu_s(redis_pid) - redis0
    for p in procs:
        p.join(30)
    stops = [r.stop() for r in reps]
    producer.stop()
    t0, t1 = min(r["first"] for r in res), max(r["last"] for r in res)
    batches, nbytes = sum(r["batches"] for r in res), sum(r["bytes"] for r in res)
    served = [sorted(s["fetched_by_rank"]) for s in stops]
    per_batch = {"replicas": sum(cpu), "ranks": sum(r["cpu_s"] for r in res),
                 "producer": producer_cpu, "redis": redis_cpu}
    return {"replicas": replicas, "tls": tls is not None, "batches": batches, "bytes": nbytes,
            "seconds": t1 - t0,
            "cpu_ms_per_batch": {k: v / batches * 1e3 for k, v in per_batch.items()},
            "batches_per_s": batches / (t1 - t0), "mb_per_s": nbytes / (t1 - t0) / 1e6,
            "replica_cpu_s": cpu, "ranks_served": served,
            "stall_fraction": sum(r["waited"] for r in res) / sum(r["wall"] for r in res),
            "stall_fraction_after_warmup":
                sum(r["warm_waited"] for r in res) / sum(r["warm_wall"] for r in res)}


# --- raw TCP of the same bytes ---------------------------------------------------------------

def _real_messages(budget: int, max_len: int, count: int) -> list[bytes]:
    """Serialized ServerMessages exactly as a replica builds them for this job."""
    from pipeline.config import TrainingJobConfig
    from pipeline.planner.step_planner import StepPlanner
    from pipeline.planner.types import Step
    from pipeline.service.batch_builder import build_batch

    job = TrainingJobConfig.model_validate(array_job("raw", RANKS, budget))
    samples = job_samples(RANKS, count // RANKS + 4, budget, max_len)
    by_id = {s.sample_id: s for s in samples}
    planner = StepPlanner(job.batching.policy(), RANKS, pool_steps=1)
    events = planner.feed_many(s.measured("padded") for s in samples) + planner.end_epoch()
    out = []
    for step in (e for e in events if isinstance(e, Step)):
        for b in step.batches:
            out.extend(build_batch(step, b.rank, [by_id[str(s.sample_id)] for s in b.samples],
                                   collate="padded", pad_id=0).messages())
        if len(out) >= count:
            break
    return out


def _raw_client(port: int, line: StartLine, q) -> None:
    line.arrive()
    sock = socket.create_connection(("127.0.0.1", port))
    buf = memoryview(bytearray(256 * 1024 * 1024))
    header = bytearray(8)
    n = nbytes = 0
    first = None
    while True:
        got = 0
        while got < 8:
            k = sock.recv_into(memoryview(header)[got:], 8 - got)
            if k == 0:
                break
            got += k
        (size,) = struct.unpack("<Q", header) if got == 8 else (0,)
        if size == 0:
            break
        got = 0
        while got < size:
            got += sock.recv_into(buf[got:size], size - got)
        first = first or time.time()
        n += 1
        nbytes += size
    q.put({"batches": n, "bytes": nbytes, "first": first, "last": time.time()})
    sock.close()


def _raw(messages: list[bytes], per_rank: int) -> dict:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(RANKS)

    def send(conn: socket.socket, offset: int) -> None:
        for i in range(per_rank):
            m = messages[(offset + i) % len(messages)]
            conn.sendall(struct.pack("<Q", len(m)))
            conn.sendall(m)
        conn.sendall(struct.pack("<Q", 0))
        conn.close()

    def senders() -> list[threading.Thread]:
        threads = [threading.Thread(target=send, args=(listener.accept()[0], r))
                   for r in range(RANKS)]
        for t in threads:
            t.start()
        return threads

    try:
        return _run_clients(_raw_client, listener.getsockname()[1], senders)
    finally:
        listener.close()


# --- bare gRPC of the same bytes -------------------------------------------------------------

_MESSAGE_LIMITS = [("grpc.max_receive_message_length", 256 * 1024 * 1024),
                   ("grpc.max_send_message_length", 256 * 1024 * 1024)]


def _bare_grpc_client(port: int, line: StartLine, q) -> None:
    import grpc

    line.arrive()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=_MESSAGE_LIMITS)
    call = ch.unary_stream("/bench.Bare/Stream", request_serializer=None,
                           response_deserializer=None)(b"")
    count = nbytes = 0
    first = None
    for m in call:
        first = first or time.time()
        count += 1
        nbytes += len(m)
    q.put({"batches": count, "bytes": nbytes, "first": first, "last": time.time()})
    ch.close()


def _bare_handler(stream):
    import grpc

    return grpc.method_handlers_generic_handler(
        "bench.Bare", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})


def _bare_grpc(messages: list[bytes], per_rank: int) -> dict:
    """gRPC's own ceiling here: a server stream of the same pre-serialized bytes, clients that
    only receive them (no service, no decode)."""
    from concurrent import futures

    import grpc

    def stream(_req: bytes, _ctx: grpc.ServicerContext):
        for i in range(per_rank):
            yield messages[i % len(messages)]

    server = grpc.server(futures.ThreadPoolExecutor(RANKS + 2), options=_MESSAGE_LIMITS)
    server.add_generic_rpc_handlers([_bare_handler(stream)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        return _run_clients(_bare_grpc_client, port)
    finally:
        server.stop(0)


def _bare_grpc_aio(messages: list[bytes], per_rank: int) -> dict:
    """The same bare stream from a `grpc.aio` server (its own event loop in a thread): whether
    the asyncio stack lifts gRPC's ceiling here."""

    async def stream(_req: bytes, _ctx):
        for i in range(per_rank):
            yield messages[i % len(messages)]

    with _aio_server(stream) as port:
        return _run_clients(_bare_grpc_client, port)


@contextlib.contextmanager
def _aio_server(stream) -> Iterator[int]:
    """A bare `grpc.aio` server of the `stream` handler on its own event loop (in a thread),
    listening on the port it yields until the block ends."""
    import asyncio

    import grpc

    ready, box = threading.Event(), {}

    async def serve() -> None:
        server = grpc.aio.server(options=_MESSAGE_LIMITS)
        server.add_generic_rpc_handlers([_bare_handler(stream)])
        box["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        await box["stop"].wait()
        await server.stop(0)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    ready.wait(30)
    try:
        yield box["port"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(30)


def _run_clients(target, port: int, before_start=None) -> dict:
    ctx = mp.get_context("spawn")
    line, q = StartLine(ctx, RANKS), ctx.Queue()
    procs = [ctx.Process(target=target, args=(port, line, q)) for _ in range(RANKS)]
    for p in procs:
        p.start()
    line.wait_ready()  # the clients import before the clock starts
    line.go()
    threads = before_start() if before_start else []
    res = [q.get(timeout=600) for _ in procs]
    for t in threads:
        t.join()
    for p in procs:
        p.join(30)
    t0, t1 = min(r["first"] for r in res), max(r["last"] for r in res)
    batches, nbytes = sum(r["batches"] for r in res), sum(r["bytes"] for r in res)
    return {"batches": batches, "bytes": nbytes, "seconds": t1 - t0,
            "batches_per_s": batches / (t1 - t0), "mb_per_s": nbytes / (t1 - t0) / 1e6}


# --- VLM-size batches (issue #32): chunked delivery of 10-80 MB ------------------------------

VLM_RANKS = 4
VLM_IMAGES = (2, 4, 8, 13)  # pictures per batch: 12, 25, 49 and 80 MB of uint8 patches


def _vlm_messages(images: int) -> list[bytes]:
    """One batch of `images` pictures framed as a replica frames it: a BatchHeader and chunks
    of `DEFAULT_CHUNK_BYTES` (what the references stream, again and again)."""
    from pipeline.service.chunk_framing import wire_batch
    from pipeline.service.collate import Piece, collate
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    samples = vlm_samples(images)
    arrays = collate([Piece(s) for s in samples], "padded")
    header = pb.Batch(step=0, sample_ids=[s.sample_id for s in samples], collate="padded")
    return list(wire_batch(header, arrays, DEFAULT_CHUNK_BYTES).messages())


def _rss_kb(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    """Start VmHWM (the peak RSS) afresh at the current RSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _vlm_client(kind: str, port: int, line: StartLine, q) -> None:
    """A reference client that only receives: `raw` length-prefixed messages over TCP into one
    buffer, or `grpc` a bare gRPC stream. Reports its bytes and its RSS (after the imports, and
    its peak while receiving)."""
    import grpc

    line.arrive()
    _reset_peak_rss()
    rss = _rss_kb()
    nbytes = 0
    first = None
    if kind == "raw":
        sock = socket.create_connection(("127.0.0.1", port))
        buf = memoryview(bytearray(DEFAULT_CHUNK_BYTES + 4096))
        while True:
            size = struct.unpack("<Q", _recv_exactly(sock, buf, 8))[0]
            if size == 0:
                break
            _recv_exactly(sock, buf, size)
            first = first or time.time()
            nbytes += size
        sock.close()
    else:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=_MESSAGE_LIMITS)
        for m in ch.unary_stream("/bench.Bare/Stream")(b""):
            first = first or time.time()
            nbytes += len(m)
        ch.close()
    q.put({"bytes": nbytes, "first": first, "last": time.time(), "rss_mb": rss / 1024,
           "peak_rss_mb": _rss_kb("VmHWM") / 1024})


def _recv_exactly(sock: socket.socket, buf: memoryview, size: int) -> memoryview:
    got = 0
    while got < size:
        k = sock.recv_into(buf[got:size], size - got)
        if k == 0:
            raise ConnectionError("the sender closed mid-message")
        got += k
    return buf[:size]


def _vlm_reference(kind: str, messages: list[bytes], batches: int) -> dict:
    """`batches` copies of one batch's messages to each of `VLM_RANKS` reference clients, from
    this process: raw TCP (a sender thread per client) or a bare `grpc.aio` server (as the
    service's). The sender's CPU per MB is this process's CPU over the run."""
    if kind == "raw":
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(VLM_RANKS)

        def send(conn: socket.socket) -> None:
            for _ in range(batches):
                for m in messages:
                    conn.sendall(struct.pack("<Q", len(m)))
                    conn.sendall(m)
            conn.sendall(struct.pack("<Q", 0))
            conn.close()

        def start() -> list[threading.Thread]:
            threads = [threading.Thread(target=send, args=(listener.accept()[0],))
                       for _ in range(VLM_RANKS)]
            for t in threads:
                t.start()
            return threads

        try:
            return _vlm_clients(kind, listener.getsockname()[1], start)
        finally:
            listener.close()

    async def stream(_req: bytes, _ctx):
        for _ in range(batches):
            for m in messages:
                yield m

    with _aio_server(stream) as port:
        return _vlm_clients(kind, port)


def _vlm_clients(kind: str, port: int, before_start=None) -> dict:
    ctx = mp.get_context("spawn")
    line, q = StartLine(ctx, VLM_RANKS), ctx.Queue()
    procs = [ctx.Process(target=_vlm_client, args=(kind, port, line, q))
             for _ in range(VLM_RANKS)]
    for p in procs:
        p.start()
    line.wait_ready()
    cpu0 = _cpu_s()
    line.go()
    threads = before_start() if before_start else []
    res = [q.get(timeout=600) for _ in procs]
    cpu = _cpu_s() - cpu0
    for t in threads:
        t.join()
    for p in procs:
        p.join(30)
    t0, t1 = min(r["first"] for r in res), max(r["last"] for r in res)
    mb = sum(r["bytes"] for r in res) / 1e6
    return {"mb": mb, "seconds": t1 - t0, "mb_per_s": mb / (t1 - t0),
            "sender_cpu_ms_per_mb": cpu / mb * 1e3,
            "client_rss_mb": max(r["rss_mb"] for r in res),
            "client_peak_rss_mb": max(r["peak_rss_mb"] for r in res)}


def _vlm_rank(address: str, job: str, rank: int, line: StartLine, q) -> None:
    """A trainer rank of the VLM part: `BatchStream` at its defaults (4 steps, prefetch_bytes
    256 MiB), decoding to torch. Reports the tensor bytes it took, its CPU and its RSS (after
    the imports, and its peak while streaming)."""
    import torch  # noqa: F401  (a trainer has torch loaded: its import is not delivery)

    from trainer_client import BatchStream

    line.arrive()
    _reset_peak_rss()
    rss, cpu0 = _rss_kb(), _cpu_s()
    nbytes = largest = 0
    first = None
    with BatchStream(address, job, rank, VLM_RANKS) as s:
        for batch in s:
            first = first or time.time()
            nbytes += batch.nbytes
            largest = max(largest, batch.nbytes)
    q.put({"bytes": nbytes, "first": first, "last": time.time(), "rss_mb": rss / 1024,
           "peak_rss_mb": _rss_kb("VmHWM") / 1024, "largest": largest,
           "cpu_s": _cpu_s() - cpu0, "prefetch_bytes": s.prefetch_bytes})


def _vlm_service(redis_url: str, job_id: str, images: int, batches: int) -> dict:
    """One replica serving `batches` batches of `images` pictures to each of `VLM_RANKS` rank
    processes; the job's producer is a process of its own. The replica's CPU per MB, and each
    client's peak RSS growth against its bound (prefetch_bytes + one batch + 40 MiB)."""
    job = array_job(job_id, VLM_RANKS, images * VLM_SAMPLE_TOKENS)  # `images` pictures a batch
    count = images * batches * VLM_RANKS
    producer = start_producer(redis_url, job, 0, 0, pictures=count)
    rep = Replica(redis_url, job, 0, 0, pictures=count)
    ctx = mp.get_context("spawn")
    line, q = StartLine(ctx, VLM_RANKS), ctx.Queue()
    procs = [ctx.Process(target=_vlm_rank, args=(rep.address, job_id, r, line, q))
             for r in range(VLM_RANKS)]
    for p in procs:
        p.start()
    line.wait_ready()
    cpu0 = rep.cpu()
    line.go()
    res = [q.get(timeout=900) for _ in procs]
    cpu = rep.cpu() - cpu0
    for p in procs:
        p.join(30)
    rep.stop()
    producer.stop()
    t0, t1 = min(r["first"] for r in res), max(r["last"] for r in res)
    mb = sum(r["bytes"] for r in res) / 1e6
    growth = [r["peak_rss_mb"] - r["rss_mb"] for r in res]
    bounds = [(r["prefetch_bytes"] + r["largest"]) / 2**20 + 40 for r in res]
    return {"mb": mb, "seconds": t1 - t0, "mb_per_s": mb / (t1 - t0),
            "replica_cpu_ms_per_mb": cpu / mb * 1e3,
            "client_cpu_ms_per_mb": sum(r["cpu_s"] for r in res) / mb * 1e3,
            "client_rss_mb": max(r["rss_mb"] for r in res),
            "client_peak_growth_mb": max(growth),
            "client_rss_bound_mb": min(bounds),
            "client_rss_within_bound": all(g <= b for g, b in zip(growth, bounds, strict=True))}


def vlm_delivery(redis_url: str, images: tuple[int, ...], round_mb: float, rounds: int,
                 log) -> list[dict]:
    """Per batch size: raw TCP and bare gRPC carrying the same chunked messages, and the
    service (one replica) delivering batches of that size, the median of `rounds` rounds of
    about `round_mb` MB each."""
    out = []
    for k in images:
        messages = _vlm_messages(k)
        batch_mb = sum(map(len, messages)) / 1e6
        batches = max(2, round(round_mb / VLM_RANKS / batch_mb))
        row = {"images": k, "batch_mb": batch_mb, "chunks": len(messages) - 1,
               "batches_per_rank": batches}
        for kind in ("raw", "grpc"):
            row[kind] = _median_round([_vlm_reference(kind, messages, batches)
                                       for _ in range(rounds)])
        row["service"] = _median_round([_vlm_service(redis_url, f"vlm-{k}-{i}", k, batches)
                                        for i in range(rounds)])
        row["service_vs_bare_grpc"] = row["service"]["mb_per_s"] / row["grpc"]["mb_per_s"]
        log(f"  {batch_mb:.0f} MB batches ({len(messages) - 1} chunks): raw TCP "
            f"{row['raw']['mb_per_s']:.0f} MB/s, bare gRPC {row['grpc']['mb_per_s']:.0f} MB/s, "
            f"service {row['service']['mb_per_s']:.0f} MB/s "
            f"({row['service_vs_bare_grpc']:.0%} of bare gRPC; replica "
            f"{row['service']['replica_cpu_ms_per_mb']:.2f} CPU ms/MB, bare sender "
            f"{row['grpc']['sender_cpu_ms_per_mb']:.2f}); client peak RSS growth "
            f"{row['service']['client_peak_growth_mb']:.0f} MB (bound "
            f"{row['service']['client_rss_bound_mb']:.0f})")
        out.append(row)
    return out


def vlm_main(quick: bool, out_path: Path) -> dict:
    """The VLM-size part: per batch size, the service, raw TCP and bare gRPC carrying the same
    chunked bytes. Writes delivery_vlm{,_quick}.json."""
    log = lambda m: print(m, flush=True)  # noqa: E731
    images = (2, 13) if quick else VLM_IMAGES
    log(f"VLM-size batches, {VLM_RANKS} ranks, chunks of {DEFAULT_CHUNK_BYTES >> 20} MiB ...")
    from pipeline.redis_server import LocalRedis

    with LocalRedis() as redis:
        rows = vlm_delivery(redis.url, images, 200 if quick else 1500, 1 if quick else 3, log)
    command = "python bench/delivery_bench.py --part vlm" + (" --quick" if quick else "")
    result = {"command": command,
              "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_avg_at_end": os.getloadavg()[0]},
              "ranks": VLM_RANKS, "chunk_bytes": DEFAULT_CHUNK_BYTES, "sizes": rows}
    name = "delivery_vlm_quick" if quick else "delivery_vlm"
    (out_path / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


# --- CPU per batch as W grows ----------------------------------------------------------------

def _cpu_per_batch(redis_url: str, world: int, steps: int, budget: int, max_len: int) -> dict:
    job = array_job(f"cpu-w{world}", world, budget)
    producer = start_producer(redis_url, job, steps, max_len)
    rep = Replica(redis_url, job, steps, max_len)
    ctx = mp.get_context("spawn")
    groups = [list(range(world))[i::2] for i in range(2)]
    line, q = StartLine(ctx, len(groups)), ctx.Queue()
    procs = [ctx.Process(target=consume_threads, args=(rep.address, job["job_id"], g, world,
                                                      line, q)) for g in groups]
    for p in procs:
        p.start()
    line.wait_ready()
    cpu0, t0 = rep.cpu(), time.perf_counter()
    line.go()
    outs = [q.get(timeout=900) for _ in procs]
    got = sum(o["batches"] for o in outs)
    errors = [e for o in outs for e in o["errors"]]
    cpu, wall = rep.cpu() - cpu0, time.perf_counter() - t0
    for p in procs:
        p.join(30)
    rep.stop()
    producer.stop()
    return {"world_size": world, "batches": got, "replica_cpu_s": cpu, "wall_s": wall,
            "cpu_ms_per_batch": cpu / got * 1e3, "errors": errors[:5]}


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, e, b, c) = plt.subplots(1, 4, figsize=(17, 3.8))
    d = [*result["delivery"], result["delivery_tls"]]
    names = (["raw TCP\n(same bytes)", "bare gRPC\n(same bytes)", "bare\ngrpc.aio"]
             + [f"service,\n{r['replicas']} replica(s){', TLS' if r['tls'] else ''}"
                for r in d])
    a.bar(names, [result[k]["mb_per_s"] for k in ("raw", "bare_grpc", "bare_grpc_aio")]
          + [r["mb_per_s"] for r in d],
          color=["#999", "#bbb", "#ccc", "#3a7", "#2a5", "#a73"])
    a.tick_params(axis="x", labelsize=8)
    a.set_ylabel("MB/s to 8 rank processes")
    a.set_title("delivery on loopback")
    for label, run in (("1 replica", d[0]), ("1 replica, TLS", result["delivery_tls"])):
        bottom = 0.0
        for (role, ms), color in zip(run["cpu_ms_per_batch"].items(),
                                     ["#2a5", "#c63", "#69c", "#999"], strict=False):
            e.bar([label], [ms], bottom=bottom, color=color,
                  label=f"{role} {ms:.2f}" if not run["tls"] else None)
            bottom += ms
    e.set_ylabel("CPU ms per delivered batch")
    e.set_title("where the 2 cores go")
    e.legend(fontsize=8)
    s = result["stall"]
    b.bar(["stall (all)", "after warm-up"],
          [s["stall_fraction"] * 100, s["stall_fraction_after_warmup"] * 100],
          color=["#c63", "#e96"])
    b.axhline(1.0, ls="--", color="k", lw=0.8)
    b.set_ylabel("% of trainer time waiting for data")
    b.set_title(f"trainer at half rate ({s['target_steps_per_s']:.1f} steps/s)")
    w = result["cpu_vs_world"]
    c.plot([r["world_size"] for r in w], [r["cpu_ms_per_batch"] for r in w], "o-")
    c.set_xscale("log", base=2)
    c.set_xticks([r["world_size"] for r in w], [str(r["world_size"]) for r in w])
    c.set_ylim(bottom=0)
    c.set_xlabel("ranks served by one replica")
    c.set_ylabel("replica CPU ms per delivered batch")
    c.set_title("CPU per batch vs world size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _median_round(rounds: list[dict]) -> dict:
    """The median of delivery rounds by MB/s, with every round's MB/s beside it."""
    median = sorted(rounds, key=lambda r: r["mb_per_s"])[len(rounds) // 2]
    return {**median, "rounds_mb_per_s": [r["mb_per_s"] for r in rounds]}


def _median_of_3(measure, messages: list[bytes], per_rank: int) -> dict:
    rounds = sorted((measure(messages, per_rank) for _ in range(3)), key=lambda r: r["mb_per_s"])
    return {**rounds[1], "rounds_mb_per_s": [r["mb_per_s"] for r in rounds]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a few minutes)")
    ap.add_argument("--budget", type=int, default=32768, help="token budget per batch")
    ap.add_argument("--part", choices=["all", "text", "vlm"], default="all",
                    help="text: the 289 KB text batches; vlm: 10-80 MB VLM batches in chunks")
    add_out_argument(ap, "delivery")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.part == "vlm":
        vlm_main(args.quick, out_dir(args, "delivery"))
        return 0
    from pipeline.redis_server import LocalRedis

    steps = 40 if args.quick else 360
    budget, max_len = args.budget, 1536
    log = lambda m: print(m, flush=True)  # noqa: E731
    with LocalRedis() as redis, tempfile.TemporaryDirectory(prefix="odb-bench-tls-") as tmp:
        url, redis_pid = redis.url, redis.proc.pid
        certs = Path(tmp)
        subprocess.run(["bash", str(ROOT / "deploy" / "tls" / "make-certs.sh"), str(certs)],
                       check=True, capture_output=True)
        delivery = []
        # One replica three times, plaintext and TLS alternated (the median round of each is
        # the figure: runs on 2 shared cores vary by +-15%), then two replicas once.
        for i, (n, tls) in enumerate(((1, None), (1, certs)) * 3 + ((2, None),)):
            log(f"delivery: {n} replica(s){' over TLS' if tls else ''}, {RANKS} ranks, "
                f"{steps} steps ...")
            delivery.append(_deliver(url, redis_pid, f"deliver-{i}", n, steps, budget,
                                     max_len, tls=tls))
            cpu = delivery[-1]["cpu_ms_per_batch"]
            log(f"  {delivery[-1]['mb_per_s']:.0f} MB/s, "
                f"{delivery[-1]['batches_per_s']:.0f} batches/s; CPU ms per batch: "
                + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
        plain, tls_runs = _median_round(delivery[0:6:2]), _median_round(delivery[1:6:2])
        delivery = [plain, delivery[6]]
        log("raw TCP of the same bytes ...")
        # Loopback moves these bytes in a fraction of a second: each of 3 rounds carries at
        # least ~1 GB (so the clock is not noise), and the median round is the reference.
        messages = _real_messages(budget, max_len, 64)
        per_rank = max(delivery[0]["batches"] // RANKS,
                       int(1e9 / RANKS / (sum(map(len, messages)) / len(messages))))
        raw, bare, bare_aio = (_median_of_3(f, messages, per_rank)
                               for f in (_raw, _bare_grpc, _bare_grpc_aio))
        log(f"  raw TCP {raw['mb_per_s']:.0f} MB/s, bare gRPC {bare['mb_per_s']:.0f} MB/s, "
            f"bare grpc.aio {bare_aio['mb_per_s']:.0f} MB/s")
        target = delivery[0]["batches_per_s"] / RANKS * 0.5
        log(f"stall at {target:.1f} steps/s per rank ...")
        stall = _deliver(url, redis_pid, "stall", 1, max(10, steps // 2), budget, max_len,
                         1.0 / target)
        stall["target_steps_per_s"] = target
        log(f"  stall {stall['stall_fraction']:.2%} "
            f"(after warm-up {stall['stall_fraction_after_warmup']:.2%})")
        # The same steps at every W, so each stream's set-up (open, lease, END) weighs alike.
        cpu_steps = 16 if args.quick else 48
        cpu = []
        for w in (8, 64, 256):
            log(f"CPU per batch at W={w} ({cpu_steps} steps) ...")
            cpu.append(_cpu_per_batch(url, w, cpu_steps, 4096, 512))
            log(f"  {cpu[-1]['cpu_ms_per_batch']:.2f} ms per batch")
    result = {
        "command": "python bench/delivery_bench.py" + (" --quick" if args.quick else ""),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "load_avg_at_end": os.getloadavg()[0]},
        "ranks": RANKS, "token_budget": budget, "steps": steps,
        "delivery": delivery, "raw": raw,
        "grpc_vs_raw": [d["mb_per_s"] / raw["mb_per_s"] for d in delivery],
        "bare_grpc": bare, "bare_grpc_vs_raw": bare["mb_per_s"] / raw["mb_per_s"],
        "bare_grpc_aio": bare_aio, "bare_grpc_aio_vs_raw": bare_aio["mb_per_s"] / raw["mb_per_s"],
        "service_vs_bare_grpc": delivery[0]["mb_per_s"] / bare["mb_per_s"],
        "stall": stall, "cpu_vs_world": cpu,
        "delivery_tls": tls_runs,
        "tls_vs_plaintext": {
            "mb_per_s": tls_runs["mb_per_s"] / plain["mb_per_s"],
            "cpu_ms_per_batch": {k: tls_runs["cpu_ms_per_batch"][k] / v if v else None
                                 for k, v in plain["cpu_ms_per_batch"].items()}},
    }
    out_path = out_dir(args, "delivery")
    name = "delivery_bench_quick" if args.quick else "delivery_bench"
    (out_path / f"{name}.json").write_text(json.dumps(result, indent=2))
    _plot(result, out_path / f"{name}.png")
    print(json.dumps({"mb_per_s": [d["mb_per_s"] for d in delivery],
                      "raw_mb_per_s": raw["mb_per_s"], "grpc_vs_raw": result["grpc_vs_raw"],
                      "bare_grpc_mb_per_s": bare["mb_per_s"],
                      "bare_grpc_aio_mb_per_s": bare_aio["mb_per_s"],
                      "service_vs_bare_grpc": result["service_vs_bare_grpc"],
                      "cpu_ms_per_batch_1_replica": delivery[0]["cpu_ms_per_batch"],
                      "tls_mb_per_s": tls_runs["mb_per_s"],
                      "cpu_ms_per_batch_1_replica_tls": tls_runs["cpu_ms_per_batch"],
                      "tls_vs_plaintext": result["tls_vs_plaintext"],
                      "stall_after_warmup": stall["stall_fraction_after_warmup"],
                      "cpu_ms_per_batch": {c["world_size"]: c["cpu_ms_per_batch"] for c in cpu}},
                     indent=2))
    if args.part == "all":
        vlm_main(args.quick, out_dir(args, "delivery"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
