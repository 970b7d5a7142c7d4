"""`RefillStream`: the client of an inference consumer of a `mode: refill` job (docs/refill.md).

    with RefillStream("localhost:50051", "gen-1", token=tok) as stream:
        finished: list[str] = []
        while not stream.exhausted:
            for req in stream.refill(free_tokens=capacity - used, finished=finished):
                start(req)                       # req.id, req.input_ids, req.cost
            finished = step_and_collect_finished()

Each `refill` is one ask on one bidirectional gRPC stream: it reports the requests finished since
the last ask and returns new ones whose total cost is <= `free_tokens` (a request flagged
`over_budget`, admitted alone under the job's `alone` policy, is the one exception). Admitted
requests stay leased to this consumer until it reports them; if it goes silent for the job's
`lease_seconds` they are re-admitted elsewhere, and a report of them afterwards comes back in
`stale` (another consumer owns them now: drop that result). Connection loss (a replica restart,
a network blip) is retried within `reconnect_timeout`: the stream reopens naming the requests it
still holds (they stay leased to it) and repeats the ask with the same sequence number, which
the service answers with the same admission, so nothing is admitted twice or lost.

Needs grpcio, protobuf and numpy only (the light `odb-trainer-client` distribution).
"""

from __future__ import annotations

import os
import queue
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from trainer_client.batch_stream import StreamError
from trainer_client.channel import channel_options, open_channel
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}


@dataclass(frozen=True)
class Request:
    """One admitted request: generate up to `generation_tokens` after `input_ids`."""

    id: str
    input_ids: np.ndarray  # int32 [prompt_tokens]
    cost: int              # prompt_tokens + generation_tokens
    prompt_tokens: int
    generation_tokens: int
    over_budget: bool = False


def _request(m: pb.RefillRequest) -> Request:
    ids = np.frombuffer(m.input_ids.data, dtype="<i4").reshape(tuple(m.input_ids.shape))
    return Request(m.id, ids, m.cost, m.prompt_tokens, m.generation_tokens, m.over_budget)


class RefillStream:
    def __init__(self, endpoint: str, job: str, *, token: str | None = None,
                 consumer_id: str | None = None, root_certificates: bytes | None = None,
                 max_message_mb: int = 256, reconnect_timeout: float = 30.0,
                 load_balancing: str = "pick_first", keepalive_time_s: float = 4.0,
                 keepalive_timeout_s: float = 4.0) -> None:
        """`keepalive_time_s`, `keepalive_timeout_s`: a silent replica is dropped within their
        sum and the consumer fails over (`trainer_client.channel`)."""
        self.endpoint, self.job = endpoint, job
        self.consumer_id = consumer_id or f"{job}/consumer/{uuid.uuid4().hex[:12]}"
        self.reconnect_timeout = reconnect_timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        opts = channel_options(max_message_mb=max_message_mb, load_balancing=load_balancing,
                               keepalive_time_s=keepalive_time_s,
                               keepalive_timeout_s=keepalive_timeout_s, max_backoff_s=2.0)
        self._channel = open_channel(endpoint, opts, root_certificates=root_certificates)
        self._stub = pb_grpc.DataServiceStub(self._channel)
        self._reqs: queue.SimpleQueue | None = None
        self._replies: Iterator[pb.RefillReply] | None = None
        # Asks are numbered from a random start, so a restarted consumer with the same id never
        # repeats a number of its previous life (a repeated number means "retry").
        self._seq = int.from_bytes(os.urandom(6), "little")
        self._retry = 0  # the ask being retried after a reconnect (0 = none)
        self.held: set[str] = set()  # admitted to this consumer, not yet reported finished
        self.exhausted = False       # every request of the job completed
        self.stale: list[str] = []   # the last ask's finished ids that another consumer owns
        self.completed: list[str] = []  # the last ask's finished ids recorded as completed
        self.waiting = 0             # requests waiting for admission after the last ask
        self.in_flight = 0           # requests leased to any consumer after the last ask
        self.reconnects = 0

    def refill(self, free_tokens: int, finished: Iterable[str] = ()) -> list[Request]:
        """Report `finished`, get new requests costing at most `free_tokens` in total."""
        done = list(finished)
        self._seq += 1
        ask = pb.RefillMessage(ask=pb.RefillAsk(free_tokens=free_tokens, finished=done,
                                                call_seq=self._seq))
        deadline = time.monotonic() + self.reconnect_timeout
        backoff = 0.05
        sent = False
        while True:
            try:
                if self._replies is None:
                    # After a failed attempt the ask may have been applied: the reopened stream
                    # says it repeats it, so its admission stays leased here.
                    self._retry = self._seq if sent else 0
                    self._open()
                assert self._reqs is not None and self._replies is not None
                self._reqs.put(ask)
                sent = True
                reply = next(self._replies)
                break
            except StopIteration:
                self._drop()
                err: Exception = StreamError(grpc.StatusCode.UNAVAILABLE, "stream ended")
            except grpc.RpcError as exc:
                self._drop()
                if exc.code() not in _RETRYABLE:
                    raise StreamError(exc.code(), exc.details() or "") from None
                err = exc
            if time.monotonic() >= deadline:
                raise StreamError(grpc.StatusCode.UNAVAILABLE,
                                  f"no answer from {self.endpoint} within reconnect_timeout="
                                  f"{self.reconnect_timeout:g}s: {err}")
            time.sleep(backoff)
            backoff = min(2.0, backoff * 2)
            self.reconnects += 1
        got = [_request(m) for m in reply.requests]
        self.held.difference_update(done)
        self.held.update(r.id for r in got)
        self.completed, self.stale = list(reply.completed), list(reply.stale)
        self.exhausted, self.waiting, self.in_flight = reply.done, reply.waiting, reply.in_flight
        return got

    def job_status(self, timeout: float = 10.0) -> pb.JobStatus:
        return self._stub.GetJob(pb.GetJobRequest(job_id=self.job), metadata=self._metadata,
                                 timeout=timeout)

    def _open(self) -> None:
        reqs: queue.SimpleQueue = queue.SimpleQueue()
        reqs.put(pb.RefillMessage(open=pb.RefillOpen(job_id=self.job,
                                                     consumer_id=self.consumer_id,
                                                     held_ids=sorted(self.held),
                                                     retry_seq=self._retry)))
        self._reqs = reqs
        self._replies = self._stub.Refill(iter(reqs.get, None), metadata=self._metadata)

    def _drop(self) -> None:
        if self._reqs is not None:
            self._reqs.put(None)
        if self._replies is not None:
            self._replies.cancel()  # type: ignore[attr-defined]
        self._reqs = self._replies = None

    def close(self) -> None:
        """End the stream; requests still held stay leased until the lease lapses."""
        self._drop()
        self._channel.close()

    def __enter__(self) -> RefillStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
