"""The odb-pipeline service in its own process (as deployed: not in the trainer's process).

`ServiceProcess` spawns a worker that runs `start_service` on loopback and answers commands
over a pipe. The worker wraps the data plane's stages with CPU/wall timers (planner feed,
step publication, payload collate, tensor encode, whole batch build, source reads) so a run
can say where the server's time goes; what is left of the process CPU is gRPC + protobuf
serialization + the servicer's Python.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import resource
import threading
import time
from typing import Any

_PROF: dict[str, list[float]] = {}
_LOCK = threading.Lock()


def _acc(name: str, cpu: float, wall: float) -> None:
    with _LOCK:
        row = _PROF.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += cpu
        row[2] += wall


def _wrap(fn, name: str):
    def timed(*a, **k):
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _acc(name, time.thread_time() - c0, time.perf_counter() - w0)

    timed.__wrapped__ = fn
    return timed


def _install_timers() -> None:
    """Wrap whichever hooks this version of the data plane has (the code moves under us)."""
    from pipeline.planner import step_planner
    from pipeline.service import collate, job_runtime

    hooks = [
        (step_planner.StepPlanner, "feed", "planner_feed"),
        (step_planner.StepPlanner, "end_epoch", "planner_feed"),
        (collate, "collate", "collate"),
        (job_runtime, "encode_into", "encode"),  # older runtime: protobuf fields per tensor
        (job_runtime, "batch_message_bytes", "encode"),  # newer: hand-framed message bytes
        (job_runtime.JobRuntime, "build_message", "build_message"),
        (job_runtime.JobRuntime, "_handle", "publish"),
        (job_runtime.JobRuntime, "_wait_for_room", "flow_control"),
        (job_runtime.JobRuntime, "_checkpoint", "planner_checkpoint"),
    ]
    for owner, attr, name in hooks:
        fn = getattr(owner, attr, None)
        if fn is not None:
            setattr(owner, attr, _wrap(fn, name))


class _TimedSource:
    """Times every `next()` on the wrapped source (Ray: waiting for preprocessed rows)."""

    def __init__(self, src) -> None:
        self._src = src

    def iter_epoch(self, epoch: int, start_row: int = 0):
        it = iter(self._src.iter_epoch(epoch, start_row))
        while True:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                _acc("source", time.thread_time() - c0, time.perf_counter() - w0)
            yield item

    def get(self, sample_id: str, epoch: int):
        return self._src.get(sample_id, epoch)

    def close(self) -> None:
        self._src.close()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _threads_cpu() -> dict[int, float]:
    """CPU seconds per live thread of this process (Linux /proc), by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def _thread_groups(base: dict[int, float]) -> dict[str, float]:
    """CPU since `base`, grouped: gRPC handler pool (Python: batch build, protobuf
    serialization, send), producer (source -> planner -> publish), gRPC C-core threads, other.
    Threads that already exited are missing (the producer exits at the end of the job)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    groups: dict[str, float] = {}
    for tid, cpu in _threads_cpu().items():
        name = names.get(tid)
        if name is None:
            g = "grpc core (C threads)"
        elif name.startswith("odb"):
            g = "grpc handler pool (Python)"
        elif name.startswith("producer"):
            g = "producer"
        else:
            g = "other Python threads"
        groups[g] = groups.get(g, 0.0) + cpu - base.get(tid, 0.0)
    return groups


def _worker(conn) -> None:  # runs in the spawned process
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import logging

    logging.basicConfig(level=logging.WARNING)
    from pipeline.config import load_config
    from pipeline.preprocess.array_source import ArraySource
    from pipeline.producer.actor import stop_producer
    from pipeline.redis_client import connect
    from pipeline.redis_server import LocalRedis
    from pipeline.service.server import start_service

    _install_timers()
    svc = None
    redis_server = None  # Ray jobs keep their state in Redis: their producer is an actor
    ray_started = False
    cpu0 = wall0 = 0.0
    tbase: dict[int, float] = {}
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "ray_init":
                import ray

                from pipeline.ray_runtime import warm_workers_env

                os.environ.update(warm_workers_env(arg))  # as serve's private Ray starts
                ray.init(num_cpus=arg, include_dashboard=False, log_to_driver=False,
                         _temp_dir=f"/tmp/odb_e2e_ray_{os.getpid()}")
                ray_started = True
                conn.send(("ok", None))
            elif cmd == "ray_warm":
                # One small epoch through Ray Data so its workers have imported transformers and
                # loaded the tokenizer (a long-running service's steady state).
                from pipeline.preprocess.pipeline import iter_samples

                cfg = load_config(environ={}, overrides=arg)
                n = sum(1 for _ in iter_samples(cfg.jobs[0], 0, limit=512))
                conn.send(("ok", n))
            elif cmd == "start":
                cfg = load_config(environ={}, overrides=arg["overrides"])
                sources = {job_id: _TimedSource(ArraySource(samples))
                           for job_id, samples in arg.get("samples", {}).items()}
                if not cfg.redis_url and any(j.job_id not in sources for j in cfg.jobs):
                    if redis_server is None:
                        redis_server = LocalRedis().start()
                    connect(redis_server.url).flushall()
                    cfg = cfg.model_copy(update={"redis_url": redis_server.url})
                with _LOCK:
                    _PROF.clear()
                states = {}
                if cfg.redis_url and arg.get("redis_max_connections"):
                    # Our own client: redis-py's default pool stops at 100 connections, fewer
                    # than one server's concurrent rank streams at W=256.
                    import redis

                    from pipeline.coordinator import RedisJobState

                    client = redis.Redis.from_url(
                        cfg.redis_url, max_connections=arg["redis_max_connections"],
                        socket_timeout=5.0, socket_connect_timeout=5.0)
                    states = {j.job_id: RedisJobState.connect(client, j) for j in cfg.jobs}
                cpu0, wall0 = _cpu(), time.perf_counter()
                tbase = _threads_cpu()
                svc = start_service(cfg, sample_sources=sources, job_states=states)
                conn.send(("ok", svc.address))
            elif cmd == "stop":
                prof = _stop_profile(cpu0, wall0)
                prof["threads"] = _thread_groups(tbase)
                if svc is not None and ray_started:
                    prof["producer_peak_rss_mb"] = _producer_peaks(svc.runtimes)
                if svc is not None:
                    svc.stop(grace=0.5)
                    if ray_started:
                        for job_id in svc.runtimes:
                            stop_producer(job_id)
                    svc = None
                conn.send(("ok", prof))
            elif cmd == "exit":
                if svc is not None:
                    svc.stop(grace=0.5)
                if ray_started:
                    import ray

                    ray.shutdown()
                if redis_server is not None:
                    redis_server.cleanup()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception as exc:  # report, keep serving commands
            import traceback

            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _producer_peaks(job_ids) -> dict[str, float | None]:
    """Each Ray job's producer actor's peak resident memory (VmHWM, MB), if it still runs."""
    import ray

    from pipeline.producer.actor import find_producer

    out: dict[str, float | None] = {}
    for job_id in job_ids:
        actor = find_producer(job_id)
        out[job_id] = None
        if actor is None:
            continue
        try:
            pid = ray.get(actor.info.remote(), timeout=10)["pid"]
            with open(f"/proc/{pid}/status") as fh:
                kb = next(int(ln.split()[1]) for ln in fh if ln.startswith("VmHWM:"))
            out[job_id] = kb / 1024
        except Exception:  # it ended (planned, payloads released): no figure
            continue
    return out


def _stop_profile(cpu0: float, wall0: float) -> dict[str, Any]:
    with _LOCK:
        stages = {k: {"calls": int(v[0]), "cpu_s": v[1], "wall_s": v[2]}
                  for k, v in _PROF.items()}
    return {"process_cpu_s": _cpu() - cpu0, "wall_s": time.perf_counter() - wall0,
            "stages": stages}


class ServiceProcess:
    """Handle on the spawned service process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child,), daemon=True, name="odb-service")
        self._proc.start()

    def call(self, cmd: str, arg: Any = None, timeout: float = 600.0) -> Any:
        self._conn.send((cmd, arg))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"service process: no answer to {cmd} in {timeout} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"service process failed on {cmd}: {value}")
        return value

    def start(self, overrides: dict, samples: dict | None = None,
              redis_max_connections: int | None = None) -> str:
        return self.call("start", {"overrides": overrides, "samples": samples or {},
                                   "redis_max_connections": redis_max_connections})

    def stop(self) -> dict:
        return self.call("stop")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("exit", timeout=30)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
