"""The odb.v1 DataService servicer: validation, auth, leases, and one sender per rank stream.

A rank stream is a small state machine (`RankSession`): `pos` (next global step to consider),
`epoch` (first epoch whose End is not yet sent), `credits` (batches the client will accept).
Steps are read only from JobState (published before anyone can see them); batches are built on
demand, one at a time, so the server holds at most one collated batch per stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from pipeline import __version__
from pipeline.planner.types import EpochEnd
from pipeline.service.auth import check_token
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.job_state import RankHeld
from pipeline.wire.odb.v1 import data_service_pb2 as pb
from pipeline.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_MODE = {"join": pb.JOIN, "quota": pb.QUOTA}


@dataclass
class RankSession:
    rank: int
    client_id: str
    pos: int
    epoch: int
    credits: int
    cancelled: bool = False
    client_closed: bool = False  # the client half-closed its side (after its final ack)
    last_heartbeat: float = 0.0


def serialize_response(msg: pb.ServerMessage | bytes) -> bytes:
    """Batches arrive already serialized (job_runtime.build_message); End messages do not."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def add_servicer(servicer: DataServicer, server: grpc.Server) -> None:
    """Register like the generated `add_DataServiceServicer_to_server`, but with a Stream
    response serializer that passes pre-serialized batches through."""
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
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "odb.v1.DataService", handlers),))


def _epoch_last_step(end: EpochEnd) -> int:
    finals = [s for s in end.final_step if s is not None]
    return max(finals) if finals else -1


