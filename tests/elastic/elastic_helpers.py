"""Shared pieces of the elastic tests: a served job on the session's Redis, rank processes
(elastic_rank.py) started and killed like trainer workers, and the checks every test applies to
what they consumed (exactly once across worlds, alignment per world, exact loss-scale totals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import RunningService, start_service

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def samples(n: int, seed: int = 1) -> list:
    return synthetic_samples(n, max_len=400, seed=seed)


@contextmanager
def served(redis_url: str, job_id: str, world_size: int, items: list, *,
           token: str | None = None, twins: tuple[str, ...] = (), **service: Any):
    """The job on a real gRPC server over RedisJobState (the session's redis-server); `service`
    holds ServiceConfig fields, `job` TrainingJobConfig fields; `twins`: more jobs of the same
    config and samples on the same server, by id."""
    job = {"job_id": job_id, "world_size": world_size, "seed": 3,
           "source": {"paths": ["arrays"]},
           "batching": {"token_budget": 1024, "max_window_samples": 64, "pool_steps": 2},
           **service.pop("job", {})}
    ids = (job_id, *twins)
    cfg = ServiceConfig.model_validate({
        "redis_url": redis_url, "metrics_port": None, "grpc": {"port": 0},
        "lease_seconds": service.pop("lease_seconds", 5.0),
        "jobs": [{**job, "job_id": j} for j in ids], **service})
    svc: RunningService = start_service(cfg, sample_sources={j: ArraySource(items) for j in ids},
                                        tokens=dict.fromkeys(ids, token))
    try:
        yield svc
    finally:
        svc.stop(grace=0.5)


class RankProc:
    """elastic_rank.py for one rank of one world; its log and state live in `tmp`. With `gate`
    it holds after `hold_after` batches until that file exists (`open_gate`)."""

    def __init__(self, tmp: Path, address: str, job: str, rank: int, world: int, *,
                 restore: Path | None = None, sleep: float = 0.02, tag: str = "",
                 gate: Path | None = None, hold_after: int = 0) -> None:
        self.rank, self.world = rank, world
        name = f"w{world}{tag}-r{rank}"
        self.log, self.state = tmp / f"{name}.jsonl", tmp / f"{name}.state.json"
        cmd = [sys.executable, str(HERE / "elastic_rank.py"), "--address", address, "--job",
               job, "--rank", str(rank), "--world", str(world), "--out", str(self.log),
               "--state", str(self.state), "--sleep", str(sleep)]
        if restore is not None:
            cmd += ["--restore", str(restore)]
        if gate is not None:
            cmd += ["--gate", str(gate), "--hold-after", str(hold_after)]
        self.proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)

    def lines(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(ln) for ln in self.log.read_text().splitlines() if ln.strip()]

    def batches(self) -> list[dict]:
        return [x for x in self.lines() if "step" in x]

    def end(self) -> dict:
        last = self.lines()[-1]
        assert "end" in last, f"world {self.world} rank {self.rank} ended with {last}"
        return last

    def finish(self, timeout: float = 120.0) -> RankProc:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"world {self.world} rank {self.rank} did not finish in "
                                 f"{timeout}s: {self.lines()[-1:]}") from None
        out = self.proc.stdout.read().decode(errors="replace")
        assert rc == 0, (f"world {self.world} rank {self.rank} exited {rc}: {self.lines()[-1:]} "
                         f"{out[-3000:]}")
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def scale_cli(address: str, job: str, world_size: int) -> dict:
    """`odb-pipeline scale ... --json` in its own process."""
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "scale", "--endpoint", address,
                          "--job", job, "--world-size", str(world_size), "--json"],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_worlds(records: Iterable[dict], worlds: list, last_world_closes: bool) -> None:
    """Per world: every rank got the same steps, contiguous from the world's first step (the
    job's closing partial step aside), each within the world's boundary; loss-scale totals
    exact: the ranks' shares of a step add up to its all-rank totals."""
    by_world: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    by_step: dict[int, list[dict]] = defaultdict(list)
    for rec in records:
        by_world[rec["world"]][rec["rank"]].append(rec["step"])
        by_step[rec["step"]].append(rec)
    for g, w in enumerate(worlds):
        ranks = by_world[w.world_size]
        assert sorted(ranks) == list(range(w.world_size)), f"world {g}: ranks {sorted(ranks)}"
        steps = {r: sorted(s) for r, s in ranks.items()}
        for r, s in steps.items():
            assert len(s) == len(set(s)), f"world {g} rank {r} got a step twice"
            assert s[0] >= w.first_step
            if w.last_steps is not None:
                assert s[-1] <= w.last_steps[r]
        full = steps[0]
        last = g == len(worlds) - 1 and last_world_closes
        for r, s in steps.items():
            mine = s if not last else [n for n in s if n != max(full)]
            others = full if not last else [n for n in full if n != max(full)]
            assert mine == others, f"world {g}: rank {r} got steps {s}, rank 0 {full}"
        assert full == list(range(full[0], full[-1] + 1)), f"world {g}: steps not contiguous"
    for n, recs in by_step.items():
        assert len({r["world"] for r in recs}) == 1, f"step {n} in two worlds"
        assert sum(r["rank_samples"] for r in recs) == recs[0]["step_samples"], f"step {n}"
        assert sum(r["rank_tokens"] for r in recs) == recs[0]["step_tokens"], f"step {n}"


def global_reference(items: list, batching: dict, seed: int) -> dict[int, Counter]:
    """optimizer step -> its samples, as one rank planning the job uninterrupted would have
    them (the producer's own feed, the job's own policy): what global steps must hold at any
    world size and across reconfigurations (docs/global-steps.md)."""
    from pipeline.config import BatchingConfig
    from pipeline.order.cursor import OrderCursor
    from pipeline.planner.step_planner import StepPlanner
    from pipeline.planner.types import Step
    from pipeline.producer.feed import ArrayFeed

    cfg = BatchingConfig.model_validate(batching)
    planner = StepPlanner(cfg.policy(), 1, "join", seed)
    feed = ArrayFeed(ArraySource(items), cfg.collate)
    events = planner.feed_many(feed.iter_epoch(0, OrderCursor()))
    events += planner.end_epoch(last_epoch=True)
    return {ev.info.optimizer_step: Counter(str(s.sample_id) for b in ev.batches
                                            if not b.filler for s in b.samples)
            for ev in events if isinstance(ev, Step)}


def check_global_steps(records: Iterable[dict], reference: dict[int, Counter]) -> None:
    """Global steps: every step reached every rank of its world with all of that rank's
    micro-batches, in order, once; each optimizer step ran once, in one world, holding the
    samples of the uninterrupted plan; its loss-scale totals are exact."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for rec in records:
        by_step[rec["step"]].append(rec)
    ran: Counter = Counter()
    for n, recs in sorted(by_step.items()):
        (size,) = {r["world"] for r in recs}
        micros: dict[int, list[int]] = defaultdict(list)
        for r in recs:
            micros[r["rank"]].append(r["micro"])
        assert sorted(micros) == list(range(size)), f"step {n}: ranks {sorted(micros)}"
        for rank, got in micros.items():
            count = next(r["micros"] for r in recs if r["rank"] == rank)
            assert got == list(range(count)), f"step {n} rank {rank}: micro-batches {got}"
        (opt,) = {r["opt"] for r in recs}
        ran[opt] += 1
        assert Counter(i for r in recs if not r["filler"] for i in r["ids"]) == reference[opt], (
            f"step {n} (optimizer step {opt}) holds other samples than the uninterrupted run")
        assert sum(r["rank_samples"] for r in recs) == recs[0]["step_samples"], f"step {n}"
        assert sum(r["rank_tokens"] for r in recs) == recs[0]["step_tokens"], f"step {n}"
    assert ran == Counter(dict.fromkeys(reference, 1)), (
        f"every optimizer step runs once: ran {sorted(ran.items())}, planned {sorted(reference)}")


def assert_exactly_once(records: Iterable[dict], items: list) -> None:
    records = [rec for rec in records if not rec.get("filler")]  # a filler is not coverage
    got = Counter(i for rec in records for i in rec["ids"])
    want = Counter(s.sample_id for s in items)
    missing, extra = want - got, got - want
    assert not missing and not extra, (
        f"{sum(missing.values())} missing (e.g. {list(missing)[:3]}), "
        f"{sum(extra.values())} twice (e.g. {list(extra)[:3]})")
