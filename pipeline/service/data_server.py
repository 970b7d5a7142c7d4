"""The odb.v1 DataService servicer: a thin gRPC adapter over the replica's domain code.

It decodes requests, checks the job and its token, calls the domain (`rank_stream` for Stream,
`scaling` for Scale, `mix` for Mix, the job's state for GetJob) and turns the domain errors
they raise into status codes with one table, `STATUS_OF` (nothing else in the service knows
gRPC's codes; the Refill RPC has its own handler, `refill_server`). The rank streams are
coroutines on the replica's event loop (`loop_server`); the unary calls (GetJob, Scale, Mix,
Health) and Refill are plain functions run in the server's thread pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable

import grpc

from pipeline import __version__
from pipeline.errors import (
    AckAheadOfPlan,
    AckNotDelivered,
    BadRequest,
    GroupRefused,
    JobFinished,
    MixRefused,
    OdbError,
    PositionUnavailable,
    ProducerFailed,
    ProducerMisconfigured,
    ProducerUnavailable,
    RankHeld,
    RankTimedOut,
    ReplicaUnavailable,
    ScaleRefused,
    StateUnavailable,
    Unauthenticated,
    UnknownJob,
    WireMismatch,
    WrongJobMode,
)
from pipeline.observability.status_proto import to_proto
from pipeline.observability.status_view import training_job_status
from pipeline.service import mix, scaling
from pipeline.service.auth import check_token
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.liveness import LivenessPolicy, reported_failure
from pipeline.service.rank_stream import RankStreams
from pipeline.service.refill_server import RefillServicer, add_refill_handler
from pipeline.service.wire_codec import wire_version_problem
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc
from trainer_client.wire_format import FINAL_STATUS_KEY, STREAM_ACCEPTED

# The one table from the domain's errors to status codes (the most specific class wins).
STATUS_OF: dict[type[BaseException], grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    AckAheadOfPlan: grpc.StatusCode.INVALID_ARGUMENT,
    AckNotDelivered: grpc.StatusCode.INVALID_ARGUMENT,
    PositionUnavailable: grpc.StatusCode.OUT_OF_RANGE,
    UnknownJob: grpc.StatusCode.NOT_FOUND,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    WrongJobMode: grpc.StatusCode.FAILED_PRECONDITION,
    WireMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    RankHeld: grpc.StatusCode.FAILED_PRECONDITION,
    GroupRefused: grpc.StatusCode.FAILED_PRECONDITION,
    ScaleRefused: grpc.StatusCode.FAILED_PRECONDITION,
    MixRefused: grpc.StatusCode.FAILED_PRECONDITION,
    RankTimedOut: grpc.StatusCode.ABORTED,
    ProducerFailed: grpc.StatusCode.INTERNAL,  # a bug
    ProducerMisconfigured: grpc.StatusCode.FAILED_PRECONDITION,  # an operator must fix it
    ProducerUnavailable: grpc.StatusCode.UNAVAILABLE,  # it heals: a cause outlasted retries
    ReplicaUnavailable: grpc.StatusCode.UNAVAILABLE,
    StateUnavailable: grpc.StatusCode.UNAVAILABLE,
}


# Errors a client must not retry whatever their code (`FINAL_STATUS_KEY`): the job failed for
# good, and every replica would answer the same until an operator acts.
FINAL = (ProducerFailed, JobFinished)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code of a domain error (UNKNOWN for anything the table does not name)."""
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.UNKNOWN


