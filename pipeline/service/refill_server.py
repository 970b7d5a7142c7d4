"""The `Refill` RPC: inference consumers of `mode: refill` jobs (docs/refill.md).

One bidirectional stream per consumer: RefillOpen, then one RefillReply per RefillAsk. This
replica keeps nothing a consumer needs: every lease, completion and counter is in Redis
(`RefillState`), so any replica answers any ask and a consumer reconnecting elsewhere (or after
this process restarts) continues. Each ask is one admission script; the payloads of what it
admitted (prompt ids and images) are read after it (write-once). The job's requests are made by
`RefillProducer`, running on every replica, enqueuing on the one that holds the job's producer
lease.

Stopping is bounded: once `stop()` is called a call ends at its next message (UNAVAILABLE: the
consumer repeats its ask elsewhere or after the restart, with the same sequence number, so
nothing is admitted twice); a handler waiting for its consumer's next message is ended by the
server's own stop, which cancels that read; the one Redis call an ask makes is bounded by the
client's timeouts.

Status codes (precise, never a generic UNKNOWN): NOT_FOUND an unknown job (no served job named);
UNAUTHENTICATED a missing or wrong token; FAILED_PRECONDITION a training job, to a caller holding
its token (Stream serves those);
INVALID_ARGUMENT no Open first, a negative capacity, or unknown / repeated ids in `finished`
(the whole ask is refused before anything is applied); UNAVAILABLE Redis unreachable or the
replica stopping (the client retries the ask with the same call_seq, which returns the same
admission).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from pipeline.config import RefillJobConfig, ServiceConfig
from pipeline.coordinator.refill_state import RefillState, RequestPayload
from pipeline.errors import StateUnavailable, UnknownJob, UserError
from pipeline.modes import JobMode
from pipeline.observability.job_status import ReplicaStatus
from pipeline.observability.status_proto import to_proto
from pipeline.observability.status_view import refill_job_status
from pipeline.preprocess.vision import PIXEL_NORM
from pipeline.producer.refill_producer import RefillProducer
from pipeline.refill.leases import RefillRejected
from pipeline.service.auth import require_token
from pipeline.service.wire_codec import encode
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

log = logging.getLogger(__name__)

MAX_HELD_IDS = 65_536  # a RefillOpen's held ids (they reach Redis and the logs)


@dataclass
class RefillJob:
    """One refill job on this replica: its shared state and this replica's producer."""

    job: RefillJobConfig
    state: RefillState
    producer: RefillProducer


def connect_refill_job(config: ServiceConfig, job: RefillJobConfig, replica_id: str) -> RefillJob:
    """A `mode: refill` job's parts on this replica: its Redis state (registered, or checked
    against the registered config: a changed config under the same job id is refused) and its
    producer (not started)."""
    from pipeline.coordinator import registry

    if not config.redis_url:
        raise UserError(f"job {job.job_id!r}: a `mode: refill` job keeps its leases and "
                        "completions in Redis: configure redis_url (serve's embedded default "
                        "does)")
    state = RefillState.connect(config.redis_url, job.job_id,
                                lease_seconds=job.refill.lease_seconds)
    registry.register_refill_job(state.client, job.job_id,
                                 config_hash=registry.config_hash(job), seed=job.seed,
                                 config=registry.config_record(job))
    return RefillJob(job, state, RefillProducer(job, state, holder=f"replica:{replica_id}"))


def request_message(r: RequestPayload) -> pb.RefillRequest:
    """A request on the wire: int32 prompt ids, and its images as on a training Batch (raw
    uint8 pixels come with `pixel_norm`, how the consumer normalizes them)."""
    req = r.request
    out = pb.RefillRequest(
        id=req.request_id, cost=req.cost, prompt_tokens=req.prompt_tokens,
        generation_tokens=req.generation_tokens, over_budget=req.over_budget, epoch=req.epoch,
        sample_id=req.sample_id, input_ids=encode("input_ids", r.input_ids.astype("<i4")))
    if r.pixel_values is not None and r.image_grid_thw is not None:
        out.pixel_values.CopyFrom(encode("pixel_values", r.pixel_values))
        out.image_grid_thw.CopyFrom(encode("image_grid_thw", r.image_grid_thw))
        if r.pixel_values.dtype == np.uint8:
            PIXEL_NORM.to_wire(out.pixel_norm)
    return out


class RefillServicer:
    def __init__(self, jobs: dict[str, RefillJob], tokens: dict[str, str | None],
                 other_jobs: dict[str, JobMode]) -> None:
        self.jobs = jobs
        self.tokens = tokens  # every served job's (None: open)
        self.other_jobs = other_jobs  # training job id -> its mode (FAILED_PRECONDITION)
        self._stopping = threading.Event()

    def start(self) -> None:
        for j in self.jobs.values():
            j.producer.start()

    def stop(self) -> None:
        """End every call at its next message, stop the producers. The Redis clients stay open
        for an ask being answered (their pools close with the process)."""
        self._stopping.set()
        for j in self.jobs.values():
            j.producer.stop()

    def authorized_job(self, job_id: str, context: grpc.ServicerContext) -> RefillJob:
        """The refill job a call names, once its token checked; an unknown job is NOT_FOUND
        without naming any served job, and a training job's mode is told only to a caller
        holding its token (an unauthenticated caller learns nothing about other jobs)."""
        rj = self.jobs.get(job_id)
        if rj is None and job_id not in self.other_jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, str(UnknownJob.named(job_id)))
        require_token(self.tokens.get(job_id), context, job_id)
        if rj is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job_id!r} has mode '{self.other_jobs[job_id]}': Refill "
                          "serves `mode: refill` jobs; a training job's ranks use Stream "
                          "(trainer_client.BatchStream)")
        return rj  # type: ignore[return-value]

    def job_status(self, job_id: str, replica_id: str) -> pb.JobStatus:
        """GetJob's answer for a refill job (the caller checked the token)."""
        rj = self.jobs[job_id]
        return to_proto(refill_job_status(
            job_id, rj.state.counts(), epochs=rj.job.epochs,
            open=self.tokens.get(job_id) is None, error=rj.producer.error,
            replica=ReplicaStatus(replica_id)))

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
        self._unless_stopping(context)
        consumer = op.consumer_id or f"anon-{uuid.uuid4().hex[:12]}"
        try:
            released = rj.state.open(consumer, list(op.held_ids), op.retry_seq)
        except StateUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; reconnect")
        log.info("job %s: refill consumer %s opened (holding %d, %d re-admitted)", op.job_id,
                 consumer, len(op.held_ids), released, extra={"job": op.job_id})
        for msg in request_iterator:
            self._unless_stopping(context)
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
            yield pb.RefillReply(
                requests=[request_message(r) for r in res.admitted],
                completed=res.completed, stale=res.stale, revoked=res.revoked,
                done=counts.done, waiting=counts.waiting, in_flight=counts.in_flight)

    def _unless_stopping(self, context: grpc.ServicerContext) -> None:
        if self._stopping.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "this replica is stopping: reconnect "
                          "(the ask is repeated with its sequence number: nothing is lost)")


def add_refill_handler(servicer: RefillServicer,
                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    handlers["Refill"] = grpc.stream_stream_rpc_method_handler(
        servicer.Refill, request_deserializer=pb.RefillMessage.FromString,
        response_serializer=pb.RefillReply.SerializeToString)