class DataServicer(pb_grpc.DataServiceServicer):
    def __init__(
        self, runtimes: dict[str, JobRuntime], tokens: dict[str, str | None], *,
        lease_seconds: float = 10.0, prefetch_steps: int = 4, resume_grace_s: float = 2.0,
    ) -> None:
        self.runtimes = runtimes
        self.tokens = tokens
        self.lease_seconds = lease_seconds
        self.prefetch_steps = prefetch_steps
        self.resume_grace_s = resume_grace_s

    # --- common checks ---
    def _runtime(self, job_id: str, context: grpc.ServicerContext) -> JobRuntime:
        rt = self.runtimes.get(job_id)
        if rt is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"unknown job {job_id!r}; this server serves {sorted(self.runtimes)}")
        problem = check_token(self.tokens.get(job_id), context.invocation_metadata(), job_id)
        if problem is not None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
        return rt

    # --- unary ---
    def Health(self, request: pb.Ping, context: grpc.ServicerContext) -> pb.Pong:
        return pb.Pong(server_version=__version__)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        rt = self._runtime(request.job_id, context)
        st = rt.state
        out = pb.JobStatus(
            job_id=rt.job.job_id, world_size=rt.world_size, mode=_MODE[rt.mode],
            epochs=rt.job.epochs, published_through=st.published_through(), done=st.is_done(),
            samples_in=rt.samples_in, quarantined=len(rt.quarantined),
            lapsed_ranks=st.lapsed_ranks(), error=rt.error or "",
        )
        for r, info in enumerate(rt.ranks):
            out.ranks.add(rank=r, acked_step=st.acked(r), client_id=info.client_id,
                          connected=info.connected, delivered_step=info.delivered)
        for end in st.epoch_ends():
            out.epoch_ends.add(
                epoch=end.epoch, steps=end.steps, carried_over=len(end.carried_over),
                final_step=[-1 if s is None else s for s in end.final_step],
            )
        return out

    # --- the rank stream ---
    def Stream(self, request_iterator: Iterator[pb.ClientMessage],
               context: grpc.ServicerContext) -> Iterator[pb.ServerMessage | bytes]:
        """Yields End messages and pre-serialized Batch messages (see `serialize_response`)."""
        try:
            first = next(request_iterator)
        except StopIteration:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream closed before Open")
        if first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"first message must be Open, got {first.WhichOneof('kind')}")
        op = first.open
        rt = self._runtime(op.job_id, context)
        self._validate_open(op, rt, context)
        client_id = op.client_id or context.peer()
        try:
            rt.state.claim_rank(op.rank, client_id, self.lease_seconds)
        except RankHeld as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{exc}; retry after the lease lapses")
        session = RankSession(op.rank, client_id, op.resume_step, op.resume_epoch,
                              max(1, min(op.credits or self.prefetch_steps,
                                         self.prefetch_steps)),
                              last_heartbeat=time.monotonic())
        wake = threading.Condition()

        def cancel() -> None:
            session.cancelled = True
            with wake:
                wake.notify_all()

        context.add_callback(cancel)
        reader = threading.Thread(target=self._read_acks, args=(request_iterator, rt, session,
                                                                wake), daemon=True)
        reader.start()
        info = rt.ranks[op.rank]
        info.client_id, info.connected = client_id, True
        log.info("job %s rank %d: client %s opened at step %d epoch %d", op.job_id, op.rank,
                 client_id, op.resume_step, op.resume_epoch)
        try:
            yield from self._send(rt, session, wake, context)
            # After the final END, wait (bounded) for the client's final ack and half-close so
            # the last step is recorded as consumed.
            deadline = time.monotonic() + self.lease_seconds
            with wake:
                while not (session.client_closed or session.cancelled):
                    if time.monotonic() >= deadline:
                        break
                    wake.wait(0.1)
        finally:
            if info.client_id == client_id:
                info.connected = False
            rt.state.release_rank(op.rank, client_id)
            cancel()

    def _validate_open(self, op: pb.Open, rt: JobRuntime, context: grpc.ServicerContext) -> None:
        w = rt.world_size
        if op.world_size != w:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"world_size {op.world_size} does not match job {rt.job.job_id!r}'s "
                          f"world size {w}")
        if not 0 <= op.rank < w:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"rank {op.rank} is outside [0, {w}) for job {rt.job.job_id!r}")
        if op.resume_step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"resume_step must be >= 0, got {op.resume_step}")
        if not 0 <= op.resume_epoch <= rt.job.epochs:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"resume_epoch {op.resume_epoch} is outside [0, {rt.job.epochs}]")
        if op.credits < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"credits must be >= 0, got {op.credits}")
        # A step can only have been delivered once published; after a server restart the plan
        # is being rebuilt, so wait briefly before calling the request impossible.
        deadline = time.monotonic() + self.resume_grace_s
        while op.resume_step > rt.state.published_through() + 1:
            if rt.state.is_done() or time.monotonic() >= deadline or rt.error:
                context.abort(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"resume_step {op.resume_step} is beyond the last published step "
                    f"{rt.state.published_through()} of job {rt.job.job_id!r}: it was never "
                    "delivered",
                )
            rt.wait(0.05)

    def _read_acks(self, requests: Iterator[pb.ClientMessage], rt: JobRuntime,
                   session: RankSession, wake: threading.Condition) -> None:
        try:
            for msg in requests:
                if msg.WhichOneof("kind") != "ack":
                    continue
                step = msg.ack.consumed_step
                # A step can only be consumed once published; ignore impossible acks.
                if 0 <= step <= rt.state.published_through():
                    rt.state.ack(session.rank, step)
                    rt.notify()  # the producer may be waiting for room
                with wake:
                    session.credits += max(0, msg.ack.credits)
                    wake.notify_all()
            with wake:
                session.client_closed = True
                wake.notify_all()
        except grpc.RpcError:
            pass  # the stream ended; the sender sees the cancellation
        except Exception:
            log.exception("job %s rank %d: ack reader failed", rt.job.job_id, session.rank)

    def _heartbeat(self, rt: JobRuntime, s: RankSession) -> None:
        now = time.monotonic()
        if now - s.last_heartbeat >= self.lease_seconds / 3:
            rt.state.heartbeat(s.rank, s.client_id, self.lease_seconds)
            s.last_heartbeat = now

    def _send(self, rt: JobRuntime, s: RankSession, wake: threading.Condition,
              context: grpc.ServicerContext) -> Iterator[pb.ServerMessage | bytes]:
        epochs = rt.job.epochs
        missing_since = 0.0
        while not s.cancelled and s.epoch < epochs:
            if rt.stopping:
                context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down; reconnect")
            if rt.error:
                context.abort(grpc.StatusCode.INTERNAL,
                              f"job {rt.job.job_id!r} producer failed: {rt.error}")
            self._heartbeat(rt, s)
            st = rt.state
            if s.pos <= st.published_through():
                step = st.get_step(s.pos)
                if step is None:  # a lagging replica read, or trimmed from the state's history
                    missing_since = missing_since or time.monotonic()
                    if time.monotonic() - missing_since > 2.0:
                        context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                      f"step {s.pos} of job {rt.job.job_id!r} is no longer in "
                                      "the plan history; resume from a later checkpoint")
                    rt.wait(0.02)
                    continue
                missing_since = 0.0
                if step.epoch < s.epoch:  # steps of epochs the client has finished
                    s.pos += 1
                    continue
                if step.epoch > s.epoch:  # the current epoch ended before this step
                    end = self._end(st, s.epoch)
                    if end is None:
                        rt.wait(0.02)
                        continue
                    yield self._end_message(rt, s, end)
                    continue
                if step.batch_for(s.rank) is not None:
                    with wake:
                        while s.credits <= 0 and not s.cancelled:
                            wake.wait(0.5)
                            self._heartbeat(rt, s)
                    if s.cancelled:
                        return
                    msg = rt.build_message(step, s.rank)
                    s.credits -= 1
                    rt.ranks[s.rank].delivered = step.step
                    yield msg
                s.pos += 1
                continue
            end = self._end(st, s.epoch)
            if end is not None and _epoch_last_step(end) < s.pos:
                yield self._end_message(rt, s, end)
                continue
            rt.wait(0.1)

    @staticmethod
    def _end(st, epoch: int) -> EpochEnd | None:
        return next((e for e in st.epoch_ends() if e.epoch == epoch), None)

    @staticmethod
    def _end_message(rt: JobRuntime, s: RankSession, end: EpochEnd) -> pb.ServerMessage:
        final = end.final_step[s.rank]
        s.epoch += 1
        return pb.ServerMessage(end=pb.End(
            epoch=end.epoch, final_step=-1 if final is None else final, mode=_MODE[rt.mode],
            epoch_steps=end.steps, job_done=s.epoch >= rt.job.epochs,
        ))
