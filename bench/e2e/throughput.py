"""Training throughput of the three contenders on one workload, side by side.

- standard: `torch.utils.data.DataLoader`, fixed batch size B = budget // p99(length) (its peak
  padded tokens match the budget), input order, 1 worker process, prefetch 4.
- peer: `online-dynamic-batching` 0.1.2 `ODBDataLoader` (its single-process path: no
  torch.distributed; worker process + its collate process), same budget and buffer as ours.
- ours: odb-pipeline service in its own process (ArraySource, the planner, padded collate on
  the server) -> gRPC on loopback -> `trainer_client.BatchStream` (prefetch 4).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from e2e.common import (
    SampleDataset,
    Workload,
    eval_loss,
    job_config_dict,
    pad_collate,
    service_overrides,
    train,
)
from e2e.serve import ServiceProcess

METHODS = ("standard", "peer", "ours")


def standard_batches(w: Workload) -> Callable[[], Iterator[dict]]:
    from torch.utils.data import DataLoader

    def make():
        dl = DataLoader(SampleDataset(w.train), batch_size=w.standard_batch, shuffle=False,
                        num_workers=1, prefetch_factor=4, collate_fn=pad_collate)
        yield from dl

    return make


def peer_batches(w: Workload, buffer: int) -> Callable[[], Iterator[dict]]:
    logging.getLogger("odb").setLevel(logging.WARNING)

    def make():
        from odb import ODBDataLoader

        # no_warmup: skip its per-epoch ramp of the buffer (0 -> buffer_size over 20 rounds),
        # which would dominate runs this short; the setting most favourable to the peer.
        dl = ODBDataLoader(SampleDataset(w.train), token_budget=w.budget, buffer_size=buffer,
                           num_workers=1, prefetch_factor=4, collate_fn=pad_collate,
                           no_warmup=True)
        yield from dl

    return make


def ours_batches(svc: ServiceProcess, w: Workload, buffer: int,
                 meta: dict) -> Callable[[], Iterator[dict]]:
    def make():
        from trainer_client import BatchStream

        job = f"e2e-{w.name}"
        overrides = service_overrides([job_config_dict(job, 1, w.budget, buffer, "unused")])
        addr = svc.start(overrides, samples={job: w.train})
        try:
            with BatchStream(addr, job, 0, 1, prefetch=4) as stream:
                while not stream.done:
                    yield from stream
        finally:
            with contextlib.suppress(Exception):
                meta["server"] = svc.stop()

    return make


def run_workload(w: Workload, svc: ServiceProcess, buffer: int, reps: int, order: list[str],
                 log) -> dict:
    """`reps` rounds; the contenders' order alternates between rounds (ABC, CBA, ...)."""
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for r in range(reps):
        seq = order if r % 2 == 0 else order[::-1]
        for m in seq:
            meta: dict = {}
            if m == "standard":
                src = standard_batches(w)
            elif m == "peer":
                src = peer_batches(w, buffer)
            else:
                src = ours_batches(svc, w, buffer, meta)
            res = train(src, f"{w.name} {m} (round {r + 1})", log)
            model = res.pop("model")
            res["eval_loss"] = eval_loss(model, w.held_out, w.budget)
            res.update(meta)
            runs[m].append(res)
    return runs
