"""Data stall: the fraction of a rank's wall time spent waiting for its next batch.

W rank streams (threads of this process) consume one job of the service. Each rank simulates
its accelerator: after taking a batch it sleeps `padded_tokens / device_tokens_per_s` (a
device does not use the host CPU, so the host's cores stay with the data plane, as on a
GPU node). The rate is the tiny model's measured CPU speed ("1x") or a 10x faster device.
"""

from __future__ import annotations

import threading
import time

from e2e.common import job_config_dict, service_overrides
from e2e.serve import ServiceProcess


def _rank(addr: str, job: str, rank: int, world: int, tok_s: float, deadline: float,
          out: list) -> None:
    from trainer_client import BatchStream

    waits: list[float] = []
    samples = 0
    t_open = time.perf_counter()
    t_end = t_open
    try:
        with BatchStream(addr, job, rank, world, prefetch=4) as stream:
            it = iter(stream)
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    b = next(it)
                except StopIteration:
                    break
                waits.append(time.perf_counter() - t0)
                samples += int(b["input_ids"].shape[0])
                time.sleep(b["input_ids"].numel() / tok_s)
                t_end = time.perf_counter()
    except Exception as exc:  # reported, not raised: other ranks keep their numbers
        out[rank] = {"error": f"{type(exc).__name__}: {exc}"}
        return
    wall = t_end - t_open
    first = waits[0] if waits else 0.0
    out[rank] = {"steps": len(waits), "samples": samples, "wall_s": wall, "first_batch_s": first,
                 "stall": sum(waits) / wall if wall > 0 else 1.0,
                 "steady_stall": (sum(waits) - first) / (wall - first) if wall > first else 1.0}


def run_stall(svc: ServiceProcess, world: int, budget: int, buffer: int, tok_s: float,
              duration: float, data_path: str | None = None, samples: list | None = None,
              label: str = "", shuffle: bool | None = None) -> dict:
    job = f"stall-w{world}"
    overrides = service_overrides([job_config_dict(job, world, budget, buffer,
                                                   data_path or "unused", shuffle=shuffle)])
    addr = svc.start(overrides, samples={job: samples} if samples is not None else None)
    out: list = [None] * world
    deadline = time.perf_counter() + duration
    threads = [threading.Thread(target=_rank, args=(addr, job, r, world, tok_s, deadline, out))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + 120)
    prof = svc.stop()
    ok = [r for r in out if r and "error" not in r]
    errors = [r["error"] for r in out if r and "error" in r]

    def mean(k: str) -> float:
        return sum(r[k] for r in ok) / len(ok) if ok else float("nan")

    wall = max((r["wall_s"] for r in ok), default=0.0)
    return {"label": label, "world_size": world, "device_tokens_per_s": tok_s,
            "duration_s": duration, "stall": mean("stall"), "steady_stall": mean("steady_stall"),
            "first_batch_s": mean("first_batch_s"),
            "steps_per_rank": mean("steps"), "samples": sum(r["samples"] for r in ok),
            "samples_per_s": sum(r["samples"] for r in ok) / wall if wall else 0.0,
            "errors": errors, "server": prof}
