"""Scaling: Ray preprocessing with 1 vs 2 workers, and a simulated many-rank job.

Ray: `pipeline.preprocess.pipeline.iter_samples` in a fresh process per setting with
`ray.init(num_cpus=k)` and `concurrency=k`, one cold and one warm epoch.
Many ranks: one job with W ranks served by the service process; consumers are lightweight
threads (no model) in a few processes, taking batches as fast as the server sends them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import resource
import threading
import time

from e2e.common import job_config_dict, service_overrides
from e2e.serve import ServiceProcess


def _ray_child(k: int, path: str, chunk_rows: int, q) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import logging

    logging.basicConfig(level=logging.WARNING)
    try:
        import ray

        from pipeline.config import load_config
        from pipeline.preprocess.pipeline import iter_samples
        from pipeline.preprocess.sample import ProcessedSample

        cfg = load_config(environ={}, overrides={"jobs": [
            job_config_dict("ray-scale", 1, 16384, 1024, path)]})
        t0 = time.perf_counter()
        ray.init(num_cpus=k, include_dashboard=False, log_to_driver=False,
                 _temp_dir=f"/tmp/odb_e2e_ray_{os.getpid()}")
        init_s = time.perf_counter() - t0
        out = {"workers": k, "ray_init_s": init_s}
        for phase in ("cold", "warm"):
            t0 = time.perf_counter()
            first = None
            n = tok = 0
            for it in iter_samples(cfg.jobs[0], 0, chunk_rows=chunk_rows, concurrency=k):
                if first is None:
                    first = time.perf_counter() - t0
                if isinstance(it, ProcessedSample):
                    n += 1
                    tok += it.num_tokens
            wall = time.perf_counter() - t0
            out[phase] = {"samples": n, "tokens": tok, "wall_s": wall, "first_item_s": first,
                          "samples_per_s": n / wall, "tokens_per_s": tok / wall,
                          "steady_samples_per_s": n / (wall - first) if first else None}
        ray.shutdown()
        q.put(out)
    except Exception as exc:
        q.put({"workers": k, "error": f"{type(exc).__name__}: {exc}"})


def ray_workers(path: str, settings: list[int], chunk_rows: int, log) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = []
    for k in settings:
        q = ctx.Queue()
        p = ctx.Process(target=_ray_child, args=(k, path, chunk_rows, q), daemon=True)
        p.start()
        try:
            res = q.get(timeout=600)
        except Exception as exc:
            res = {"workers": k, "error": f"no result: {exc}"}
        p.join(30)
        if p.is_alive():
            p.terminate()
        log(f"    ray {k} worker(s): " + (res.get("error") or
            f"warm {res['warm']['samples_per_s']:.0f} samples/s, cold "
            f"{res['cold']['samples_per_s']:.0f} samples/s (first row "
            f"{res['cold']['first_item_s']:.1f} s)"))
        out.append(res)
    return out


def _consumer(addr: str, job: str, ranks: list[int], world: int, deadline_s: float, q) -> None:
    from trainer_client import BatchStream

    res: dict = {}
    lock = threading.Lock()
    t_start = time.perf_counter()
    deadline = t_start + deadline_s

    streams: dict[int, BatchStream] = {}

    def one(rank: int) -> None:
        first = last = None
        n = steps = nbytes = 0
        err = None
        try:
            with BatchStream(addr, job, rank, world, prefetch=4) as s:
                with lock:
                    streams[rank] = s
                while not s.done and time.perf_counter() < deadline:
                    for b in s:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        steps += 1
                        n += b.info.rank_samples
                        nbytes += sum(t.numel() * t.element_size() for t in b.values())
                        if now > deadline:
                            break
        except Exception as exc:  # after the deadline the watchdog closed the stream: not an error
            if time.perf_counter() < deadline:
                err = f"{type(exc).__name__}: {exc}"
        r = {"steps": steps, "samples": n, "bytes": nbytes, "first": first, "last": last}
        if err:
            r["error"] = err
        with lock:
            res[rank] = r

    def watchdog() -> None:  # a rank blocked waiting for a batch is closed at the deadline
        time.sleep(max(0.0, deadline - time.perf_counter()))
        with lock:
            live = list(streams.values())
        for s in live:
            with contextlib.suppress(Exception):
                s.close()

    threading.Thread(target=watchdog, daemon=True).start()
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    q.put({"ranks": res, "cpu_s": ru.ru_utime + ru.ru_stime,
           "wall_s": time.perf_counter() - t_start, "t_start": t_start})


def many_ranks(svc: ServiceProcess, world: int, samples: list, budget: int, buffer: int,
               procs: int, redis_url: str | None, log,
               redis_max_connections: int | None = None, deadline_s: float = 60.0) -> dict:
    job = f"sim-w{world}"
    overrides = service_overrides([job_config_dict(job, world, budget, buffer, "unused")])
    overrides["redis_url"] = redis_url
    t0 = time.perf_counter()
    addr = svc.start(overrides, samples={job: samples},
                     redis_max_connections=redis_max_connections)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    groups = [list(range(world))[i::procs] for i in range(procs)]
    ps = [ctx.Process(target=_consumer, args=(addr, job, g, world, deadline_s, q), daemon=True)
          for g in groups]
    for p in ps:
        p.start()
    outs = [q.get(timeout=900) for _ in ps]
    for p in ps:
        p.join(30)
    wall = time.perf_counter() - t0
    prof = svc.stop()
    ranks = {}
    for o in outs:
        ranks.update(o["ranks"])
    ok = [r for r in ranks.values() if "error" not in r]
    errors = sorted({r["error"] for r in ranks.values() if "error" in r})
    firsts = [r["first"] for r in ok if r["first"]]
    lasts = [r["last"] for r in ok if r["last"]]
    # perf_counter is system-wide monotonic on Linux: comparable across processes.
    complete = sum(r["samples"] for r in ok) == len(samples)
    span = (max(lasts) - min(firsts)) if firsts else 0.0
    if not complete:  # stopped at the deadline: rate over the whole time the ranks waited
        span = deadline_s
    steps = max((r["steps"] for r in ok), default=0)
    n = sum(r["samples"] for r in ok)
    nbytes = sum(r["bytes"] for r in ok)
    state = "memory"
    if redis_url:
        state = "redis" + (f" (pool {redis_max_connections})" if redis_max_connections else "")
    res = {"world_size": world, "state": state,
           "consumer_processes": procs, "samples_in": len(samples), "samples": n,
           "batches": sum(r["steps"] for r in ok), "steps": steps,
           "first_batch_s": (min(firsts) - t0) if firsts else None,
           "stream_span_s": span, "wall_s": wall,
           "steps_per_s": steps / span if span else 0.0,
           "samples_per_s": n / span if span else 0.0,
           "mb_per_s": nbytes / span / 1e6 if span else 0.0,
           "consumer_cpu_s": sum(o["cpu_s"] for o in outs), "errors": errors, "server": prof,
           "epoch_complete": complete, "deadline_s": deadline_s}
    log(f"    W={world} ({res['state']} state): {steps} steps, {n} samples in {span:.1f} s "
        f"= {res['steps_per_s']:.1f} steps/s, {res['samples_per_s']:.0f} samples/s, "
        f"{res['mb_per_s']:.0f} MB/s" + ("" if complete else f" (stopped at {deadline_s:.0f} s)")
        + (f"; errors: {errors[:2]}" if errors else ""))
    return res
