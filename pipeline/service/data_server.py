"""The odb.v1 DataService servicer: validation, auth, leases, and the rank streams.

A rank stream is a `RankCursor` (what to send next) plus credits (batches the client will
accept), served by a coroutine (and its ack reader) on the replica's event loop
(`loop_server`): no thread per stream and no thread hand-off per message; whatever may block
(the job's state, Ray payloads) runs in the replica's I/O threads through `stream_io.JobIO`.
The unary calls (GetJob, Scale, Health) and Refill are plain functions run in the server's
thread pool. Steps are read only from the job's state (published before anyone can see them);
batches are built on demand, one at a time, so a replica holds at most one collated batch per
stream and only payloads of the ranks it serves.

Dead ranks (Guarantee 4). A stream's lease is renewed while it is connected. A rank that got
its final END releases it, as does a stream the server ends; a client whose stream goes away
before that (killed, network gone, or closed early: gRPC cannot tell them apart, and each leaves
its peers waiting) does not: its lease lapses after `lease_seconds`. A rank that never connects
has no lease at all; it counts as lapsed from the moment the job's first stream opened on this
replica. Once a rank has been lapsed for `rank_timeout_seconds` (and not re-claimed) the
`rank_failure_policy` applies: `fail` (default) ends every other rank's stream of the job with
ABORTED naming the rank, how long it has been gone and the policy (GetJob's `error` says the
same); `wait` keeps the others waiting (the producer's back-pressure holds them within
`max_ahead` steps) until the rank comes back. A restarted client of a rank whose previous
stream vanished from *this* replica takes the rank over at once instead of waiting out the
lease; a client that fails over to another replica keeps its client id, so it re-claims at once.

Acks: an ack past the published plan is a client bug: INVALID_ARGUMENT.

Worlds (docs/elastic.md). A stream belongs to one world (`world_open` decides which from the
Open). Before it sends a batch beyond its rank's delivery grant it raises the grant
(`JobRuntime.grant`, a window of the client's credits at a time: one round trip per window,
grouped with the replica's other streams), so a reconfiguration can end the
world exactly where nothing delivered is lost. When its world has ended the stream runs through
the rank's last step, sends END(reconfigure) naming the new world's size, leaves
(`JobState.rank_left`: its lease is released at once, so the rank's next stream is not held up)
and ends. `Scale` is the authenticated call that asks for a reconfiguration (`scaling`);
`rank_failure_policy: shrink` makes one onto the live ranks instead of failing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc

from pipeline import __version__
from pipeline.errors import AckAheadOfPlan, RankHeld, StateUnavailable
from pipeline.planner.types import EpochEnd
from pipeline.service import scaling
from pipeline.service.auth import check_token
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.rank_cursor import (
    Boundary,
    End,
    Finished,
    Missing,
    RankCursor,
    Reconfigure,
    Send,
)
from pipeline.service.refill_server import RefillServicer, add_refill_handler
from pipeline.service.stream_io import JobIO
from pipeline.service.wire_codec import wire_version_problem
from pipeline.service.world_open import RESUME_FROM_CURSOR, OpenRefused, resolve
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A producer's permanent failure by cause (pipeline/producer/failures.py): what the operator must
# fix is FAILED_PRECONDITION, a transient cause that outlasted the retry bound UNAVAILABLE, a bug
# INTERNAL.
_FAILURE_STATUS = {
    "source_missing": grpc.StatusCode.FAILED_PRECONDITION,
    "source_forbidden": grpc.StatusCode.FAILED_PRECONDITION,
    "config": grpc.StatusCode.FAILED_PRECONDITION,
    "plan_conflict": grpc.StatusCode.FAILED_PRECONDITION,
    "state_unavailable": grpc.StatusCode.UNAVAILABLE,
    "not_durable": grpc.StatusCode.UNAVAILABLE,
    "state_rolled_back": grpc.StatusCode.UNAVAILABLE,
    "ray_unavailable": grpc.StatusCode.UNAVAILABLE,
    "source_unreadable": grpc.StatusCode.UNAVAILABLE,
}

_MODE = {"join": pb.JOIN, "quota": pb.QUOTA}
__all__ = ["RESUME_FROM_CURSOR", "DataServicer", "add_servicer"]


@dataclass
class StreamSession:
    """The parts of a stream its ack reader and its sender share (one event loop: no lock)."""

    rank: int
    client_id: str
    credits: int
    cursor: RankCursor
    cancelled: bool = False
    client_closed: bool = False  # the client half-closed its side (after its final ack)
    last_heartbeat: float = 0.0
    error: tuple[grpc.StatusCode, str] | None = None  # set by the ack reader: abort
    leased: bool = True  # holds the rank's lease (a drained rank of an ended world does not)
    granted: int = -1  # the highest step the rank may be sent (its delivery grant)
    window: int = 1  # grants are raised this many steps at a time: the client's credit window
    left: bool = False  # got END(reconfigure): its world ended, it left
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def poke(self) -> None:
        """Something the sender may wait for changed (credits, an error, the client closed)."""
        self._wake.set()

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        self.error = (code, details)
        self.poke()

    async def wait(self, timeout: float) -> None:
        """Until `poke()` or `timeout` seconds."""
        self._wake.clear()
        # (asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that
        # arrives as the event is set, and a vanished client is exactly that.)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()


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
    }
    if servicer.refill is not None:
        add_refill_handler(servicer.refill, handlers)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "odb.v1.DataService", handlers),))


class DataServicer(pb_grpc.DataServiceServicer):
    def __init__(
        self, runtimes: dict[str, JobRuntime], tokens: dict[str, str | None], *,
        replica_id: str = "", lease_seconds: float = 10.0, prefetch_steps: int = 4,
        resume_grace_s: float = 2.0, rank_timeout_seconds: float = 60.0,
        rank_failure_policy: str = "fail", refill: RefillServicer | None = None,
        executor: Executor,
    ) -> None:
        """`executor`: the I/O threads the streams' blocking calls run in."""
        if rank_failure_policy not in ("fail", "wait", "shrink"):
            raise ValueError(f"rank_failure_policy must be 'fail', 'wait' or 'shrink', "
                             f"got {rank_failure_policy!r}")
        self.runtimes = runtimes
        self.tokens = tokens
        self.replica_id = replica_id
        self.lease_seconds = lease_seconds
        self.prefetch_steps = prefetch_steps
        self.resume_grace_s = resume_grace_s
        self.rank_timeout_seconds = rank_timeout_seconds
        self.rank_failure_policy = rank_failure_policy
        self.refill = refill  # the `mode: refill` jobs (refill_server.py), if any
        # (job, rank) -> client id of a stream that vanished from this replica (not released).
        self._vanished: dict[tuple[str, int], str] = {}
        self._vanished_lock = threading.Lock()
        self._waiting_logged: set[tuple[str, int]] = set()
        self.executor = executor
        self._ios: dict[str, JobIO] = {}

    # --- dead ranks (Guarantee 4) ---
    def rank_failure(self, rt: JobRuntime, rank: int | None = None) -> str | None:
        """Under policy `fail`: the error for the ranks other than `rank` when some rank has been
        gone longer than the timeout; None otherwise (and always None under `wait`)."""
        dead = rt.dead_ranks(self.rank_timeout_seconds)
        dead = {r: t for r, t in dead.items() if r != rank}
        if not dead:
            return None
        why = ""
        if self.rank_failure_policy == "shrink":
            why = scaling.shrink(rt, self.rank_timeout_seconds)
            if why is None:
                return None
            why = f" ({why})"
        if self.rank_failure_policy == "wait":
            for r, t in dead.items():
                if (rt.job.job_id, r) not in self._waiting_logged:
                    self._waiting_logged.add((rt.job.job_id, r))
                    log.warning("job %s: rank %d gone for %.1fs; rank_failure_policy=wait: the "
                                "other ranks keep waiting", rt.job.job_id, r, t,
                                extra={"job": rt.job.job_id, "rank": r})
            return None
        gone = ", ".join(f"rank {r} has been gone for {t:.1f}s" for r, t in dead.items())
        return (f"job {rt.job.job_id!r}: {gone} (lease lapsed or never taken, longer than "
                f"rank_timeout_seconds={self.rank_timeout_seconds:g}); "
                f"rank_failure_policy={self.rank_failure_policy}{why}: the other ranks' streams "
                "are aborted instead of waiting for it. Restart the job's trainer ranks from "
                "their checkpoints (or serve with rank_failure_policy=wait)")

    def _claim(self, rt: JobRuntime, rank: int, client_id: str) -> None:
        """Claim the rank; if its holder is a stream that vanished from this replica, take over
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
    def _lookup(self, job_id: str, metadata: object
                ) -> tuple[JobRuntime | None, tuple[grpc.StatusCode, str] | None]:
        """The job's runtime, or why a call for it is refused (status code and message)."""
        rt = self.runtimes.get(job_id)
        if rt is None and self.refill is not None and job_id in self.refill.jobs:
            return None, (grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job_id!r} has mode 'refill': its consumers use the Refill RPC "
                          "(trainer_client.RefillStream), not Stream or Scale")
        if rt is None:
            return None, (grpc.StatusCode.NOT_FOUND,
                          f"unknown job {job_id!r}; this server serves {sorted(self.runtimes)}")
        problem = check_token(self.tokens.get(job_id), metadata, job_id)
        if problem is not None:
            return None, (grpc.StatusCode.UNAUTHENTICATED, problem)
        return rt, None

    def _runtime(self, job_id: str, context: grpc.ServicerContext) -> JobRuntime:
        rt, refusal = self._lookup(job_id, context.invocation_metadata())
        if refusal is not None:
            context.abort(*refusal)
        return rt  # type: ignore[return-value]

    # --- unary ---
    def Health(self, request: pb.Ping, context: grpc.ServicerContext) -> pb.Pong:
        return pb.Pong(server_version=__version__)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        if self.refill is not None and request.job_id in self.refill.jobs:
            self.refill.authorized_job(request.job_id, context)  # checks its token
            return self.refill.job_status(request.job_id, self.replica_id)
        rt = self._runtime(request.job_id, context)
        st = rt.state
        counts = st.counters()
        head = st.head()
        out = pb.JobStatus(
            job_id=rt.job.job_id, world_size=head.world_size, mode=_MODE[rt.mode],
            epochs=rt.job.epochs, published_through=head.published_through,
            done=st.is_done(), samples_in=counts.samples_in, quarantined=counts.quarantined,
            lapsed_ranks=st.lapsed_ranks(), error=rt.error() or self.rank_failure(rt) or "",
            replica_id=self.replica_id, worlds=scaling.worlds_message(st),
            reconfiguring=scaling.reconfiguring(st),
        )
        acked = st.acked_all()
        for r, a in enumerate(acked):
            conn = rt.ranks.get(r)
            out.ranks.add(rank=r, acked_step=a, client_id=conn.client_id if conn else "",
                          connected=bool(conn and conn.connected),
                          delivered_step=conn.delivered if conn else -1)
        for end in st.epoch_ends():
            out.epoch_ends.add(
                epoch=end.epoch, steps=end.steps, carried_over=len(end.carried_over),
                final_step=[-1 if s is None else s for s in end.final_step],
            )
        return out

    def Scale(self, request: pb.ScaleRequest, context: grpc.ServicerContext) -> pb.ScaleReply:
        rt = self._runtime(request.job_id, context)
        try:
            res = scaling.scale(rt, request.world_size)
        except scaling.ScaleRefusal as exc:
            context.abort(exc.code, exc.message)
        return scaling.scale_reply(rt, res)

    # --- the rank stream (a coroutine on the replica's event loop: docs/ARCHITECTURE.md) ---
    def _job_io(self, rt: JobRuntime) -> JobIO:
        jio = self._ios.get(rt.job.job_id)
        if jio is None:  # created on the loop, on first use
            jio = self._ios[rt.job.job_id] = JobIO(rt, self.executor,
                                                    asyncio.get_running_loop())
        return jio

    async def _stream_runtime(self, job_id: str, context: grpc.aio.ServicerContext
                              ) -> JobRuntime:
        rt, refusal = self._lookup(job_id, context.invocation_metadata())
        if refusal is not None:
            await context.abort(*refusal)
        return rt  # type: ignore[return-value]

    async def Stream(self, request_iterator: AsyncIterator[pb.ClientMessage],
                     context: grpc.aio.ServicerContext) -> None:
        """Writes End messages and pre-serialized Batch messages (see `serialize_response`).
        (A coroutine rather than an async generator: a client that goes away cancels it at
        its current await, so the cleanup below always runs with the stream's outcome.)"""
        requests = aiter(request_iterator)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream closed before Open")
        if first.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"first message must be Open, got {first.WhichOneof('kind')}")
        op = first.open
        problem = wire_version_problem(op)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        rt = await self._stream_runtime(op.job_id, context)
        jio = self._job_io(rt)
        try:
            start = await jio.run(functools.partial(resolve, resume_grace_s=self.resume_grace_s),
                                  op, rt)
        except OpenRefused as exc:
            await context.abort(exc.code, exc.message)
        step, epoch = start.pos, start.epoch
        client_id = op.client_id or context.peer()
        if start.has_work:  # a drained rank of an ended world just gets its END: no lease
            try:
                await jio.run(self._claim, rt, op.rank, client_id)
            except RankHeld as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{exc}; retry after the lease lapses")
        cursor = RankCursor(op.rank, rt.job.epochs, pos=step, epoch=epoch, last_sent=step - 1,
                            world=start.world, world_size=start.world_size, limit=start.limit,
                            next_world_size=start.next_world_size)
        credits = max(1, min(op.credits or self.prefetch_steps, self.prefetch_steps))
        session = StreamSession(op.rank, client_id, credits, cursor,
                                last_heartbeat=time.monotonic(), leased=start.has_work,
                                granted=step - 1, window=credits)
        reader = asyncio.ensure_future(self._read_acks(requests, jio, session))
        conn = rt.ranks[op.rank]
        conn.client_id, conn.connected = client_id, True
        log.info("job %s rank %d: client %s opened at step %d epoch %d (world %d of %d ranks)",
                 op.job_id, op.rank, client_id, step, epoch, start.world, start.world_size,
                 extra={"job": op.job_id, "rank": op.rank, "step": step})
        writing: asyncio.Future | None = None
        try:
            # One write in flight per call; the next message is prepared while it goes out.
            async for msg in self._send(jio, session, context):
                if writing is not None:
                    await writing
                writing = asyncio.ensure_future(context.write(msg))
            if writing is not None:
                await writing
            # After the final END, wait (bounded) for the client's final ack and half-close so
            # the last step is recorded as consumed. (After END(reconfigure) there is nothing to
            # record: end at once, the rank is about to open its stream in the new world.)
            deadline = time.monotonic() + (0.0 if session.left else self.lease_seconds)
            while not (session.client_closed or session.cancelled):
                if time.monotonic() >= deadline:
                    break
                await session.wait(0.1)
        except asyncio.CancelledError:  # the client went away (or the server stops)
            session.cancelled = True
            raise
        finally:
            reader.cancel()
            if writing is not None and not writing.done():
                writing.cancel()
            elif writing is not None and not writing.cancelled():
                writing.exception()  # retrieved: the stream's outcome is decided above
            if conn.client_id == client_id:
                conn.connected = False
            # A client whose stream went away before its final END keeps its lease until it
            # lapses: that is how the other ranks learn a peer is gone (Guarantee 4).
            # (A client that half-closed early on purpose leaves them waiting just the same.)
            vanished = ((session.cancelled or session.client_closed)
                        and not (cursor.job_done or session.left) and session.leased)
            if vanished:
                with self._vanished_lock:
                    self._vanished[(rt.job.job_id, op.rank)] = client_id
                log.info("job %s rank %d: client %s vanished; its lease lapses in <= %.1fs",
                         op.job_id, op.rank, client_id, self.lease_seconds,
                         extra={"job": op.job_id, "rank": op.rank, "step": cursor.last_sent})
            elif session.leased:
                try:
                    await jio.run(rt.state.release_rank, op.rank, client_id)
                except Exception:
                    log.warning("job %s rank %d: release failed", op.job_id, op.rank,
                                exc_info=True)
            session.cancelled = True

    async def _read_acks(self, requests: AsyncIterator[pb.ClientMessage], jio: JobIO,
                         session: StreamSession) -> None:
        rt = jio.rt
        try:
            async for msg in requests:
                if msg.WhichOneof("kind") != "ack":
                    continue
                # Credits first: the sender may go on while the ack is recorded.
                session.credits += max(0, msg.ack.credits)
                session.poke()
                step = msg.ack.consumed_step
                if step >= 0:  # -1: nothing consumed yet
                    problem = await self._record_ack(jio, session, step)
                    if problem is not None:
                        session.fail(grpc.StatusCode.INVALID_ARGUMENT, problem)
                        return
                    target = session.cursor.end_ack_due(step)
                    if target is not None:
                        await self._ack(jio, session, target)
            session.client_closed = True
            session.poke()
        except asyncio.CancelledError:
            raise
        except grpc.RpcError:
            pass  # the stream ended; the sender sees the cancellation
        except Exception as exc:  # e.g. StateUnavailable: end the stream, the client resumes
            log.warning("job %s rank %d: ack reader failed: %s: %s", rt.job.job_id,
                        session.rank, type(exc).__name__, exc,
                        exc_info=not isinstance(exc, StateUnavailable),
                        extra={"job": rt.job.job_id, "rank": session.rank})
            session.fail(grpc.StatusCode.UNAVAILABLE,
                         f"job {rt.job.job_id!r}: recording acks failed "
                         f"({type(exc).__name__}: {exc}); reconnect and resume")

    @staticmethod
    async def _ack(jio: JobIO, session: StreamSession, step: int) -> None:
        """`jio.ack` for the rank of a current world's stream. Cursors are the current world's:
        the acks of a rank whose world ended do not move them (nor fail the stream when the
        rank is beyond the new world)."""
        if session.cursor.limit is not None:
            return
        try:
            await jio.ack(session.rank, step)
        except ValueError:
            head = await jio.run(jio.rt.plan.fresh_head)
            if head.generation == session.cursor.world:
                raise

    @classmethod
    async def _record_ack(cls, jio: JobIO, session: StreamSession, step: int) -> str | None:
        """Record the ack; the INVALID_ARGUMENT message if it acknowledges an unsent step."""
        if step <= session.cursor.last_sent and session.cursor.limit is not None:
            return None  # a rank of an ended world: it was sent, nothing to record
        rt = jio.rt
        through = (await jio.head()).published_through
        if step > through:  # the cache may lag by its refresh interval
            through = await jio.run(rt.plan.fresh_published_through)
        try:
            if step > through:
                raise AckAheadOfPlan(f"ack of step {step} by rank {session.rank} of job "
                                     f"{rt.job.job_id!r}, but only steps through {through} "
                                     "are published")
            await cls._ack(jio, session, step)
        except AckAheadOfPlan as exc:
            if step <= session.cursor.last_sent:
                # We sent it, so it was published: the state lost it (a Redis crash without
                # fsync_publish) and the producer republishes it. Acks are cumulative.
                log.warning("job %s rank %d: ack of step %d ahead of the state's plan (state "
                            "lost recent writes?): deferred", rt.job.job_id, session.rank, step,
                            extra={"job": rt.job.job_id, "rank": session.rank, "step": step})
                return None
            return f"{exc}: a step can only be acked after it was delivered"
        return None

    async def _check_abort(self, jio: JobIO, s: StreamSession,
                           context: grpc.aio.ServicerContext) -> None:
        """Abort the stream if its ack reader failed, the producer failed, or a peer rank is
        gone under policy `fail`; renew the rank's lease when due. No I/O while the cached
        checks are fresh (`JobIO.refresh_checks`)."""
        rt = jio.rt
        if s.error is not None:
            await context.abort(*s.error)
        await jio.refresh_checks(self.rank_timeout_seconds)
        failure = rt.producer_failure(refresh=False)
        if failure is not None and failure.permanent:  # a transient one: keep waiting
            await context.abort(_FAILURE_STATUS.get(failure.cause, grpc.StatusCode.INTERNAL),
                                f"job {rt.job.job_id!r} producer failed: {failure.message}")
        failure = await self._rank_failure_of(jio, s.rank)
        if failure is not None:
            log.warning("job %s rank %d: aborting stream: %s", rt.job.job_id, s.rank, failure,
                        extra={"job": rt.job.job_id, "rank": s.rank,
                               "step": s.cursor.last_sent})
            await context.abort(grpc.StatusCode.ABORTED, failure)
        now = time.monotonic()
        if s.leased and now - s.last_heartbeat >= self.lease_seconds / 3:
            s.last_heartbeat = now
            await jio.run(rt.state.heartbeat, s.rank, s.client_id, self.lease_seconds)

    async def _rank_failure_of(self, jio: JobIO, rank: int) -> str | None:
        """`rank_failure` from the fresh cached lapses (its policy's own I/O, a shrink, only
        when some rank is gone)."""
        dead = jio.rt.dead_ranks(self.rank_timeout_seconds, refresh=False)
        if not any(r != rank for r in dead):
            return None
        return await jio.run(self.rank_failure, jio.rt, rank)

    async def _send(self, jio: JobIO, s: StreamSession, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.ServerMessage | bytes]:
        rt = jio.rt
        missing_since = 0.0
        while not s.cancelled:
            if s.client_closed:  # closed early on purpose: every ack it sent is recorded
                return
            if rt.stopping:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "server is shutting down; reconnect")
            await self._check_abort(jio, s, context)
            action = await jio.next_action(s.cursor)
            if isinstance(action, Finished):
                return
            if isinstance(action, Boundary):  # the world ended: learn this rank's last step
                await self._grant(jio, s, s.cursor.pos)
                continue
            if isinstance(action, Reconfigure):
                yield await self._reconfigure_message(jio, s, action)
                return
            if isinstance(action, Missing):
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since > 1.0:
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                        f"step {action.step} of job {rt.job.job_id!r} is no "
                                        "longer in the plan (an epoch every rank finished); "
                                        "resume from a later checkpoint")
                await jio.tick()
                continue
            missing_since = 0.0
            if isinstance(action, End):
                yield await self._end_message(jio, s, action.end)
                continue
            if isinstance(action, Send):
                while (s.credits <= 0 and not (s.cancelled or s.client_closed)
                       and s.error is None):
                    await s.wait(0.5)
                    await self._check_abort(jio, s, context)
                if s.cancelled or s.client_closed:
                    return
                if s.error is not None:
                    await context.abort(*s.error)
                n = action.step.step
                if n > s.granted and not await self._grant(jio, s, n + s.window - 1, n):
                    continue  # its world ended before this step, or the state is behind
                msg = await jio.build(action.step, s.rank, s.cursor.world_size)
                s.credits -= 1
                s.cursor.sent(action.step)
                rt.ranks[s.rank].delivered = n
                yield msg
                continue
            await jio.tick()  # Wait: nothing published for this rank yet

    @staticmethod
    async def _grant(jio: JobIO, s: StreamSession, through: int, need: int | None = None
                     ) -> bool:
        """Raise the rank's delivery grant towards `through`; True if step `need` may be sent.
        An ended world answers with the rank's last step instead (the cursor's limit)."""
        g = await jio.grant(s.cursor.world, s.rank, through)
        if g.ended:  # it may be sent everything through its last step, no more
            s.cursor.limit, s.cursor.next_world_size = g.through, g.next_world_size
            s.granted = max(s.granted, g.through)
            return False
        s.granted = max(s.granted, g.through)
        if need is None or s.granted >= need:
            return True
        await jio.tick()  # the state holds less of the plan than we read (it lost writes)
        return False

    @staticmethod
    async def _reconfigure_message(jio: JobIO, s: StreamSession,
                                   action: Reconfigure) -> pb.ServerMessage:
        """This rank ran its ended world's last step: it leaves (its lease is released now, so
        the rank's stream in the new world is not held up), then gets END(reconfigure)."""
        rt = jio.rt
        try:
            await jio.run(rt.state.rank_left, s.cursor.world, s.rank, s.client_id)
        except Exception:  # the lease then lapses; the switch completes all the same
            log.warning("job %s rank %d: recording its exit from world %d failed",
                        rt.job.job_id, s.rank, s.cursor.world, exc_info=True)
        s.leased, s.left = False, True
        log.info("job %s rank %d: world %d ended at step %d; END(reconfigure) to %d ranks",
                 rt.job.job_id, s.rank, s.cursor.world, s.cursor.limit, action.world_size,
                 extra={"job": rt.job.job_id, "rank": s.rank, "step": s.cursor.limit})
        return pb.ServerMessage(end=pb.End(
            epoch=s.cursor.epoch, final_step=s.cursor.limit, mode=_MODE[rt.mode],
            epoch_steps=0, job_done=False, reason=pb.END_REASON_RECONFIGURE,
            world_size=action.world_size))

    async def _end_message(self, jio: JobIO, s: StreamSession, end: EpochEnd
                           ) -> pb.ServerMessage:
        rt = jio.rt
        s.cursor.ended(end)
        # Ack it through the epoch's last step now if it acked everything it was sent (a rank
        # with no batch at all acked "everything"); else its next ack triggers it (whichever
        # of the two sees the ack first takes the entry). (A rank of an ended world has no
        # cursor to move.)
        if s.cursor.limit is None:
            acked = -1 if s.cursor.last_sent < 0 else await jio.run(rt.state.acked, s.rank)
            target = s.cursor.end_ack_due(acked)
            if target is not None:
                await self._ack(jio, s, target)
        final = end.final_step[s.rank]
        return pb.ServerMessage(end=pb.End(
            epoch=end.epoch, final_step=-1 if final is None else final, mode=_MODE[rt.mode],
            epoch_steps=end.steps, job_done=s.cursor.job_done, reason=pb.END_REASON_EPOCH,
        ))
