"""One rank's stream on a replica: open, send, grant, ack, end (no gRPC here).

A rank stream is a `RankCursor` (what to send next) plus credits (the batches and the bytes the
client will accept: `credit_window.CreditWindow`), served by a coroutine (and its ack reader) on
the replica's event loop (`loop_server`): no thread per stream and no thread hand-off per
message; whatever may block (the job's state, Ray payloads) runs in the replica's I/O threads
through `stream_io.JobIO`. Steps are read only from the job's state (published before anyone can
see them); batches are built on demand, one at a time, so a replica holds at most one collated
batch per stream and only payloads of the ranks it serves.

    streams = RankStreams(settings, policy, executor)
    await streams.serve(rt, open_msg, client_id, requests, write)   # raises why it ended

`requests` are the client's decoded messages after its Open, `write` sends one server message
(an End, or a batch's messages already serialized: one, or a BatchHeader and its chunks). A
stream that cannot go on raises a domain error of `pipeline.errors` (`BadRequest`,
`PositionUnavailable`, `RankHeld`, `RankTimedOut`, `ProducerFailed`, `ReplicaUnavailable`,
`StateUnavailable`, ...); the gRPC adapter (`data_server.py`) gives each its status code.

Leases (Guarantees 4, 8). A rank's lease is renewed only on evidence from its client: its
Open, its Acks and its Heartbeats (which a client sends from its gRPC request thread while it
has nothing else to say, so a trainer busy in a long step keeps its lease and a frozen one does
not); a stream that is merely connected renews nothing. Each renewal is checked: a stream whose
rank another client took ends (`RankHeld`). A rank that got its final END releases its lease.
A stream that ends before that keeps it, whether its client went away (killed, network gone,
or closed early: the server cannot tell them apart, and each leaves its peers waiting) or the
server ended it with an error (its trainer may exit on it): the lease lapses `lease_seconds`
after the client's last sign of life, and the job's `rank_failure_policy` (`liveness.py`)
decides what the other ranks' streams do (a released rank would never be judged gone). A
restarted client of a rank whose previous stream ended on *this* replica takes the rank over at
once instead of waiting out the lease, unless the rank was claimed again since (on any replica:
that holder is alive, and the new client gets `RankHeld`); a client that fails over to another
replica keeps its client id, so it re-claims at once.

Groups (docs/trainer-client.md): the members of a rank's model-parallel group (`Open.group_size`,
`group_rank`) each have a stream of the rank; each stream holds its member's seat in the group's
lease (`JobState`, `interface.Member`), renewed on that member's evidence, and acks for it (the
rank's cursor is the group's slowest member's); a lost member is a lost rank to its peers too.
The members on one replica share one build of each batch (`JobIO.build`).

Acks: a client acknowledges only steps it was sent (`AckNotDelivered` otherwise: the state's
cursor never skips a step the rank did not get), with at most `MAX_CREDITS` credits at a time.

Bounds (Guarantee 8): every call to the job's state and to the payloads is bounded
(`stream_io.JobIO`); a replica that cannot reach them ends the stream `ReplicaUnavailable` and
never sends a batch beyond the rank's delivery grant recorded in the state.

Worlds (docs/elastic.md). A stream belongs to one world (`world_open` decides which from the
Open). Before it sends a batch beyond its rank's delivery grant it raises the grant
(`JobIO.grant`, a window of the client's credits at a time: one round trip per window,
grouped with the replica's other streams), so a reconfiguration can end the world exactly where
nothing delivered is lost. When its world has ended the stream runs through the rank's last
step, sends END(reconfigure) naming the new world's size, leaves (`JobState.rank_left`: its
lease is released at once, so the rank's next stream is not held up) and ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from pipeline.errors import (
    AckAheadOfPlan,
    AckNotDelivered,
    BadRequest,
    OdbError,
    PositionUnavailable,
    ProducerFailed,
    ProducerMisconfigured,
    ProducerUnavailable,
    RankHeld,
    RankTimedOut,
    ReplicaUnavailable,
    StateUnavailable,
    WireMismatch,
)
from pipeline.jobstate.interface import Member, ProducerFailure, RankAck, RankCompute
from pipeline.modes import JobMode
from pipeline.planner.types import EpochEnd
from pipeline.producer.failures import Cause
from pipeline.service.credit_window import CreditError, CreditWindow
from pipeline.service.job_runtime import JobRuntime, RankConnection
from pipeline.service.liveness import LivenessPolicy, rank_failure
from pipeline.service.rank_cursor import (
    Boundary,
    End,
    Finished,
    Missing,
    RankCursor,
    Reconfigure,
    Send,
)
from pipeline.service.stream_io import JobIO
from pipeline.service.wire_codec import wire_version_problem
from pipeline.service.world_open import (
    MAX_CREDITS,
    StreamStart,
    beyond_the_plan,
    member_of,
    resolve,
)
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

MAX_COMPUTE_REPORTS = 64  # per Ack (a client sends one per batch taken since its last Ack)

log = logging.getLogger(__name__)

MODE = {JobMode.JOIN: pb.JOIN, JobMode.QUOTA: pb.QUOTA}
Write = Callable[[pb.ServerMessage | bytes], Awaitable[None]]


@dataclass(frozen=True)
class StreamSettings:
    """A replica's settings for its rank streams (`ServiceConfig`)."""

    lease_seconds: float = 10.0  # a lease lasts this long after the client's sign of life
    prefetch_steps: int = 4  # the most credits a client gets (its Open may ask for fewer)
    resume_grace_s: float = 60.0  # a position past the plan: how long the plan may not grow
    state_timeout_seconds: float = 5.0  # the longest wait for the job's state: UNAVAILABLE
    payload_timeout_seconds: float = 10.0  # the longest wait for a batch's payloads


