"""The `Refill` RPC: inference consumers of `mode: refill` jobs (docs/refill.md).

One bidirectional stream per consumer: RefillOpen, then one RefillReply per RefillAsk. This
replica keeps nothing a consumer needs: every lease, completion and counter is in Redis
(`RefillState`), so any replica answers any ask and a consumer reconnecting elsewhere (or after
this process restarts) continues. Each ask is one admission script; the payloads of what it
admitted are read after it (write-once). The job's requests are made by `RefillProducer`,
running on every replica, enqueuing on the one that holds the job's producer lease.

Status codes (precise, never a generic UNKNOWN): NOT_FOUND an unknown job; FAILED_PRECONDITION
a training job (Stream serves those); UNAUTHENTICATED a missing or wrong token;
INVALID_ARGUMENT no Open first, a negative capacity, or unknown / repeated ids in `finished`
(the whole ask is refused before anything is applied); UNAVAILABLE Redis unreachable (the
client retries the ask with the same call_seq, which returns the same admission).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from pipeline.config import JobConfig
from pipeline.coordinator.refill_state import LeasedRequest, RefillCounts, RefillState
from pipeline.errors import StateUnavailable
from pipeline.producer.refill_producer import RefillProducer
from pipeline.refill.leases import RefillRejected
from pipeline.service.auth import require_token
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

log = logging.getLogger(__name__)

MAX_HELD_IDS = 65_536  # a RefillOpen's held ids (they reach Redis and the logs)


@dataclass
class RefillJob:
    """One refill job on this replica: its shared state and this replica's producer."""

    job: JobConfig
    state: RefillState
    producer: RefillProducer


def counts_message(c: RefillCounts) -> pb.RefillCounts:
    return pb.RefillCounts(enqueued=c.enqueued, waiting=c.waiting, in_flight=c.in_flight,
                           completed=c.completed, readmitted=c.readmitted, admitted=c.admitted,
                           quarantined=c.quarantined, consumers=c.consumers,
                           exhausted=c.exhausted)


def request_message(r: LeasedRequest) -> pb.RefillRequest:
    ids = r.input_ids
    return pb.RefillRequest(
        id=r.request.request_id, cost=r.request.cost, prompt_tokens=r.request.prompt_tokens,
        generation_tokens=r.request.generation_tokens, over_budget=r.request.over_budget,
        input_ids=pb.Tensor(name="input_ids", dtype=pb.INT32, shape=[len(ids)],
                            data=ids.astype("<i4", copy=False).tobytes()))


class RefillServicer:
    def __init__(self, jobs: dict[str, RefillJob], tokens: dict[str, str | None],
                 other_jobs: dict[str, str]) -> None:
        self.jobs = jobs
        self.tokens = tokens
        self.other_jobs = other_jobs  # training job id -> its mode (FAILED_PRECONDITION)

    def start(self) -> None:
        for j in self.jobs.values():
            j.producer.start()

    def stop(self) -> None:
        # Producers only: the Redis clients stay open for the asks still draining while the
        # gRPC server stops after this (their pools close with the process).
        for j in self.jobs.values():
            j.producer.stop()

    def authorized_job(self, job_id: str, context: grpc.ServicerContext) -> RefillJob:
        rj = self.jobs.get(job_id)
        if rj is None:
            if job_id in self.other_jobs:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"job {job_id!r} has mode {self.other_jobs[job_id]!r}: Refill "
                              "serves `mode: refill` jobs; a training job's ranks use Stream "
                              "(trainer_client.BatchStream)")
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job {job_id!r}")
        require_token(self.tokens.get(job_id), context, job_id)
        return rj

    def job_status(self, job_id: str, replica_id: str) -> pb.JobStatus:
        """GetJob's answer for a refill job (the caller checked the token)."""
        rj = self.jobs[job_id]
        c = rj.state.counts()
        return pb.JobStatus(job_id=job_id, world_size=0, mode=pb.REFILL, epochs=1,
                            published_through=-1, done=c.done, samples_in=c.enqueued,
                            quarantined=c.quarantined, error=rj.producer.error or "",
                            replica_id=replica_id, refill=counts_message(c))

    def Refill(self, request_iterator: Iterator[pb.RefillMessage],
               context: grpc.ServicerContext) -> Iterator[pb.RefillReply]:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the first message of a Refill stream must be RefillOpen, got "
                          f"{'nothing' if first is None else first.WhichOneof('kind')}")
        op = first.open
        rj = self.authorized_job(op.job_id, context)
        if len(op.held_ids) > MAX_HELD_IDS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"held_ids may name at most {MAX_HELD_IDS} requests, got "
                          f"{len(op.held_ids)}")
        consumer = op.consumer_id or f"anon-{uuid.uuid4().hex[:12]}"
        try:
            released = rj.state.open(consumer, list(op.held_ids), op.retry_seq)
        except StateUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; reconnect")
        log.info("job %s: refill consumer %s opened (holding %d, %d re-admitted)", op.job_id,
                 consumer, len(op.held_ids), released, extra={"job": op.job_id})
        for msg in request_iterator:
            if msg.WhichOneof("kind") != "ask":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"expected RefillAsk after the Open, got {msg.WhichOneof('kind')}")
            ask = msg.ask
            if ask.free_tokens < 0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"free_tokens must be >= 0, got {ask.free_tokens}")
            try:
                res = rj.state.refill(consumer, ask.free_tokens, list(ask.finished),
                                      ask.call_seq)
                counts = rj.state.counts()
            except RefillRejected as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job {op.job_id!r}: {exc}")
            except StateUnavailable as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; retry the ask")
            yield pb.RefillReply(requests=[request_message(r) for r in res.admitted],
                                 completed=res.completed, stale=res.stale, done=counts.done,
                                 waiting=counts.waiting, in_flight=counts.in_flight)


def add_refill_handler(servicer: RefillServicer,
                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    handlers["Refill"] = grpc.stream_stream_rpc_method_handler(
        servicer.Refill, request_deserializer=pb.RefillMessage.FromString,
        response_serializer=pb.RefillReply.SerializeToString)
