"""A served job with real trainer ranks that stop at known points, for the operator-view tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.preprocess.sample import ProcessedSample
from pipeline.service.server import RunningService, start_service

JOB = "obs"
WORLD = 2


def config(**kw: Any) -> ServiceConfig:
    job = {"job_id": JOB, "world_size": WORLD, "source": {"paths": ["arrays"]},
           "batching": {"token_budget": 1024, "max_window_samples": 32}}
    return ServiceConfig.model_validate({"grpc": {"port": 0}, "lease_seconds": 5.0,
                                         "metrics_port": 0, "jobs": [job], **kw})


def samples(n: int = 160) -> list[ProcessedSample]:
    return synthetic_samples(n, seed=7, min_len=16, max_len=256, vocab=500)


@contextmanager
def served(items: list | None = None, tokens: dict[str, str | None] | None = None,
           **cfg: Any) -> Iterator[tuple[RunningService, int]]:
    """(service, metrics port); both stopped on exit."""
    from pipeline.observability import start_metrics_server

    conf = config(**cfg)
    svc = start_service(conf, tokens=tokens,
                        sample_sources={JOB: ArraySource(items if items is not None
                                                         else samples())})
    port = None
    if conf.metrics_port is not None:  # config(): 0 = a free port
        _, port = start_metrics_server(conf.metrics_port, svc, host="127.0.0.1")
    try:
        yield svc, port
    finally:
        svc.stop(grace=0.5)


class Rank:
    """One trainer rank in a thread: takes `n` batches (or all with n=None), acks, then holds
    its stream open until `release()` so the server keeps seeing it connected."""

    def __init__(self, address: str, rank: int, n: int | None) -> None:
        from trainer_client import BatchStream

        self.stream = BatchStream(address, JOB, rank, WORLD, prefetch=1)
        self.n = n
        self.steps: list[int] = []
        self.batches: list = []
        self.error: BaseException | None = None
        self.taken = threading.Event()
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Rank:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for batch in self.stream:
                self.steps.append(batch.info.step)
                self.batches.append(batch)
                if self.n is not None and len(self.steps) >= self.n:
                    break
            self.stream.ack()  # the last batch taken is consumed too
            self.taken.set()
            self._go.wait(30)
        except BaseException as exc:
            self.error = exc
            self.taken.set()
        finally:
            self.stream.close()

    def wait_taken(self, timeout: float = 30.0) -> None:
        assert self.taken.wait(timeout), "rank did not take its batches in time"
        if self.error is not None:
            raise self.error

    def more(self, n: int) -> None:
        """Take `n` more batches in this thread (the stream is still open)."""
        it = iter(self.stream)
        for _ in range(n):
            batch = next(it)
            self.steps.append(batch.info.step)
            self.batches.append(batch)
        self.stream.ack()

    def release(self) -> None:
        self._go.set()
        self._thread.join(10)


def next_rank_step(svc: RunningService, rank: int, after: int) -> int:
    """The rank's first step in the plan after step `after` (what the server sends next)."""
    st = svc.runtimes[JOB].state
    n = after + 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if n <= st.published_through():
            step = st.get_step(n)
            if step is not None and step.batch_for(rank) is not None:
                return n
            n += 1
        else:
            time.sleep(0.02)
    raise AssertionError(f"no step for rank {rank} after {after}")


@contextmanager
def ranks_stopped_at_known_steps(svc: RunningService) -> Iterator[tuple[list, list[int],
                                                                           list[int]]]:
    """Rank 0 takes 3 batches, rank 1 takes 5, then both hold their streams open.
    Yields (ranks, acked step per rank, step the server delivers next per rank)."""
    ranks = [Rank(svc.address, 0, 3).start(), Rank(svc.address, 1, 5).start()]
    try:
        for r in ranks:
            r.wait_taken()
        acked = [r.steps[-1] for r in ranks]
        yield ranks, acked, [next_rank_step(svc, i, acked[i]) for i in range(2)]
    finally:
        for r in ranks:
            r.release()