@dataclass
class StreamSession:
    """The parts of a stream its ack reader and its sender share (one event loop: no lock)."""

    rank: int
    client_id: str
    credits: CreditWindow
    cursor: RankCursor
    claim: int = 0  # the number of this stream's claim of the rank (`RankLease.claim`)
    member: Member | None = None  # its seat in the rank's model-parallel group (None: alone)
    cancelled: bool = False
    client_closed: bool = False  # the client half-closed its side (after its final ack)
    error: OdbError | None = None  # set by the ack reader: the stream ends with it
    leased: bool = True  # holds the rank's lease (a drained rank of an ended world does not)
    granted: int = -1  # the highest step the rank may be sent (its delivery grant)
    window: int = 1  # grants are raised this many steps at a time: the client's credit window
    left: bool = False  # got END(reconfigure): its world ended, it left
    unreachable: bool = False  # ended because the job's state or payloads could not be reached
    renewed_at: float = field(default_factory=time.monotonic)  # the lease's last renewal
    # A global step's payloads of this rank (all its micro-batches), fetched once for them all:
    # (step, samples); (-1, None) when none is held.
    payloads: tuple[int, list | None] = (-1, None)
    # An Open's position past the published plan, until the plan reaches it; the plan's last
    # step when the stream last saw it grow, and when.
    awaited: int | None = None
    awaited_plan: tuple[int, float] = (-1, 0.0)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def poke(self) -> None:
        """Something the sender may wait for changed (credits, an error, the client closed)."""
        self._wake.set()

    def fail(self, error: OdbError) -> None:
        self.error = error
        self.poke()

    async def wait(self, timeout: float) -> None:
        """Until `poke()` or `timeout` seconds."""
        self._wake.clear()
        # (asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that
        # arrives as the event is set, and a vanished client is exactly that.)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()


def _seat(member: Member | None) -> int:
    return -1 if member is None else member.index


def producer_failed(job_id: str, failure: ProducerFailure) -> ProducerFailed:
    """What a permanent producer failure ends the job's streams with, by its cause
    (`pipeline/producer/failures.py`): what an operator must fix, a cause that heals once the
    producer's retries ran out, or a bug."""
    try:
        cause = Cause(failure.cause)
    except ValueError:
        cause = Cause.INTERNAL
    kind = (ProducerUnavailable if cause.transient else ProducerFailed
            if cause is Cause.INTERNAL else ProducerMisconfigured)
    return kind(f"job {job_id!r} producer failed: {failure.message}")


