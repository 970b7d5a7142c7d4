"""Shared builders for the data-plane tests: configs, sample sets, a served job, raw streams."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.preprocess.sample import ProcessedSample
from pipeline.service.server import RunningService, start_service
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc
from trainer_client.wire_format import WIRE_VERSION


def job_dict(job_id: str = "j", world_size: int = 2, **kw: Any) -> dict:
    batching = kw.pop("batching", {})
    return {"job_id": job_id, "world_size": world_size, "source": {"paths": ["arrays"]},
            "batching": {"token_budget": 2048, "max_window_samples": 64, **batching}, **kw}


def service_config(*jobs: dict, redis_url: str | None = None, **grpc_kw: Any) -> ServiceConfig:
    return ServiceConfig.model_validate({"grpc": {"port": 0, **grpc_kw}, "lease_seconds": 5.0,
                                         "metrics_port": None, "redis_url": redis_url,
                                         "jobs": list(jobs)})


def uneven_samples(n: int, budget: int, vocab: int = 1000) -> list[ProcessedSample]:
    """Every sample exactly fills the budget: each is a batch of its own that cannot be split,
    so with an odd count and W=2 the last step of a join epoch has only rank 0."""
    return synthetic_samples(n, lengths=[budget] * n, vocab=vocab, source="full")


@contextmanager
def serving(cfg: ServiceConfig, samples: dict[str, list[ProcessedSample]], **kw: Any
            ) -> Iterator[RunningService]:
    svc = start_service(cfg, sample_sources={k: ArraySource(v) for k, v in samples.items()},
                        **kw)
    try:
        yield svc
    finally:
        svc.stop(grace=0.5)


class RawStream:
    """A hand-driven Stream call: send any ClientMessage, read ServerMessages."""

    def __init__(self, address: str, first: pb.ClientMessage, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._q.put(first)
        md = (("authorization", f"Bearer {token}"),) if token else ()
        self.call = pb_grpc.DataServiceStub(self.channel).Stream(iter(self._q.get, None),
                                                                 metadata=md)

    def send(self, msg: pb.ClientMessage) -> None:
        self._q.put(msg)

    def next(self, timeout: float = 10.0) -> pb.ServerMessage:
        out: list = []

        def pull() -> None:
            try:
                out.append(next(self.call))
            except Exception as exc:
                out.append(exc)

        t = threading.Thread(target=pull, daemon=True)
        t.start()
        t.join(timeout)
        if not out:
            raise TimeoutError("no server message")
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def close(self) -> None:
        self._q.put(None)
        self.call.cancel()
        self.channel.close()


def open_msg(job: str = "j", rank: int = 0, world_size: int = 2, **kw: Any) -> pb.ClientMessage:
    kw.setdefault("wire_version", WIRE_VERSION)  # the server refuses any other
    return pb.ClientMessage(open=pb.Open(job_id=job, rank=rank, world_size=world_size,
                                         client_id=kw.pop("client_id", f"c{rank}"),
                                         credits=kw.pop("credits", 2), **kw))


def consume_all(address: str, job: str, world_size: int, epochs: int = 1, **kw: Any
                ) -> dict[int, list]:
    """Every rank in a thread; returns rank -> list of (StreamBatch | EpochEndInfo)."""
    from trainer_client import BatchStream

    out: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with BatchStream(address, job, rank, world_size, **kw) as s:
                got: list = []
                for _ in range(epochs):
                    got.extend(s)
                    got.append(s.last_end)
                out[rank] = got
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert len(out) == world_size, "a rank did not finish within 60 s"
    return out
