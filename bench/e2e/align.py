"""Per-step alignment cost: an all_gather of per-rank token counts (what an in-trainer ODB needs
every step to agree on step totals / loss scale) in torch.distributed gloo, W processes on this
machine. odb-pipeline's ranks run no collective for this: the step totals and the END arrive in
band with the batch (measured separately: the trainer-side cost of taking a prefetched batch).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

from pipeline.redis_server import free_port


def _rank(rank: int, world: int, port: int, iters: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mine = torch.tensor([1000 + rank], dtype=torch.int64)
    outs = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    for _ in range(20):
        dist.all_gather(outs, mine)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_gather(outs, mine)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put(times)


def all_gather_cost(world: int, iters: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=_rank, args=(r, world, port, iters, q), daemon=True)
          for r in range(world)]
    for p in ps:
        p.start()
    times = np.array(q.get(timeout=300)) * 1e6
    for p in ps:
        p.join(30)
    return {"world_size": world, "iters": iters, "p50_us": float(np.median(times)),
            "p99_us": float(np.percentile(times, 99)), "mean_us": float(times.mean())}
