"""Rank streams without a server: a job served by `RankStreams` on the test's own event loop,
and a hand-driven client (the messages it sends, what the stream writes to it).

    job = StreamJob(world_size=2)
    async def main():
        client = StreamClient(job, rank=0)
        ...  client.ack(step), await client.next(), client.close(), await client.ended()
    job.run(main())
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from service_helpers import job_dict, service_config

from pipeline.jobstate import JobState, MemoryJobState
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.hosting import ThreadHost
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.liveness import policy_named
from pipeline.service.payloads import ArrayPayloads
from pipeline.service.rank_stream import RankStreams, StreamSettings
from pipeline.service.server import producer_settings
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire_format import WIRE_VERSION


class StreamJob:
    """One job (an in-memory source and state, its producer in a thread) and the replica's
    `RankStreams` for it; `run(coro)` runs a test's coroutine on a fresh event loop."""

    def __init__(self, *, job_id: str = "j", world_size: int = 2, samples: int = 40,
                 lease_seconds: float = 5.0, policy: str = "fail",
                 rank_timeout_seconds: float = 60.0, prefetch: int = 2,
                 state: JobState | None = None, state_timeout_seconds: float = 5.0,
                 resume_grace_s: float = 0.2, **job: Any) -> None:
        cfg = service_config(job_dict(job_id, world_size, **job))
        self.job = cfg.jobs[0]
        self.samples = synthetic_samples(samples, max_len=200)
        array = ArraySource(self.samples)
        self.state = state or MemoryJobState(job_id, world_size, self.job.mode)
        host = ThreadHost(self.job, self.state, ArrayFeed(array, self.job.batching.collate),
                          holder="test-producer", settings=producer_settings(cfg))
        self.rt = JobRuntime(self.job, self.state, ArrayPayloads(array), host).start()
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="test-io")
        self.settings = StreamSettings(lease_seconds=lease_seconds, prefetch_steps=prefetch,
                                       resume_grace_s=resume_grace_s,
                                       state_timeout_seconds=state_timeout_seconds)
        self.streams = RankStreams(self.settings,
                                   policy_named(policy, rank_timeout_seconds), self.executor)

    def replica(self) -> RankStreams:
        """The rank streams of another replica of the job (its own vanished clients)."""
        return RankStreams(self.settings, self.streams.policy, self.executor)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        async def bounded() -> Any:
            async with asyncio.timeout(timeout):
                return await coro

        return asyncio.run(bounded())

    def close(self) -> None:
        self.rt.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)


def open_msg(job: str, rank: int, world_size: int, **kw: Any) -> pb.Open:
    kw.setdefault("wire_version", WIRE_VERSION)
    kw.setdefault("client_id", f"c{rank}")
    kw.setdefault("credits", 2)
    return pb.Open(job_id=job, rank=rank, world_size=world_size, **kw)


class StreamClient:
    """One rank's client: `serve` runs as a task; `next()` is the next message it was written
    (a `pb.ServerMessage`), `outcome()` how the stream ended (None, or the error it raised),
    `vanish()` goes away as a killed client does. `streams`: another replica's `RankStreams`
    (`job.replica()`) instead of the job's own."""

    def __init__(self, job: StreamJob, rank: int, world_size: int | None = None, *,
                 streams: RankStreams | None = None, **open_kw: Any) -> None:
        self.job = job
        op = open_msg(job.job.job_id, rank, world_size or job.job.world_size, **open_kw)
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._written: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future((streams or job.streams).serve(
            job.rt, op, op.client_id, self._requests(), self._write))

    async def _requests(self) -> AsyncIterator[pb.ClientMessage]:
        while (msg := await self._inbox.get()) is not None:
            yield msg

    async def _write(self, msg: pb.ServerMessage | bytes) -> None:
        await self._written.put(pb.ServerMessage.FromString(msg) if isinstance(msg, bytes)
                                else msg)

    def send(self, msg: pb.ClientMessage) -> None:
        self._inbox.put_nowait(msg)

    def ack(self, step: int, credits: int = 1) -> None:
        self.send(pb.ClientMessage(ack=pb.Ack(consumed_step=step, credits=credits)))

    def heartbeat(self) -> None:
        self.send(pb.ClientMessage(heartbeat=pb.Heartbeat()))

    def close(self) -> None:
        """Half-close: the client sends nothing more."""
        self._inbox.put_nowait(None)

    async def vanish(self) -> None:
        """The client goes away without a word (killed, network gone): the call is cancelled."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def next(self, timeout: float = 10.0) -> pb.ServerMessage:
        get = asyncio.ensure_future(self._written.get())
        done, _ = await asyncio.wait({get, self.task}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        if self.task in done:
            self.task.result()  # raises how the stream ended
            raise EOFError("the stream ended")
        raise TimeoutError("no message from the stream")

    async def outcome(self, timeout: float = 10.0) -> BaseException | None:
        async with asyncio.timeout(timeout):
            try:
                await self.task
            except Exception as exc:
                return exc
        return None

    async def messages_until_end(self) -> AsyncIterator[pb.ServerMessage]:
        """What the stream writes until it ends (however it ends)."""
        while True:
            try:
                yield await self.next()
            except (EOFError, Exception):
                return

    async def consume(self) -> list[pb.ServerMessage]:
        """Take and ack every batch until the job's final END, then half-close."""
        got = []
        while True:
            msg = await self.next()
            got.append(msg)
            if msg.WhichOneof("kind") == "batch":
                self.ack(msg.batch.step)
            elif msg.end.job_done:
                self.close()
                return got
