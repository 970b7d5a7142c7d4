"""Serving replicas and many-rank consumers as separate processes, for the benchmarks.

`Replica` runs `start_service` in a process of its own (as deployed) over a shared Redis, for a
job whose samples are synthetic token arrays every replica builds alike (deterministic seed):
what is measured is serving, not preprocessing. One producer plans the job (its lease); any
replica serves any rank. `consume_threads` is many ranks as threads of one process, taking
batches as fast as they come.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import threading
import time


def array_job(job_id: str, world: int, budget: int) -> dict:
    return {"job_id": job_id, "world_size": world, "source": {"paths": ["arrays"]},
            "batching": {"token_budget": budget, "max_window_samples": 512, "pool_steps": 1}}


def job_samples(world: int, steps: int, budget: int, max_len: int):
    """About `steps` steps' worth of samples of `max_len // 3 .. max_len` tokens."""
    from pipeline.preprocess.array_source import synthetic_samples

    mean = (max_len // 3 + max_len) / 2
    return synthetic_samples(max(world, int(steps * world * budget / mean * 0.8)),
                             min_len=max_len // 3, max_len=max_len, seed=7)


# VLM samples: one 1024 x 1024 picture each (the default image_max_pixels: a 72 x 72 patch grid,
# 5,184 uint8 patches, 6.1 MB) and a short text.
VLM_GRID = (1, 72, 72)
VLM_TEXT_TOKENS = 40
VLM_SAMPLE_TOKENS = VLM_GRID[1] * VLM_GRID[2] // 4 + VLM_TEXT_TOKENS


def vlm_samples(count: int) -> list:
    """`count` one-picture samples as preprocessing makes them (uint8 patches, Qwen2-VL layout);
    every sample shares one deterministic picture's patches (what is measured is delivery)."""
    import numpy as np

    from pipeline.preprocess.sample import ProcessedSample

    t, h, w = VLM_GRID
    visual = t * h * w // 4
    pixels = np.random.default_rng(3).integers(0, 256, (t * h * w, 1176), dtype=np.uint8)
    grid = np.array([VLM_GRID], np.int64)
    out = []
    for row in range(count):
        ids = np.full(VLM_SAMPLE_TOKENS, 151655, np.int32)  # <|image_pad|> ...
        ids[visual:] = np.arange(VLM_TEXT_TOKENS, dtype=np.int32) + 1000 + row
        labels = ids.copy()
        labels[:visual] = -100
        out.append(ProcessedSample(f"vlm:{row}", "vlm", row, ids, labels,
                                   num_visual_tokens=visual, cost=len(ids),
                                   pixel_values=pixels, image_grid_thw=grid))
    return out


def _replica(redis_url: str, job: dict, steps: int, max_len: int, extra: dict, pictures: int,
             conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from pipeline.config import ServiceConfig
    from pipeline.preprocess.array_source import ArraySource
    from pipeline.service.server import start_service

    cfg = ServiceConfig.model_validate({
        "redis_url": redis_url, "metrics_port": None,
        "grpc": {"host": "127.0.0.1", "port": 0, "max_message_mb": 256}, "jobs": [job],
        **extra})
    source = ArraySource(vlm_samples(pictures) if pictures else job_samples(
        job["world_size"], steps, job["batching"]["token_budget"], max_len))
    svc = start_service(cfg, sample_sources={job["job_id"]: source})
    conn.send(svc.port)
    while True:
        cmd = conn.recv()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        if cmd == "cpu":
            conn.send(ru.ru_utime + ru.ru_stime)
        elif cmd == "published":
            conn.send(svc.runtimes[job["job_id"]].state.published_through())
        elif cmd == "stop":
            fetched = svc.runtimes[job["job_id"]].payloads.fetched_by_rank()
            svc.stop(grace=0.5)
            conn.send({"cpu_s": ru.ru_utime + ru.ru_stime, "fetched_by_rank": fetched})
            return


class Replica:
    """One serving replica process; `address` once it listens. `pictures`: serve that many
    VLM samples (`vlm_samples`) instead of text ones."""

    def __init__(self, redis_url: str, job: dict, steps: int, max_len: int, pictures: int = 0,
                 **service: object) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_replica,
                                args=(redis_url, job, steps, max_len, service, pictures, child),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(300):
            raise RuntimeError("replica did not start")
        self.address = f"127.0.0.1:{self.conn.recv()}"

    def cpu(self) -> float:
        """CPU seconds the replica process used so far."""
        self.conn.send("cpu")
        return self.conn.recv()

    def published_through(self) -> int:
        """The job's last published step as this replica's state reads it (-1: none yet)."""
        self.conn.send("published")
        return self.conn.recv()

    def stop(self) -> dict:
        self.conn.send("stop")
        out = self.conn.recv()
        self.proc.join(30)
        return out


def start_producer(redis_url: str, job: dict, steps: int, max_len: int,
                   pictures: int = 0) -> Replica:
    """As deployed, a job's producer is a process of its own (a Ray actor there): a replica no
    rank connects to, started first, takes the job's lease and plans; replicas started after it
    only serve. Returns once it has published."""
    producer = Replica(redis_url, job, steps, max_len, pictures)
    while producer.published_through() < 0:
        time.sleep(0.05)
    return producer


class StartLine:
    """Consumer processes that start the clock together, once every one has done its imports.
    A fixed sleep is no substitute: on 2 busy cores, 8 processes importing torch can take
    longer than any guess and then overlap the measured window."""

    def __init__(self, ctx, parties: int) -> None:
        self.parties = parties
        self._arrived, self._go = ctx.Queue(), ctx.Event()

    def arrive(self) -> None:
        """In a consumer: ready; wait for the start."""
        self._arrived.put(os.getpid())
        self._go.wait()

    def wait_ready(self, timeout: float = 600.0) -> None:
        for _ in range(self.parties):
            self._arrived.get(timeout=timeout)

    def go(self) -> None:
        self._go.set()


def consume_threads(address: str, job: str, ranks: list[int], world: int, line: StartLine,
                    q) -> None:
    """Each rank in a thread, reading its stream to the end; puts the batches taken."""
    from trainer_client import BatchStream

    line.arrive()
    counts: dict[int, int] = {}
    errors: list[str] = []

    def one(rank: int) -> None:
        try:
            with BatchStream(address, job, rank, world, prefetch=4) as s:
                counts[rank] = sum(1 for _ in s)
        except Exception as exc:  # reported, not hidden: the run is then invalid
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q.put({"batches": sum(counts.values()), "errors": errors})
