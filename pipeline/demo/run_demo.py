"""Run the whole system locally: embedded Redis, local Ray, the service, N real trainer ranks.

The ranks are separate processes running gloo DDP (`pipeline.demo.train_rank`); they talk to the
service only over gRPC, as they would on a cluster. Every rank writes a per-step log; the report
(`pipeline.demo.report`) is computed from those logs alone. Progress names each phase
(`pipeline.demo.progress`); while it runs the service is recorded for `odb-pipeline status`
(`pipeline.local_services`, under the state dir `ODB_STATE_DIR` names, else the default).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import ENV_PREFIX, ServiceConfig, load_config
from pipeline.demo.ctrl_c import CtrlC
from pipeline.demo.progress import Measure, Progress, preprocessing_measure, training_measure
from pipeline.local_services import LocalService
from pipeline.redis_server import LocalRedis, free_port

DEMO_JOB = "demo"
TOKEN_ENV = "ODB_DEMO_TOKEN"


@dataclass
class DemoOptions:
    data: list[str]
    out_dir: Path
    ranks: int = 2
    token_budget: int = 4096
    max_window_samples: int = 128
    pool_steps: int = 4  # small balancing pool: the first step streams after ~130 samples
    collate: str = "padded"
    epochs: int = 1
    seed: int = 0
    standard: bool = False
    redis_url: str | None = None
    rank_timeout_s: float = 600.0
    extra_env: dict[str, str] = field(default_factory=dict)


def demo_config(opts: DemoOptions, redis_url: str) -> ServiceConfig:
    # The demo's own settings, whatever ODB_* says, but the state dir where `status` looks.
    state_env = {k: v for k, v in os.environ.items() if k == f"{ENV_PREFIX}STATE_DIR"}
    return load_config(environ=state_env, overrides={
        "redis_url": redis_url,
        "metrics_port": 0,
        "grpc": {"host": "127.0.0.1", "port": 0},
        "ray": {"num_cpus": 2},
        "jobs": [{
            "job_id": DEMO_JOB,
            "token_env": TOKEN_ENV,
            "world_size": opts.ranks,
            "mode": "join",
            "seed": opts.seed,
            "epochs": opts.epochs,
            "source": {"paths": opts.data},
            "batching": {"token_budget": opts.token_budget,
                         "max_window_samples": opts.max_window_samples,
                         "pool_steps": opts.pool_steps, "collate": opts.collate,
                         "over_budget": "truncate"},
        }],
    })


def _spawn_ranks(opts: DemoOptions, log_dir: Path, extra: list[str],
                 procs: list[subprocess.Popen], ctrl_c: CtrlC) -> None:
    """Start the trainer ranks into `procs` (each held there before Ctrl-C can cut in)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, **opts.extra_env, "OMP_NUM_THREADS": "1"}
    procs.clear()
    for rank in range(opts.ranks):
        cmd = [sys.executable, "-m", "pipeline.demo.train_rank", "--rank", str(rank),
               "--world-size", str(opts.ranks), "--master-port", str(port),
               "--log", str(log_dir / f"rank{rank}.jsonl"), *extra]
        with ctrl_c.held(), open(log_dir / f"rank{rank}.stderr", "w") as err:
            procs.append(subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT))


def _stop_ranks(procs: list[subprocess.Popen]) -> None:
    for p in procs:  # Ctrl-C or a failure: no trainer rank outlives the demo
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _watch(procs: list[subprocess.Popen], log_dir: Path, label: str, timeout_s: float,
           progress: Progress, measures: Callable[[int], list[Measure]]) -> None:
    """Show the measured phases (`measures(samples trained)`) until every rank exits."""
    deadline = time.monotonic() + timeout_s
    with progress.bars(label) as bars:
        while True:
            bars.show(measures(sum(_count_samples(p) for p in log_dir.glob("rank*.jsonl"))))
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                _stop_ranks(procs)
                bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
                tail = ""
                if bad:
                    tail = (log_dir / f"rank{bad[0]}.stderr").read_text()[-2000:]
                raise RuntimeError(f"{label}: trainer rank(s) {bad or 'timeout'} failed\n{tail}")
            time.sleep(0.5)
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = (log_dir / f"rank{bad[0]}.stderr").read_text()[-2000:]
        raise RuntimeError(f"{label}: trainer rank(s) {bad} exited non-zero\n{tail}")


def _count_samples(path: Path) -> int:
    n = 0
    with path.open() as f:
        for line in f:
            if line.endswith("\n"):
                n += len(json.loads(line)["sample_ids"])
    return n


def _source_rows(paths: list[str]) -> int:
    return sum(sum(1 for _ in open(p, "rb")) for p in paths)


