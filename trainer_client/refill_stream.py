"""`RefillStream`: the client of an inference consumer of a `mode: refill` job (docs/refill.md).

    with RefillStream("localhost:50051", "gen-1", token=tok) as stream:
        finished: list[str] = []
        while not stream.exhausted:
            got = stream.refill(free_tokens=capacity - used, finished=finished)
            for rid in got.cancel:
                abort(rid)                       # not this consumer's any more: drop it
            for req in got:
                start(req)                       # req.id, req.input_ids, req.cost, pixels
            finished = step_and_collect_finished()

Each `refill` is one ask on one bidirectional gRPC stream: it reports the requests finished since
the last ask and returns new ones whose total cost is <= `free_tokens` (a request flagged
`over_budget`, admitted alone under the job's `alone` policy, is the one exception). Admitted
requests stay leased to this consumer until it reports them; if it goes silent for the job's
`lease_seconds` they are re-admitted elsewhere. What this consumer must then drop comes back
with the very next admission, in `cancel` (counted in `dropped`): the requests it still works on
that were taken from it (another consumer may be decoding them), and finished ones another
consumer completed or holds (`stale`: their results are not this consumer's to keep). Connection
loss (a replica restart, a network blip) is retried within `reconnect_timeout`: the stream
reopens naming the requests it still holds (they stay leased to it) and repeats the ask with the
same sequence number, which the service answers with the same admission, so nothing is admitted
twice or lost.

A request of an image record carries its prompt's images as a training batch does (raw uint8
patch rows and their `pixel_norm`, `image_grid_thw`); `Request.to_model_inputs` gives what a
VLM's forward takes. Tensors are numpy arrays, or torch tensors with `tensors="torch"`.

Needs grpcio, protobuf and numpy only (the light `odb-trainer-client` distribution).
"""

from __future__ import annotations

import os
import queue
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from trainer_client.batch_stream import StreamError
from trainer_client.channel import channel_options, open_channel
from trainer_client.decode import (
    ModelInputs,
    StreamBatch,
    TensorKind,
    resolve_tensor_kind,
    tensor_from_wire,
)
from trainer_client.pixels import PixelNorm
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc
from trainer_client.wire_format import DEFAULT_KEEPALIVE_TIME_S, DEFAULT_KEEPALIVE_TIMEOUT_S

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}


@dataclass(frozen=True)
class Request:
    """One admitted request: generate up to `generation_tokens` after `input_ids`."""

    id: str
    input_ids: Any         # int32 [prompt_tokens]
    cost: int              # prompt_tokens + generation_tokens
    prompt_tokens: int
    generation_tokens: int
    over_budget: bool = False
    epoch: int = 0         # the job's epoch it belongs to (each request completes once each)
    sample_id: str = ""    # the sample it was made from (`id` is `<sample_id>@<epoch>` after
    #                        the first epoch)
    pixel_values: Any = None    # the prompt's images: [patches, C*T*P*P] (uint8 by default)
    image_grid_thw: Any = None  # int64 [images, 3]
    pixel_norm: PixelNorm | None = None  # how raw uint8 pixels become the model's floats

    def to_model_inputs(self, device: Any = None, dtype: Any = None) -> ModelInputs:
        """What a model's forward takes for this prompt, converted on `device` as a training
        batch's (`StreamBatch.to_model_inputs`): int64 `input_ids` [1, prompt_tokens]; for an
        image prompt `pixel_values` normalized in `dtype` (default float32) and int64
        `image_grid_thw`. Its `info` is None (a request is no step of a plan)."""
        batch = StreamBatch(input_ids=self.input_ids[None])
        if self.pixel_values is not None:
            batch.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
            batch.pixel_norm = self.pixel_norm
        batch.info = None  # type: ignore[assignment]
        return batch.to_model_inputs(device, dtype)


class Admitted(list):
    """The requests one `refill` admitted (a list of `Request`), and `cancel`: the ids this
    consumer must stop working on and drop the results of (taken from it when its lease
    lapsed, or finished ones another consumer completed or holds)."""

    cancel: tuple[str, ...] = ()


def _request(m: pb.RefillRequest, kind: Literal["torch", "numpy"]) -> Request:
    pixels = m.HasField("pixel_values")
    return Request(m.id, tensor_from_wire(m.input_ids, kind), m.cost, m.prompt_tokens,
                   m.generation_tokens, m.over_budget, m.epoch, m.sample_id or m.id,
                   tensor_from_wire(m.pixel_values, kind) if pixels else None,
                   tensor_from_wire(m.image_grid_thw, kind) if pixels else None,
                   PixelNorm.from_wire(m.pixel_norm) if m.HasField("pixel_norm") else None)


class RefillStream:
    def __init__(self, endpoint: str, job: str, *, token: str | None = None,
                 consumer_id: str | None = None, root_certificates: bytes | None = None,
                 max_message_mb: int = 256, reconnect_timeout: float = 30.0,
                 load_balancing: str = "round_robin",
                 keepalive_time_s: float = DEFAULT_KEEPALIVE_TIME_S,
                 keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
                 tensors: TensorKind = "numpy") -> None:
        """`keepalive_time_s`, `keepalive_timeout_s`: a silent replica is dropped within their
        sum and the consumer fails over (`trainer_client.channel`). `tensors`: how a request's
        tensors are returned ("numpy", "torch" or "auto", as `BatchStream`)."""
        self.endpoint, self.job = endpoint, job
        self.tensors = resolve_tensor_kind(tensors)
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
        self.revoked: list[str] = []  # the last ask's held ids taken at this consumer's lapse
        self.dropped = 0             # ids cancelled so far (stale and revoked)
        self.completed: list[str] = []  # the last ask's finished ids recorded as completed
        self.waiting = 0             # requests waiting for admission after the last ask
        self.in_flight = 0           # requests leased to any consumer after the last ask
        self.reconnects = 0

    def refill(self, free_tokens: int, finished: Iterable[str] = ()) -> Admitted:
        """Report `finished`, get new requests costing at most `free_tokens` in total, and in
        the result's `cancel` the ids to stop and drop (see the module doc)."""
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
        self.held.difference_update([*done, *reply.revoked])
        # A request taken at a lapse can come back to this consumer in the same reply: it
        # keeps working on it under the new lease (returned once, when first admitted).
        got = Admitted(_request(m, self.tensors) for m in reply.requests
                       if m.id not in self.held)
        got.cancel = (*reply.revoked, *reply.stale)
        self.held.update(m.id for m in reply.requests)
        self.completed, self.stale = list(reply.completed), list(reply.stale)
        self.revoked = list(reply.revoked)
        self.dropped += len(got.cancel)
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