class RankStreams:
    """The rank streams of one replica, every job's: what they share (the settings, the
    failure policy, each job's `JobIO`, the clients that vanished from this replica)."""

    def __init__(self, settings: StreamSettings, policy: LivenessPolicy,
                 executor: Executor) -> None:
        """`executor`: the I/O threads the streams' blocking calls run in."""
        self.settings = settings
        self.policy = policy
        self.executor = executor
        # (job, rank, group seat or -1) -> (client id, claim) of a stream that ended on this
        # replica before its final END (its lease not released).
        self._vanished: dict[tuple[str, int, int], tuple[str, int]] = {}
        self._vanished_lock = threading.Lock()
        self._ios: dict[str, JobIO] = {}

    def job_io(self, rt: JobRuntime) -> JobIO:
        jio = self._ios.get(rt.job.job_id)
        if jio is None:  # created on the loop, on first use
            st = self.settings
            jio = self._ios[rt.job.job_id] = JobIO(
                rt, self.executor, asyncio.get_running_loop(), lease_seconds=st.lease_seconds,
                state_timeout=st.state_timeout_seconds,
                payload_timeout=st.payload_timeout_seconds)
        return jio

    def claim(self, rt: JobRuntime, rank: int, client_id: str,
              member: Member | None = None) -> int:
        """Claim the rank, or the member's seat in its group (`RankHeld` while another live
        client holds it); returns the claim's number (claims are counted per rank, and per
        seat). If its holder is a stream that ended on this replica and no claim of it came
        since (the holder did not claim it again elsewhere: it is dead), take over at once
        (release that lease first) rather than wait out the lease."""
        key = (rt.job.job_id, rank, _seat(member))
        with self._vanished_lock:
            old = self._vanished.pop(key, None)
        if old is not None and old[0] != client_id:
            try:  # a no-op unless that client still holds it by that very claim
                rt.state.release_rank(rank, *old, member=member)
            except Exception:
                log.debug("release of vanished client %s failed", old[0], exc_info=True)
        try:
            return rt.state.claim_rank(rank, client_id, self.settings.lease_seconds,
                                       member=member).claim
        except RankHeld as exc:
            raise RankHeld(f"{exc}; retry after the lease lapses") from None

    def vanished(self, rt: JobRuntime, rank: int, client_id: str, claim: int,
                 member: Member | None = None) -> None:
        """`client_id`'s stream of `rank` (its claim `claim`; of its seat `member`) ended here
        without releasing."""
        with self._vanished_lock:
            self._vanished[(rt.job.job_id, rank, _seat(member))] = (client_id, claim)

    async def serve(self, rt: JobRuntime, op: pb.Open, client_id: str,
                    requests: AsyncIterator[pb.ClientMessage], write: Write,
                    accepted: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve the rank of `op` (or its seat in the rank's group) until its END (or its
        world's END(reconfigure)), the client closes or goes away (cancellation), or the stream
        must end (a domain error). `accepted` runs once the Open is (the position resolved,
        the rank claimed)."""
        if rt.job.batching.global_token_budget is not None:  # micro-batches: a newer client
            problem = wire_version_problem(op, global_steps=True)
            if problem:
                raise WireMismatch(problem)
        member = member_of(op, rt)
        jio = self.job_io(rt)
        prefetch = self.settings.prefetch_steps
        credits = CreditWindow.opened(max(1, min(op.credits or prefetch, prefetch)),
                                      op.prefetch_bytes, op.held_bytes)
        start = await jio.run(resolve, op, rt)
        claim = 0
        if start.has_work:  # a drained rank of an ended world just gets its END: no lease
            claim = await jio.run(self.claim, rt, op.rank, client_id, member)
        if accepted is not None:
            await accepted()
        stream = RankStream(self, jio, op, client_id, start, credits, claim, member)
        await stream.run(requests, write)


class RankStream:
    """One stream: its session, the send loop and the ack reader."""

    def __init__(self, streams: RankStreams, jio: JobIO, op: pb.Open, client_id: str,
                 start: StreamStart, credits: CreditWindow, claim: int,
                 member: Member | None = None) -> None:
        self.streams = streams
        self.settings = streams.settings
        self.jio = jio
        self.rt = jio.rt
        self.job_id = op.job_id
        cursor = RankCursor(op.rank, self.rt.job.epochs, pos=start.pos, epoch=start.epoch,
                            last_sent=start.pos - 1, world=start.world, limit=start.limit,
                            next_world_size=start.next_world_size)
        self.s = StreamSession(op.rank, client_id, credits, cursor, claim=claim, member=member,
                               leased=start.has_work, granted=start.pos - 1,
                               window=credits.steps,
                               awaited=start.pos if start.beyond_plan else None)
        log.info("job %s rank %d: client %s opened at step %d epoch %d (world %d of %d ranks)",
                 op.job_id, op.rank, client_id, start.pos, start.epoch, start.world,
                 start.world_size, extra={"job": op.job_id, "rank": op.rank,
                                          "step": start.pos})

    def _connection(self) -> RankConnection:
        """What this replica shows of the stream (status): its rank's, or its member's."""
        s = self.s
        return (self.rt.ranks[s.rank] if s.member is None
                else self.rt.members[(s.rank, s.member.index)])

    def _log_extra(self) -> dict:
        return {"job": self.job_id, "rank": self.s.rank, "step": self.s.cursor.last_sent}

    async def run(self, requests: AsyncIterator[pb.ClientMessage], write: Write) -> None:
        s = self.s
        reader = asyncio.ensure_future(self._read_acks(requests))
        conn = self._connection()
        conn.client_id, conn.connected = s.client_id, True
        writing: asyncio.Future | None = None
        try:
            # One write in flight per call; the next message is prepared while it goes out.
            async for msg in self._send():
                if writing is not None:
                    await writing
                writing = asyncio.ensure_future(write(msg))
            if writing is not None:
                await writing
            # After the final END, wait for the client's final ack and half-close so the last
            # step is recorded as consumed: while the client shows signs of life (a trainer
            # still working through the batches it holds keeps its heartbeats), and a lease
            # after its last one. (After END(reconfigure) there is nothing to record: end at
            # once, the rank is about to open its stream in the new world.)
            while not (s.client_closed or s.cancelled or s.left or self.rt.stopping):
                if time.monotonic() - s.renewed_at >= self.settings.lease_seconds:
                    break
                await s.wait(0.1)
        except asyncio.CancelledError:  # the client went away (or the server stops)
            s.cancelled = True
            raise
        except (ReplicaUnavailable, StateUnavailable):
            s.unreachable = True  # (its release could only wait out the bound again)
            raise
        finally:
            reader.cancel()
            if writing is not None and not writing.done():
                writing.cancel()
            elif writing is not None and not writing.cancelled():
                writing.exception()  # retrieved: the stream's outcome is decided above
            if conn.client_id == s.client_id:
                conn.connected = False
            await self._finish()

    async def _finish(self) -> None:
        s, rt = self.s, self.rt
        # A stream that ends before its final END (its client went away, or the server ended
        # it with an error its trainer may exit on) keeps its lease until it lapses: that is
        # how the other ranks learn a peer is gone (Guarantee 4). (A client that half-closed
        # early on purpose leaves them waiting just the same.)
        if s.leased and not s.cursor.job_done:
            self.streams.vanished(rt, s.rank, s.client_id, s.claim, s.member)
            log.info("job %s rank %d: client %s %s; its lease lapses in <= %.1fs",
                     self.job_id, s.rank, s.client_id,
                     "vanished" if s.cancelled or s.client_closed else "was ended",
                     self.settings.lease_seconds, extra=self._log_extra())
        elif s.leased and not s.unreachable:  # (else it lapses: the client is elsewhere)
            try:
                await self.jio.run(functools.partial(rt.state.release_rank, s.rank, s.client_id,
                                                     member=s.member))
            except Exception:
                log.warning("job %s rank %d: release failed", self.job_id, s.rank,
                            exc_info=True)
        s.cancelled = True

    # --- the ack reader ---
    async def _read_acks(self, requests: AsyncIterator[pb.ClientMessage]) -> None:
        s = self.s
        try:
            async for msg in requests:
                kind = msg.WhichOneof("kind")
                if kind == "ack":
                    problem = await self._on_ack(msg.ack)
                elif kind == "heartbeat":
                    problem = await self._renew(-1)
                else:
                    problem = BadRequest(f"expected Ack or Heartbeat after the Open, got {kind}")
                if problem is not None:
                    s.fail(problem)
                    return
            s.client_closed = True
            s.poke()
        except asyncio.CancelledError:
            raise
        except ConnectionError:
            pass  # the call broke: the sender sees its cancellation
        except Exception as exc:  # e.g. StateUnavailable: end the stream, the client resumes
            log.warning("job %s rank %d: ack reader failed: %s: %s", self.job_id, s.rank,
                        type(exc).__name__, exc, exc_info=not isinstance(exc, OdbError),
                        extra=self._log_extra())
            s.fail(exc if isinstance(exc, ReplicaUnavailable | StateUnavailable)
                   else ReplicaUnavailable(f"job {self.job_id!r}: recording acks failed "
                                           f"({type(exc).__name__}: {exc}); reconnect"))

    async def _on_ack(self, ack: pb.Ack) -> OdbError | None:
        """Take the ack's credits, record its step (a sign of life either way); the error that
        ends the stream, if any."""
        s, step = self.s, ack.consumed_step
        if not 0 <= ack.credits <= MAX_CREDITS:
            return BadRequest(f"Ack credits must be in [0, {MAX_CREDITS}], got {ack.credits}")
        if step > s.cursor.last_sent:
            return AckNotDelivered(f"ack of step {step} by rank {s.rank} of job "
                                   f"{self.job_id!r}, which was sent steps through "
                                   f"{s.cursor.last_sent} only: a step can only be acked after "
                                   "it was delivered")
        if len(ack.compute) > MAX_COMPUTE_REPORTS:
            return BadRequest(f"an Ack carries at most {MAX_COMPUTE_REPORTS} compute reports, "
                              f"got {len(ack.compute)}")
        for c in ack.compute:
            if not 0 <= c.step <= s.cursor.last_sent:
                return BadRequest(f"compute report of step {c.step} by rank {s.rank} of job "
                                  f"{self.job_id!r}, which was sent steps through "
                                  f"{s.cursor.last_sent} only")
        # Credits first: the sender may go on while the ack is recorded. (Never more than the
        # replica's window in flight, whatever a client returns.)
        try:
            s.credits.returned(ack.credits, ack.credit_bytes)
        except CreditError as exc:
            return exc
        s.credits.steps = min(s.credits.steps, self.settings.prefetch_steps)
        s.poke()
        problem = await self._renew(step)
        if problem is None and step >= 0:
            target = s.cursor.end_ack_due(step)
            if target is not None:
                problem = await self._renew(target)
        if problem is None and ack.compute:
            await self._record_compute(ack.compute)
        return problem

    async def _record_compute(self, reports: Sequence[pb.ComputeReport]) -> None:
        """Keep the reports when the job balances by compute and the rank is of the current
        world (an ended world's reports describe another layout). Best effort: a report lost
        to an unavailable state only delays the fit, so it never ends the stream."""
        s = self.s
        if not (self.rt.job.batching.compute_balancing.enabled and s.leased
                and s.cursor.limit is None):
            return
        try:
            await self.jio.record_compute([RankCompute(s.cursor.world, c.step, s.rank, c.seconds)
                                           for c in reports])
        except (StateUnavailable, ReplicaUnavailable) as exc:
            log.info("job %s rank %d: compute reports not kept: %s", self.job_id, s.rank, exc,
                     extra=self._log_extra())

    async def _renew(self, step: int) -> OdbError | None:
        """Record the client's sign of life (its lease renewed) and, for a rank of the current
        world, its ack through `step` (-1: a heartbeat); the error that ends the stream: its
        lease was taken by another client (`RankHeld`)."""
        s = self.s
        if not s.leased:
            return None  # a drained rank of an ended world: no lease, no cursor
        current = s.cursor.limit is None
        # A heartbeat renews the lease; an ack only every third of a lease (it is checked,
        # and taken back if lapsed, every time): the same evidence, fewer writes.
        now = time.monotonic()
        renew = step < 0 or now - s.renewed_at >= self.settings.lease_seconds / 3
        ack = RankAck(s.rank, s.client_id, step if current else -1, renew, s.member)
        if ack.step > s.granted:  # an END's ack through steps the rank has no batch in
            await self._grant(ack.step)
        try:
            await self.jio.ack(ack)
            if renew:
                s.renewed_at = now
        except RankHeld as exc:
            return RankHeld(f"{exc}: this stream of client {s.client_id!r} ends (another "
                            "client took the rank)")
        except (AckAheadOfPlan, AckNotDelivered):
            # We sent it, so it was published and granted: the state lost recent writes (a
            # Redis crash without fsync_publish; the producer republishes). Acks are cumulative.
            log.warning("job %s rank %d: ack of step %d ahead of the state (it lost recent "
                        "writes?): deferred", self.job_id, s.rank, step, extra=self._log_extra())
        except ValueError:
            head = await self.jio.run(self.rt.plan.fresh_head)
            if head.generation == s.cursor.world:
                raise
            # The world ended meanwhile and the rank is beyond the new one: nothing to record.
        return None

    # --- the sender ---
    async def _check_abort(self) -> None:
        """Raise why the stream must end: its ack reader failed, the producer failed, or a peer
        rank is gone under policy `fail`. No I/O while the cached checks are fresh
        (`JobIO.refresh_checks`). (A stream never renews its rank's lease by itself: only its
        client's Open, Acks and Heartbeats do.)"""
        s, rt, jio = self.s, self.rt, self.jio
        if s.error is not None:
            raise s.error
        policy = self.streams.policy
        await jio.refresh_checks(policy.timeout_seconds)
        failure = rt.producer_failure(refresh=False)
        if failure is not None and failure.permanent:  # a transient one: keep waiting
            raise producer_failed(self.job_id, failure)
        failure = await self._rank_failure()
        if failure is not None:
            log.warning("job %s rank %d: aborting stream: %s", self.job_id, s.rank, failure,
                        extra=self._log_extra())
            raise RankTimedOut(failure)

    async def _rank_failure(self) -> str | None:
        """`liveness.rank_failure` from the fresh cached lapses (the policy's own I/O, a
        shrink, only when some rank is gone). A member of a group counts its own rank too:
        a lost member is its peers' lost rank."""
        policy = self.streams.policy
        dead = self.rt.dead_ranks(policy.timeout_seconds, refresh=False)
        mine = None if self.s.member is not None else self.s.rank
        if not any(r != mine for r in dead):
            return None
        return await self.jio.run(rank_failure, self.rt, policy, mine)

    async def _send(self) -> AsyncIterator[pb.ServerMessage | bytes]:
        s, rt, jio = self.s, self.rt, self.jio
        missing_since = 0.0
        while not s.cancelled:
            if s.client_closed:  # closed early on purpose: every ack it sent is recorded
                return
            if rt.stopping:
                raise ReplicaUnavailable("server is shutting down; reconnect")
            await self._check_abort()
            action = await jio.next_action(s.cursor)
            if s.awaited is not None:
                await self._await_position(action)
            if isinstance(action, Finished):
                return
            if isinstance(action, Boundary):  # the world ended: learn this rank's last step
                await self._grant(s.cursor.pos)
                continue
            if isinstance(action, Reconfigure):
                yield await self._reconfigure_message(action)
                return
            if isinstance(action, Missing):
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since > 1.0:
                    raise PositionUnavailable(
                        f"step {action.step} of job {self.job_id!r} is no longer in the plan "
                        "(an epoch every rank finished); resume from a later checkpoint")
                await jio.tick()
                continue
            missing_since = 0.0
            if isinstance(action, End):
                yield await self._end_message(action.end)
                continue
            if isinstance(action, Send):
                if not await self._await_credit(0):  # a step credit
                    return
                n = action.step.step
                if n > s.granted and not await self._grant(n + s.window - 1, n):
                    continue  # its world ended before this step, or the state is behind
                micros = len(action.step.micros_for(s.rank))
                held, samples = s.payloads
                if micros > 1 and held != n:  # one fetch serves all the rank's micro-batches
                    samples = await jio.fetch(action.step, s.rank, s.member)
                    s.payloads = (n, samples)
                batch = await jio.build(action.step, s.rank, action.micro,
                                        samples if micros > 1 else None, s.member)
                if not await self._await_credit(batch.nbytes):  # room in its byte window
                    return
                s.credits.sent(batch.nbytes)
                s.cursor.sent(action.step, action.micro)
                if action.micro == micros - 1:
                    s.payloads = (-1, None)
                self._connection().delivered = n
                for msg in batch.messages():  # a chunk is copied into its message as it goes
                    yield msg
                continue
            await jio.tick()  # Wait: nothing published for this rank yet

    async def _await_position(self, action: object) -> None:
        """The stream opened at a position past the published plan (the job's state lost
        publications the client had received; the producer publishes them again after its
        backoff and a replay from its checkpoint): it waits for the plan to get there as long
        as the plan grows. OUT_OF_RANGE (`PositionUnavailable`) once the epoch's END is
        published before the position, or `resume_grace_s` went by with nothing new
        published."""
        s = self.s
        through = (await self.jio.head()).published_through
        if s.awaited <= through + 1:
            s.awaited = None  # the plan got there: an ordinary stream from now on
            return
        if isinstance(action, End) and action.end.last_step + 1 < s.awaited:
            raise beyond_the_plan(self.job_id, s.awaited, through,
                                  f" and epoch {action.end.epoch} ended at step "
                                  f"{action.end.last_step}")
        now = time.monotonic()
        if through > s.awaited_plan[0]:
            s.awaited_plan = (through, now)
        elif now - s.awaited_plan[1] > self.settings.resume_grace_s:
            raise beyond_the_plan(self.job_id, s.awaited, through,
                                  f" and nothing new was published for "
                                  f"{self.settings.resume_grace_s:g}s")

    async def _await_credit(self, nbytes: int) -> bool:
        """Until the client's credits let a batch of `nbytes` go (0: until a step credit is
        left); False if the stream ended meanwhile (the client went away or closed)."""
        s = self.s
        while not (s.credits.may_send(nbytes) or s.cancelled or s.client_closed
                   or s.error is not None):
            await s.wait(0.5)
            await self._check_abort()
        if s.error is not None:
            raise s.error
        return not (s.cancelled or s.client_closed)

    async def _grant(self, through: int, need: int | None = None) -> bool:
        """Raise the rank's delivery grant towards `through`; True if step `need` may be sent.
        An ended world answers with the rank's last step instead (the cursor's limit)."""
        s = self.s
        g = await self.jio.grant(s.cursor.world, s.rank, through)
        if g.ended:  # it may be sent everything through its last step, no more
            s.cursor.limit, s.cursor.next_world_size = g.through, g.next_world_size
            s.granted = max(s.granted, g.through)
            return False
        s.granted = max(s.granted, g.through)
        if need is None or s.granted >= need:
            return True
        await self.jio.tick()  # the state holds less of the plan than we read (it lost writes)
        return False

    async def _reconfigure_message(self, action: Reconfigure) -> pb.ServerMessage:
        """This rank ran its ended world's last step: it leaves (its lease is released now, so
        the rank's stream in the new world is not held up), then gets END(reconfigure)."""
        s, rt = self.s, self.rt
        try:
            await self.jio.run(functools.partial(rt.state.rank_left, s.cursor.world, s.rank,
                                                 s.client_id, member=s.member))
        except Exception:  # the lease then lapses; the switch completes all the same
            log.warning("job %s rank %d: recording its exit from world %d failed",
                        self.job_id, s.rank, s.cursor.world, exc_info=True)
        s.leased, s.left = False, True
        log.info("job %s rank %d: world %d ended at step %d; END(reconfigure) to %d ranks",
                 self.job_id, s.rank, s.cursor.world, s.cursor.limit, action.world_size,
                 extra={"job": self.job_id, "rank": s.rank, "step": s.cursor.limit})
        return pb.ServerMessage(end=pb.End(
            epoch=s.cursor.epoch, final_step=s.cursor.limit, mode=MODE[rt.mode],
            epoch_steps=0, job_done=False, reason=pb.END_REASON_RECONFIGURE,
            world_size=action.world_size))

    async def _end_message(self, end: EpochEnd) -> pb.ServerMessage:
        s, rt = self.s, self.rt
        s.cursor.ended(end)
        # Ack it through the epoch's last step now if it acked everything it was sent (a rank
        # with no batch at all acked "everything"); else its next ack triggers it (whichever
        # of the two sees the ack first takes the entry). (A rank of an ended world has no
        # cursor to move.)
        if s.cursor.limit is None:
            acked = -1 if s.cursor.last_sent < 0 else await self.jio.run(rt.state.acked, s.rank)
            target = s.cursor.end_ack_due(acked)
            if target is not None:
                problem = await self._renew(target)
                if problem is not None:
                    raise problem
        final = end.final_for(s.rank)
        return pb.ServerMessage(end=pb.End(
            epoch=end.epoch, final_step=-1 if final is None else final, mode=MODE[rt.mode],
            epoch_steps=end.steps, job_done=s.cursor.job_done, reason=pb.END_REASON_EPOCH,
        ))
