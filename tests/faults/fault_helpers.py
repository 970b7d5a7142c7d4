"""Shared pieces of the fault-injection tests: real server / rank processes, rank threads,
and the coverage checks (Guarantees 2-5) every test applies to what the ranks received."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


HEARTBEAT_S = 0.25  # the rank clients' heartbeat: the fault tests' leases are 2-5 s


def fault_samples(n: int, seed: int, max_len: int = 600, full_len: int = 0) -> list:
    """The deterministic samples the server processes serve (the test rebuilds the same)."""
    from pipeline.preprocess.array_source import synthetic_samples

    if full_len:
        return synthetic_samples(n, lengths=[full_len] * n, vocab=1000, seed=seed,
                                 source="full")
    return synthetic_samples(n, max_len=max_len, seed=seed)


def job_dict(job_id: str = "j", world_size: int = 3, **kw: Any) -> dict:
    batching = {"token_budget": 2048, "max_window_samples": 64, "pool_steps": 2,
                **kw.pop("batching", {})}
    return {"job_id": job_id, "world_size": world_size, "source": {"paths": ["arrays"]},
            "batching": batching, **kw}


# ------------------------------------------------------------------ processes
class ServerProc:
    """tests/faults/fault_server.py in its own process (SIGKILL-able)."""

    def __init__(self, redis_url: str, port: int, job: dict, samples: int, **kw: Any) -> None:
        cmd = [sys.executable, str(HERE / "fault_server.py"), "--redis-url", redis_url,
               "--port", str(port), "--job-json", json.dumps(job), "--samples", str(samples)]
        for k, v in kw.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        self.port = port
        self.proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self._err: list[str] = []
        threading.Thread(target=lambda: self._err.extend(self.proc.stderr), daemon=True).start()

    def wait_ready(self, timeout: float = 60.0) -> ServerProc:
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not out or not out[0].startswith("READY"):
            self.kill()
            raise AssertionError(f"server did not start in {timeout}s: "
                                 f"{''.join(self._err)[-3000:]}")
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return "".join(self._err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def rank_proc(address: str, job: str, rank: int, world: int, out: Path, state: Path,
              **kw: Any) -> subprocess.Popen:
    cmd = [sys.executable, str(HERE / "fault_rank.py"), "--address", address, "--job", job,
           "--rank",
           str(rank), "--world", str(world), "--out", str(out), "--state", str(state)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


# ------------------------------------------------------------------ rank threads
class RankThread:
    """One rank consuming every epoch in a thread; records (epoch, step, ids, digest, loss-scale
    counts) per delivered batch, the END infos, and the StreamError that stopped it, if any."""

    def __init__(self, address: str, job: str, rank: int, world: int, *, epochs: int = 1,
                 sleep: float = 0.0, **stream: Any) -> None:
        """`stream`: more `BatchStream` settings (keepalive, reconnect_timeout, ...)."""
        from trainer_client import BatchStream

        self.rank, self.epochs, self.sleep = rank, epochs, sleep
        # Heartbeats well within the fault tests' short leases (a live rank never lapses).
        self.stream = BatchStream(address, job, rank, world, **{
            "prefetch": 2, "backoff": (0.05, 0.5), "heartbeat_s": HEARTBEAT_S, **stream})
        self.records: list[dict] = []
        self.ends: list = []
        self.error: BaseException | None = None
        self.error_at: float | None = None
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RankThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for _ in range(self.epochs):
                for batch in self.stream:
                    i = batch.info
                    self.records.append({"epoch": i.epoch, "step": i.step,
                                         "ids": list(i.sample_ids),
                                         "digest": batch.digest(),
                                         "filler": i.filler,
                                         "scale": (i.step_samples, i.step_tokens,
                                                   i.step_loss_tokens, i.rank_samples,
                                                   i.rank_tokens, i.rank_loss_tokens)})
                    if self.sleep:
                        time.sleep(self.sleep)
                self.ends.append(self.stream.last_end)
        except BaseException as exc:
            self.error, self.error_at = exc, time.monotonic()
        finally:
            self.finished.set()
            self.stream.close()

    def join(self, timeout: float) -> None:
        assert self.finished.wait(timeout), f"rank {self.rank} did not finish in {timeout}s"

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def assert_aborted_for(others: Iterable[RankThread], gone: int, since: float, earliest: float,
                       bound: float) -> None:
    """Each of `others` ended, cut short, with the fail policy's ABORTED naming rank `gone`,
    between `earliest` and `bound` seconds after `since` (when that rank went away)."""
    import grpc

    from trainer_client import StreamError

    for r in others:
        r.join(bound + 5)
    for r in others:
        assert isinstance(r.error, StreamError), f"rank {r.rank}: {r.error!r}"
        assert r.error.code == grpc.StatusCode.ABORTED
        assert f"rank {gone} has been gone for" in r.error.details
        assert "rank_failure_policy=fail" in r.error.details
        assert earliest <= r.error_at - since <= bound, r.error_at - since
        assert not r.stream.done  # they were cut short, not finished


# ------------------------------------------------------------------ coverage checks
def unique_steps(records: Iterable[dict], max_redelivered: int = 0) -> dict[int, dict]:
    """step -> its first delivery. Redeliveries are counted, not hidden: each must be
    byte-identical to the first delivery, and there may be at most `max_redelivered` of them (a
    live client never receives a step twice; a rank process restarted from its state_dict gets
    at most the step in progress again, once per restart)."""
    out: dict[int, dict] = {}
    redelivered = 0
    for rec in records:
        first = out.setdefault(rec["step"], rec)
        if first is rec:
            continue
        redelivered += 1
        assert first["digest"] == rec["digest"] and first["ids"] == rec["ids"], (
            f"step {rec['step']} was redelivered with different content")
    assert redelivered <= max_redelivered, (
        f"{redelivered} redelivered batches, at most {max_redelivered} expected")
    return out


def ids_by_epoch(per_rank: Iterable[Iterable[dict]],
                 max_redelivered: Iterable[int] | None = None) -> dict[int, Counter]:
    """epoch -> Counter of delivered sample ids across ranks (first deliveries; quota mode's
    filler batches deliver nothing)."""
    out: dict[int, Counter] = {}
    per_rank = list(per_rank)
    bounds = list(max_redelivered) if max_redelivered is not None else [0] * len(per_rank)
    for records, bound in zip(per_rank, bounds, strict=True):
        for rec in unique_steps(records, bound).values():
            if not rec.get("filler"):
                out.setdefault(rec["epoch"], Counter()).update(rec["ids"])
    return out


def assert_join_coverage(per_rank: list[list[dict]], all_ids: list[str], epochs: int,
                         max_redelivered: list[int] | None = None) -> None:
    """Join mode: every sample of every epoch delivered exactly once across the ranks."""
    got = ids_by_epoch(per_rank, max_redelivered)
    want = Counter(all_ids)
    for e in range(epochs):
        have = got.get(e, Counter())
        missing, extra = want - have, have - want
        assert not missing and not extra, (
            f"epoch {e}: {sum(missing.values())} missing (e.g. {list(missing)[:3]}), "
            f"{sum(extra.values())} duplicated (e.g. {list(extra)[:3]})")