def _standard_batches(samples: list, opts: DemoOptions, path: Path) -> int:
    """Fixed-size batches (size by the p99 length, as people pick it), sharded like
    DistributedSampler (round robin, padded by repeating so every rank has as many steps)."""
    import numpy as np
    import torch

    from pipeline.service.collate import Piece, collate

    lengths = np.array([s.num_tokens for s in samples])
    batch_size = max(1, int(opts.token_budget // max(1, np.percentile(lengths, 99))))
    per_rank = -(-len(samples) // opts.ranks)
    padded = samples + samples[: per_rank * opts.ranks - len(samples)]
    ranks = []
    for r in range(opts.ranks):
        mine = padded[r::opts.ranks]
        batches = []
        for i in range(0, len(mine), batch_size):
            chunk = mine[i:i + batch_size]
            tensors = collate([Piece(s) for s in chunk], "padded")
            batches.append({"tensors": tensors, "sample_ids": [s.sample_id for s in chunk],
                            "step_samples": len(chunk) * opts.ranks})
        ranks.append(batches)
    torch.save({"batch_size": batch_size, "ranks": ranks}, path)
    return batch_size


def run_demo(opts: DemoOptions, ctrl_c: CtrlC) -> dict:
    """Run ODB (and, with `standard`, the fixed-size baseline); return the report dict.

    Everything started is stopped on the way out, Ctrl-C included (`ctrl_c` holds it off
    while a child is being started and during the cleanup)."""
    from pipeline import local_services
    from pipeline.demo.report import build_report, write_outputs
    from pipeline.observability import start_metrics_server
    from pipeline.ray_runtime import PrivateRay
    from pipeline.service.server import start_service

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    token = os.urandom(16).hex()
    opts.extra_env[TOKEN_ENV] = token
    progress = Progress()
    procs: list[subprocess.Popen] = []
    runs: dict[str, dict] = {}
    # Stopped in reverse order: ranks, the status record, the service, Ray, Redis.
    stack = ExitStack()
    try:
        redis_url = opts.redis_url
        if redis_url is None:
            with progress.phase("starting Redis (embedded)"):
                redis = LocalRedis(die_with_parent=True)
                stack.callback(redis.cleanup)
                with ctrl_c.held():
                    redis.start()
            redis_url = redis.url
        config = demo_config(opts, redis_url)
        with progress.phase("starting Ray (local, 2 CPUs)"):
            ray = PrivateRay(num_cpus=2, prefix="odb-demo-ray-")
            stack.callback(ray.close)
            with ctrl_c.held():
                ray.start()  # its node process, in a session of its own
            ray.connect()
        with progress.phase("starting the service"):
            svc = start_service(config, tokens={DEMO_JOB: token})
            stack.callback(svc.stop)
            _, metrics_port = start_metrics_server(0, svc, host="127.0.0.1")
            record = local_services.register(config.state_dir, LocalService(
                kind="demo", pid=os.getpid(), redis_url=redis_url, grpc=svc.address,
                metrics=f"127.0.0.1:{metrics_port}", token_envs={DEMO_JOB: TOKEN_ENV}))
            stack.callback(local_services.unregister, record)
        progress.say(f"service on {svc.address}, metrics on 127.0.0.1:{metrics_port} "
                     f"(`odb-pipeline status` shows it); {opts.ranks} trainer ranks "
                     "(gloo DDP, Join)")
        stack.callback(_stop_ranks, procs)
        rows = _source_rows(opts.data) * opts.epochs
        state = svc.runtimes[DEMO_JOB].state
        odb_logs = opts.out_dir / "odb"
        shutil.rmtree(odb_logs, ignore_errors=True)
        _spawn_ranks(opts, odb_logs, ["--endpoint", svc.address, "--job", DEMO_JOB,
                                      "--token-env", TOKEN_ENV], procs, ctrl_c)

        def odb_measures(trained: int) -> list[Measure]:
            c = state.counters()
            planned = state.is_done()
            # Fully planned: samples_in is exact (truncate quarantines nothing in the planner).
            expected = c.samples_in if planned else rows - c.quarantined
            return [preprocessing_measure(rows, c.samples_in, c.quarantined, planned),
                    training_measure(trained, expected)]

        _watch(procs, odb_logs, "odb", opts.rank_timeout_s, progress, odb_measures)
        runs["odb"] = {
            "logs": odb_logs,
            "quarantined": [f"{q.sample_id}: {q.reason}: {q.detail}"
                            for q in state.quarantine()],
            # over_budget=truncate: the planner quarantines nothing, every sample must arrive.
            "expected_samples": state.counters().samples_in,
            "epochs": opts.epochs,
        }
        if opts.standard:
            runs["standard"] = _run_standard(opts, config, progress, procs, ctrl_c,
                                             runs["odb"]["quarantined"])
    finally:
        with ctrl_c.held():
            stack.close()
    with progress.phase("writing the report and the plot"):
        report = build_report(runs, opts)
        write_outputs(report, runs, opts.out_dir)
    return report


def _run_standard(opts: DemoOptions, config: ServiceConfig, progress: Progress,
                  procs: list[subprocess.Popen], ctrl_c: CtrlC, quarantined: list[str]) -> dict:
    """The fixed-size baseline: the same samples, batched by count, through the same ranks."""
    from pipeline.preprocess.pipeline import iter_samples
    from pipeline.preprocess.sample import ProcessedSample

    std_logs = opts.out_dir / "standard"
    shutil.rmtree(std_logs, ignore_errors=True)
    std_logs.mkdir(parents=True)
    plan_file = std_logs / "batches.pt"
    with progress.phase("preprocessing for fixed-size batches (standard)"):
        samples = [s for s in iter_samples(config.job(DEMO_JOB), 0)
                   if isinstance(s, ProcessedSample)]
        batch_size = _standard_batches(samples, opts, plan_file)
    _spawn_ranks(opts, std_logs, ["--fixed-batches", str(plan_file)], procs, ctrl_c)
    _watch(procs, std_logs, f"standard, B={batch_size}", opts.rank_timeout_s, progress,
           lambda trained: [training_measure(trained, len(samples))])
    return {"logs": std_logs, "quarantined": quarantined, "expected_samples": len(samples),
            "epochs": 1, "batch_size": batch_size}
