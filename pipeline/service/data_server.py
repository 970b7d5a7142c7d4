"""The odb.v1 DataService servicer: validation, auth, leases, and one sender per rank stream.

A rank stream is a small state machine (`RankSession`): `pos` (next global step to consider),
`epoch` (first epoch whose End is not yet sent), `credits` (batches the client will accept).
Steps are read only from JobState (published before anyone can see them); batches are built on
demand, one at a time, so the server holds at most one collated batch per stream.

Dead ranks (Guarantee 4). A stream's lease is renewed while it is connected. A rank that got
its final END (job done) releases it, as does a stream the server ends; a client whose stream
goes away before that (killed, network gone, or closed early: gRPC cannot tell them apart, and
each leaves its peers waiting) does not: its lease lapses after `lease_seconds`. Once a rank has
been lapsed for `rank_timeout_seconds` (and not re-claimed) the `rank_failure_policy` applies:
`fail` (default) ends every other rank's stream of the job with ABORTED naming the rank, how long
it has been gone and the policy (GetJob's `error` says the same); `wait` keeps the others waiting
(the producer's back-pressure holds them within `max_ahead` steps) until the rank comes back,
and only reports it (`lapsed_ranks`, a log line). A rank that comes back before the timeout
changes nothing. A restarted client of a rank whose previous stream vanished from *this* server
takes the rank over at once (this server knows that stream is gone) instead of waiting out the
lease.

Acks: an ack past the published plan is a client bug: INVALID_ARGUMENT. When a rank has acked
everything it was sent before its END of an epoch, it is acked through the epoch's last step (join
mode: the steps it has no batch in), so the coordinator can trim them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pipeline import __version__
from pipeline.planner.types import EpochEnd
from pipeline.redis_client import RedisUnavailable
from pipeline.service.auth import check_token
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.job_state import RankHeld

try:  # the coordinator package is optional (memory-only deployments)
    from pipeline.coordinator.errors import AckAheadOfPlan
except ImportError:  # pragma: no cover
    class AckAheadOfPlan(ValueError):  # type: ignore[no-redef]
        pass
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

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
    last_sent: int = -1  # highest step sent on this stream (resume_step - 1 before any)
    error: tuple[grpc.StatusCode, str] | None = None  # set by the ack reader: abort the stream
    # (trigger, target): once the rank acks `trigger` (everything sent before an END), ack it
    # through `target` (that epoch's last step). Guarded by the stream's `wake` condition.
    end_acks: list[tuple[int, int]] = field(default_factory=list)


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
        rank_timeout_seconds: float = 60.0, rank_failure_policy: str = "fail",
    ) -> None:
        if rank_failure_policy not in ("fail", "wait"):
            raise ValueError(f"rank_failure_policy must be 'fail' or 'wait', "
                             f"got {rank_failure_policy!r}")
        self.runtimes = runtimes
        self.tokens = tokens
        self.lease_seconds = lease_seconds
        self.prefetch_steps = prefetch_steps
        self.resume_grace_s = resume_grace_s
        self.rank_timeout_seconds = rank_timeout_seconds
        self.rank_failure_policy = rank_failure_policy
        # (job, rank) -> client id of a stream that vanished from this server (not released).
        self._vanished: dict[tuple[str, int], str] = {}
        self._vanished_lock = threading.Lock()
        self._waiting_logged: set[tuple[str, int]] = set()

    # --- dead ranks (Guarantee 4) ---
    def rank_failure(self, rt: JobRuntime, rank: int | None = None) -> str | None:
        """Under policy `fail`: the error for the ranks other than `rank` when some rank has been
        gone longer than the timeout; None otherwise (and always None under `wait`)."""
        dead = rt.dead_ranks(self.rank_timeout_seconds)
        dead = {r: t for r, t in dead.items() if r != rank}
        if not dead:
            return None
        if self.rank_failure_policy == "wait":
            for r, t in dead.items():
                if (rt.job.job_id, r) not in self._waiting_logged:
                    self._waiting_logged.add((rt.job.job_id, r))
                    log.warning("job %s: rank %d gone for %.1fs (lease lapsed); "
                                "rank_failure_policy=wait: the other ranks keep waiting",
                                rt.job.job_id, r, t, extra={"job": rt.job.job_id, "rank": r})
            return None
        gone = ", ".join(f"rank {r} has been gone for {t:.1f}s" for r, t in dead.items())
        return (f"job {rt.job.job_id!r}: {gone} (lease lapsed longer than "
                f"rank_timeout_seconds={self.rank_timeout_seconds:g}); "
                "rank_failure_policy=fail: the other ranks' streams are aborted instead of "
                "waiting for it. Restart the job's trainer ranks from their checkpoints "
                "(or serve with rank_failure_policy=wait)")

    def _claim(self, rt: JobRuntime, rank: int, client_id: str) -> None:
        """Claim the rank; if its holder is a stream that vanished from this server, take over
        at once (release the dead holder's lease first) rather than wait out the lease."""
        key = (rt.job.job_id, rank)
        with self._vanished_lock:
            old = self._vanished.pop(key, None)
        if old is not None and old != client_id:
            try:
                rt.state.release_rank(rank, old)  # a no-op unless `old` still holds it
            except Exception:
                log.debug("release of vanished client %s failed", old, exc_info=True)
        rt.state.claim_rank(rank, client_id, self.lease_seconds)

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
            lapsed_ranks=st.lapsed_ranks(), error=rt.error or self.rank_failure(rt) or "",
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
            self._claim(rt, op.rank, client_id)
        except RankHeld as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{exc}; retry after the lease lapses")
        session = RankSession(op.rank, client_id, op.resume_step, op.resume_epoch,
                              max(1, min(op.credits or self.prefetch_steps,
                                         self.prefetch_steps)),
                              last_heartbeat=time.monotonic(), last_sent=op.resume_step - 1)
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
                 client_id, op.resume_step, op.resume_epoch,
                 extra={"job": op.job_id, "rank": op.rank, "step": op.resume_step})
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
            # A client whose stream went away before its final END keeps its lease until it
            # lapses: that is how the other ranks learn a peer is gone (Guarantee 4). (gRPC
            # cannot tell a killed client from one that closed early: both cancel the call, and
            # either leaves its peers waiting.) Finished ranks and server-ended streams release.
            vanished = session.cancelled and session.epoch < rt.job.epochs
            if vanished:
                with self._vanished_lock:
                    self._vanished[(rt.job.job_id, op.rank)] = client_id
                log.info("job %s rank %d: client %s vanished; its lease lapses in <= %.1fs",
                         op.job_id, op.rank, client_id, self.lease_seconds,
                         extra={"job": op.job_id, "rank": op.rank, "step": session.last_sent})
            else:
                try:
                    rt.state.release_rank(op.rank, client_id)
                except Exception:
                    log.warning("job %s rank %d: release failed", op.job_id, op.rank,
                                exc_info=True)
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
        # (Polls the runtime's shared cache: many ranks reconnecting at once cost one read per
        # refresh interval; the state itself is asked before refusing.)
        deadline = time.monotonic() + self.resume_grace_s
        while op.resume_step > rt.cached_published_through() + 1:
            if rt.state.is_done() or time.monotonic() >= deadline or rt.error:
                if op.resume_step <= rt.state.published_through() + 1:
                    break  # the cache lagged
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
                if step >= 0:  # -1: nothing consumed yet
                    problem = None
                    through = rt.cached_published_through()
                    if step > through:  # the cache may lag by its refresh interval
                        through = rt.state.published_through()
                    try:
                        if step > through:
                            raise AckAheadOfPlan(
                                f"ack of step {step} by rank {session.rank} of job "
                                f"{rt.job.job_id!r}, but only steps through {through} are "
                                "published")
                        rt.ack(session.rank, step)  # grouped with other streams' acks
                    except AckAheadOfPlan as exc:
                        if step <= session.last_sent:
                            # We sent it, so it was published: the state lost it (a Redis
                            # crash without fsync_publish) and the producer republishes it.
                            # Acks are cumulative: the next one covers this one.
                            log.warning("job %s rank %d: ack of step %d ahead of the state's "
                                        "plan (state lost recent writes?): deferred",
                                        rt.job.job_id, session.rank, step,
                                        extra={"job": rt.job.job_id, "rank": session.rank,
                                               "step": step})
                        else:
                            problem = (f"{exc}: a step can only be acked after it was "
                                       "delivered")
                    if problem is not None:
                        with wake:
                            session.error = (grpc.StatusCode.INVALID_ARGUMENT, problem)
                            wake.notify_all()
                        return
                    self._apply_end_acks(rt, session, wake, step)
                    rt.notify()  # the producer may be waiting for room
                with wake:
                    session.credits += max(0, msg.ack.credits)
                    wake.notify_all()
            with wake:
                session.client_closed = True
                wake.notify_all()
        except grpc.RpcError:
            pass  # the stream ended; the sender sees the cancellation
        except Exception as exc:  # e.g. RedisUnavailable: end the stream, the client resumes
            log.warning("job %s rank %d: ack reader failed: %s: %s", rt.job.job_id,
                        session.rank, type(exc).__name__, exc,
                        exc_info=not isinstance(exc, RedisUnavailable),
                        extra={"job": rt.job.job_id, "rank": session.rank})
            with wake:
                session.error = (grpc.StatusCode.UNAVAILABLE,
                                 f"job {rt.job.job_id!r}: recording acks failed "
                                 f"({type(exc).__name__}: {exc}); reconnect and resume")
                wake.notify_all()

    @staticmethod
    def _apply_end_acks(rt: JobRuntime, s: RankSession, wake: threading.Condition,
                        acked: int) -> None:
        """Ack the rank through an epoch's last step once it acked all it was sent before that
        epoch's END (join mode: Redis can then trim the steps it has no batch in)."""
        with wake:
            ready = [t for trig, t in s.end_acks if trig <= acked]
            if not ready:
                return
            s.end_acks = [(trig, t) for trig, t in s.end_acks if trig > acked]
        target = max(ready)
        if target > acked:
            rt.state.ack(s.rank, target)

    def _check_abort(self, rt: JobRuntime, s: RankSession,
                     context: grpc.ServicerContext) -> None:
        if s.error is not None:
            context.abort(*s.error)
        failure = self.rank_failure(rt, s.rank)
        if failure is not None:
            log.warning("job %s rank %d: aborting stream: %s", rt.job.job_id, s.rank, failure,
                        extra={"job": rt.job.job_id, "rank": s.rank, "step": s.last_sent})
            context.abort(grpc.StatusCode.ABORTED, failure)

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
            self._check_abort(rt, s, context)
            self._heartbeat(rt, s)
            # Shared job state through the runtime's per-process cache (one read per refresh
            # interval / per step for all streams, not one round trip per check per rank).
            if s.pos <= rt.cached_published_through():
                step = rt.cached_step(s.pos)
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
                    end = rt.cached_epoch_end(s.epoch)
                    if end is None:
                        rt.wait(0.02)
                        continue
                    yield self._end_message(rt, s, end, wake)
                    continue
                if step.batch_for(s.rank) is not None:
                    with wake:
                        while s.credits <= 0 and not s.cancelled and s.error is None:
                            wake.wait(0.5)
                            self._heartbeat(rt, s)
                            if self.rank_failure(rt, s.rank) is not None:
                                break
                    if s.cancelled:
                        return
                    self._check_abort(rt, s, context)
                    msg = rt.build_message(step, s.rank)
                    s.credits -= 1
                    rt.ranks[s.rank].delivered = step.step
                    s.last_sent = max(s.last_sent, step.step)
                    yield msg
                s.pos += 1
                continue
            end = rt.cached_epoch_end(s.epoch)
            if end is not None and _epoch_last_step(end) < s.pos:
                yield self._end_message(rt, s, end, wake)
                continue
            rt.wait(0.1)

    def _end_message(self, rt: JobRuntime, s: RankSession, end: EpochEnd,
                     wake: threading.Condition) -> pb.ServerMessage:
        final = end.final_step[s.rank]
        s.epoch += 1
        last = _epoch_last_step(end)
        if last > s.last_sent:  # steps after this rank's last batch: ack them when it is done
            with wake:
                s.end_acks.append((s.last_sent, last))
            if s.last_sent < 0:
                self._apply_end_acks(rt, s, wake, -1)
            else:
                self._apply_end_acks(rt, s, wake, rt.state.acked(s.rank))
        return pb.ServerMessage(end=pb.End(
            epoch=end.epoch, final_step=-1 if final is None else final, mode=_MODE[rt.mode],
            epoch_steps=end.steps, job_done=s.epoch >= rt.job.epochs,
        ))
