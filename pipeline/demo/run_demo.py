"""Run the whole system locally: embedded Redis, local Ray, the service, N real trainer ranks.

The ranks are separate processes running gloo DDP (`pipeline.demo.train_rank`); they talk to the
service only over gRPC, as they would on a cluster. Every rank writes a per-step log; the report
(`pipeline.demo.report`) is computed from those logs alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import ServiceConfig, load_config
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
    return load_config(environ={}, overrides={
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


def _spawn_ranks(opts: DemoOptions, log_dir: Path, extra: list[str]) -> list[subprocess.Popen]:
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, **opts.extra_env, "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(opts.ranks):
        cmd = [sys.executable, "-m", "pipeline.demo.train_rank", "--rank", str(rank),
               "--world-size", str(opts.ranks), "--master-port", str(port),
               "--log", str(log_dir / f"rank{rank}.jsonl"), *extra]
        err = open(log_dir / f"rank{rank}.stderr", "w")  # noqa: SIM115 - closed with the proc
        procs.append(subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT))
    return procs


def _watch(procs: list[subprocess.Popen], log_dir: Path, total: int, label: str,
           timeout_s: float) -> None:
    """Progress bar over samples consumed (read from the rank logs) until every rank exits."""
    from tqdm import tqdm

    deadline = time.monotonic() + timeout_s
    with tqdm(total=total, desc=label, unit="sample", file=sys.stderr, leave=True,
              dynamic_ncols=True) as bar:
        while True:
            done = sum(_count_samples(p) for p in log_dir.glob("rank*.jsonl"))
            bar.update(done - bar.n)
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
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


def run_demo(opts: DemoOptions) -> dict:
    """Run ODB (and, with `standard`, the fixed-size baseline); return the report dict."""
    from pipeline.demo.report import build_report, write_outputs
    from pipeline.ray_runtime import PrivateRay
    from pipeline.service.server import start_service

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    token = os.urandom(16).hex()
    opts.extra_env[TOKEN_ENV] = token
    redis = None if opts.redis_url else LocalRedis().start()
    ray = PrivateRay(num_cpus=2, prefix="odb-demo-ray-")
    svc = None
    procs: list[subprocess.Popen] = []
    runs: dict[str, dict] = {}
    try:
        config = demo_config(opts, opts.redis_url or redis.url)
        print(f"demo: redis {'(embedded) ' if redis else ''}ready; starting local Ray...",
              file=sys.stderr)
        ray.__enter__()
        svc = start_service(config, tokens={DEMO_JOB: token})
        print(f"demo: service on {svc.address}; {opts.ranks} trainer ranks (gloo DDP, Join)",
              file=sys.stderr)
        total = _source_rows(opts.data) * opts.epochs
        odb_logs = opts.out_dir / "odb"
        shutil.rmtree(odb_logs, ignore_errors=True)
        procs = _spawn_ranks(opts, odb_logs, ["--endpoint", svc.address, "--job", DEMO_JOB,
                                              "--token-env", TOKEN_ENV])
        _watch(procs, odb_logs, total, "odb", opts.rank_timeout_s)
        state = svc.runtimes[DEMO_JOB].state
        runs["odb"] = {
            "logs": odb_logs,
            "quarantined": [f"{q.sample_id}: {q.reason}: {q.detail}"
                            for q in state.quarantine()],
            # over_budget=truncate: the planner quarantines nothing, every sample must arrive.
            "expected_samples": state.counters().samples_in,
            "epochs": opts.epochs,
        }
        if opts.standard:
            from pipeline.preprocess.pipeline import iter_samples
            from pipeline.preprocess.sample import ProcessedSample

            job = config.job(DEMO_JOB)
            samples = [s for s in iter_samples(job, 0) if isinstance(s, ProcessedSample)]
            std_logs = opts.out_dir / "standard"
            shutil.rmtree(std_logs, ignore_errors=True)
            std_logs.mkdir(parents=True)
            plan_file = std_logs / "batches.pt"
            batch_size = _standard_batches(samples, opts, plan_file)
            procs = _spawn_ranks(opts, std_logs, ["--fixed-batches", str(plan_file)])
            _watch(procs, std_logs, len(samples), f"standard (B={batch_size})",
                   opts.rank_timeout_s)
            runs["standard"] = {"logs": std_logs,
                                "quarantined": runs["odb"]["quarantined"],
                                "expected_samples": len(samples), "epochs": 1,
                                "batch_size": batch_size}
    finally:
        for p in procs:  # Ctrl-C or a failure: no trainer rank outlives the demo
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if svc is not None:
            svc.stop()
        ray.close()
        if redis is not None:
            redis.cleanup()
    report = build_report(runs, opts)
    write_outputs(report, runs, opts.out_dir)
    return report