def serialize_response(msg: pb.ServerMessage | bytes) -> bytes:
    """Batches arrive already serialized (`batch_builder`); End messages do not."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def add_servicer(servicer: DataServicer, server: grpc.aio.Server) -> None:
    """Register like the generated `add_DataServiceServicer_to_server`, but with a Stream
    response serializer that passes pre-serialized batches through (and Refill when the
    servicer carries refill jobs)."""
    handlers = {
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=pb.Ping.FromString,
            response_serializer=pb.Pong.SerializeToString),
        "Stream": grpc.stream_stream_rpc_method_handler(
            servicer.Stream, request_deserializer=pb.ClientMessage.FromString,
            response_serializer=serialize_response),
        "GetJob": grpc.unary_unary_rpc_method_handler(
            servicer.GetJob, request_deserializer=pb.GetJobRequest.FromString,
            response_serializer=pb.JobStatus.SerializeToString),
        "Scale": grpc.unary_unary_rpc_method_handler(
            servicer.Scale, request_deserializer=pb.ScaleRequest.FromString,
            response_serializer=pb.ScaleReply.SerializeToString),
        "Mix": grpc.unary_unary_rpc_method_handler(
            servicer.Mix, request_deserializer=pb.MixRequest.FromString,
            response_serializer=pb.MixReply.SerializeToString),
    }
    if servicer.refill is not None:
        add_refill_handler(servicer.refill, handlers)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "odb.v1.DataService", handlers),))


def job_status(rt: JobRuntime, replica_id: str, policy: LivenessPolicy, *, open_: bool
               ) -> pb.JobStatus:
    """GetJob's answer for a training job: the job's typed status (its state plus this
    replica's connections), rendered as the proto. A read: it never acts on the failure policy
    (`reported_failure`)."""
    return to_proto(training_job_status(
        rt.job.job_id, rt.state, job=rt.job, open=open_,
        error=rt.error() or reported_failure(rt, policy), facts=rt.facts(),
        replica_id=replica_id,
        batch_size_notice=rt.batch_notice))


async def _client_messages(requests: AsyncIterator[pb.ClientMessage]
                           ) -> AsyncIterator[pb.ClientMessage]:
    """The client's messages; a call that broke ends them with ConnectionResetError (a
    half-close ends them plainly)."""
    try:
        async for msg in requests:
            yield msg
    except grpc.RpcError as exc:
        raise ConnectionResetError(f"the call broke: {exc}") from None


class DataServicer(pb_grpc.DataServiceServicer):
    def __init__(self, runtimes: dict[str, JobRuntime], tokens: dict[str, str | None], *,
                 streams: RankStreams, replica_id: str = "",
                 refill: RefillServicer | None = None,
                 state_reachable: Callable[[], bool] = lambda: True) -> None:
        """`state_reachable`: False while the replica knows it cannot reach its jobs' state
        (`readiness.StateWatch`): a new stream is then refused at once (UNAVAILABLE), its client
        reconnects elsewhere instead of waiting out the state timeout here."""
        self.runtimes = runtimes
        self.tokens = tokens
        self.streams = streams
        self.replica_id = replica_id
        self.refill = refill  # the `mode: refill` jobs (refill_server.py), if any
        self.state_reachable = state_reachable

    def _lookup(self, job_id: str, metadata: Iterable[tuple[str, str | bytes]] | None
                ) -> JobRuntime:
        """The job's runtime, once the call carries its token. The token is checked before
        anything about the job is told (a refill job's mode included), as in Refill: an
        unauthenticated caller learns nothing."""
        rt = self.runtimes.get(job_id)
        refill = rt is None and self.refill is not None and job_id in self.refill.jobs
        if rt is None and not refill:
            raise UnknownJob.named(job_id)
        problem = check_token(self.tokens.get(job_id), metadata, job_id)
        if problem is not None:
            raise Unauthenticated(problem)
        if rt is None:
            raise WrongJobMode(f"job {job_id!r} has mode 'refill': its consumers use the Refill "
                               "RPC (trainer_client.RefillStream), not Stream or Scale")
        return rt

    # --- unary (plain functions in the server's thread pool) ---
    def Health(self, request: pb.Ping, context: grpc.ServicerContext) -> pb.Pong:
        return pb.Pong(server_version=__version__)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        if self.refill is not None and request.job_id in self.refill.jobs:
            self.refill.authorized_job(request.job_id, context)  # checks its token
            return self.refill.job_status(request.job_id, self.replica_id)
        try:
            rt = self._lookup(request.job_id, context.invocation_metadata())
            return job_status(rt, self.replica_id, self.streams.policy,
                              open_=self.tokens.get(request.job_id) is None)
        except OdbError as exc:
            context.abort(status_of(exc), str(exc))

    def Scale(self, request: pb.ScaleRequest, context: grpc.ServicerContext) -> pb.ScaleReply:
        try:
            rt = self._lookup(request.job_id, context.invocation_metadata())
            return scaling.scale_reply(rt, scaling.scale(rt, request.world_size))
        except OdbError as exc:
            context.abort(status_of(exc), str(exc))

    def Mix(self, request: pb.MixRequest, context: grpc.ServicerContext) -> pb.MixReply:
        try:
            rt = self._lookup(request.job_id, context.invocation_metadata())
            return mix.mix_reply(rt, mix.mix(rt, dict(request.weights)))
        except OdbError as exc:
            context.abort(status_of(exc), str(exc))

    # --- the rank stream (a coroutine on the replica's event loop) ---
    async def Stream(self, request_iterator: AsyncIterator[pb.ClientMessage],
                     context: grpc.aio.ServicerContext) -> None:
        """Writes End messages and pre-serialized Batch messages (see `serialize_response`).
        (A coroutine rather than an async generator: a client that goes away cancels it at
        its current await, so the stream's cleanup always runs with its outcome.)"""
        requests = aiter(request_iterator)
        try:
            try:
                first = await anext(requests)
            except StopAsyncIteration:
                raise BadRequest("stream closed before Open") from None
            if first.WhichOneof("kind") != "open":
                raise BadRequest(f"first message must be Open, got {first.WhichOneof('kind')}")
            op = first.open
            problem = wire_version_problem(op)
            if problem:
                raise WireMismatch(problem)
            rt = self._lookup(op.job_id, context.invocation_metadata())
            if not self.state_reachable():
                raise ReplicaUnavailable(f"job {op.job_id!r}: this replica cannot reach the "
                                         "job's state (NOT_SERVING); reconnect")
            await self.streams.serve(
                rt, op, op.client_id or context.peer(), _client_messages(requests),
                context.write, accepted=lambda: context.send_initial_metadata((STREAM_ACCEPTED,)))
        except OdbError as exc:
            final = ((FINAL_STATUS_KEY, "1"),) if isinstance(exc, FINAL) else ()
            await context.abort(status_of(exc), str(exc), trailing_metadata=final)
