"""What a job's rank streams ask of it from the replica's event loop, without blocking the loop.

A replica's rank streams are coroutines on one event loop (`loop_server`): no thread per stream
and no thread hand-off per message. The job's state (Redis) and payloads (Ray) answer with
blocking calls, so `JobIO`, the loop's side of a `JobRuntime`, runs every call that may block in
the replica's I/O threads, and groups the frequent ones (`AsyncCoalescer`): the streams asking at
the same time share one round trip for their acks, delivery grants, plan steps, the plan's head
and the failure checks; the members of a model-parallel group share one build of their rank's
batch (one payload fetch per batch, not one per member). `CachedPlan` lets a `RankCursor`
decide from what the `PlanView` holds; a read it would have to make raises `PlanMiss`, and
`JobIO.next_action` makes it off the loop and asks the cursor again.

Bounds (Guarantee 8): a stream waits at most `state_timeout` seconds for any call to the job's
state and twice `payload_timeout` for a batch's payloads (Ray's bound, then a rebuild by id as
long: `payloads.RayPayloads`); past that the call raises
`ReplicaUnavailable` (the stream ends UNAVAILABLE and its client reconnects, to another replica
if it has one), so a partition from Redis or a frozen Ray never holds a stream forever. The
blocked I/O thread finishes on its own (the state's socket timeouts bound it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pipeline.errors import ReplicaUnavailable
from pipeline.jobstate.interface import Member, RankAck, RankCompute
from pipeline.jobstate.worlds import Grant, PlanHead
from pipeline.planner.types import EpochEnd, Step
from pipeline.preprocess.sample import ProcessedSample
from pipeline.service.chunk_framing import WireBatch
from pipeline.service.coalescer import AsyncCoalescer
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.plan_view import PlanView
from pipeline.service.rank_cursor import Action, RankCursor

T = TypeVar("T")
CHECK_SECONDS = 0.25  # how stale the producer error and the lapsed ranks may be
# A group's batches kept for its members that have not taken them yet, per rank, in steps:
# about a client's credit window (members of a model-parallel group run in lockstep).
SHARED_PER_RANK = 4


class PlanMiss(Exception):
    """The cursor needs a read the cache cannot answer: ("head",), ("step", n, rank) or
    ("end", epoch)."""

    def __init__(self, key: tuple) -> None:
        super().__init__(key)
        self.key = key


class CachedPlan:
    """A `PlanReader` over what the `PlanView` holds; `filled` answers the misses read since
    (None included: a step not in the state is an answer too)."""

    def __init__(self, plan: PlanView) -> None:
        self.plan = plan
        self.filled: dict[tuple, Any] = {}

    def _filled(self, key: tuple) -> Any:
        if key not in self.filled:
            raise PlanMiss(key)
        return self.filled[key]

    def head(self) -> PlanHead:
        h = self.plan.cached_head()
        return h if h is not None else self._filled(("head",))

    def step_for(self, n: int, rank: int) -> Step | None:
        hit = self.plan.cached_step(n, rank)
        return hit if hit is not None else self._filled(("step", n, rank))

    def epoch_end(self, epoch: int) -> EpochEnd | None:
        known, end = self.plan.cached_epoch_end(epoch)
        return end if known else self._filled(("end", epoch))


class JobIO:
    def __init__(self, rt: JobRuntime, executor: Executor, loop: asyncio.AbstractEventLoop, *,
                 lease_seconds: float = 10.0, state_timeout: float = 5.0,
                 payload_timeout: float = 10.0) -> None:
        """`lease_seconds`: how long a rank's lease lasts after its client's ack or heartbeat;
        `state_timeout`, `payload_timeout`: the bounds above."""
        self.rt = rt
        self.executor = executor
        self.loop = loop
        self.state_timeout = state_timeout
        self.payload_timeout = payload_timeout
        self._acks: AsyncCoalescer[RankAck, None] = AsyncCoalescer(
            functools.partial(rt.state.ack_many, lease_seconds=lease_seconds), executor)
        self._grants: AsyncCoalescer[tuple[int, int, int], Grant] = AsyncCoalescer(
            rt.state.grant, executor)
        self._compute: AsyncCoalescer[RankCompute, None] = AsyncCoalescer(
            rt.state.record_compute, executor)
        self._steps: AsyncCoalescer[tuple[int, int], Step | None] = AsyncCoalescer(
            rt.plan.fetch_steps, executor)
        self._heads: AsyncCoalescer[None, PlanHead] = AsyncCoalescer(
            lambda keys: [rt.plan.head()] * len(keys), executor)
        self._checks: AsyncCoalescer[float, None] = AsyncCoalescer(self._read_checks, executor)
        self._checked_at = -1.0
        self._tick: asyncio.Future | None = None
        self._pending_head: asyncio.Task | None = None
        self._pending_steps: dict[int, asyncio.Task] = {}  # by rank
        # (step, rank, micro-batch or -1: the payloads): what a group's members share here
        self._shared_made: dict[tuple[int, int, int], _Shared] = {}
        rt.add_waker(self._wake_from_any_thread)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, a call to the job's state, in an I/O thread, bounded. (Nothing run here
        waits on purpose: a wait belongs on the loop, not in one of the few I/O threads.)"""
        return await self._bounded(
            self.loop.run_in_executor(self.executor, functools.partial(fn, *args)))

    async def _bounded(self, call: Awaitable[T], payloads: bool = False) -> T:
        limit = 2 * self.payload_timeout if payloads else self.state_timeout
        try:
            async with asyncio.timeout(limit):
                return await call
        except TimeoutError:
            what = "the batch's payloads" if payloads else "the job's state"
            raise ReplicaUnavailable(
                f"job {self.rt.job.job_id!r}: this replica could not reach {what} within "
                f"{limit:g}s; reconnect") from None

    # --- the plan ---
    async def next_action(self, cursor: RankCursor) -> Action:
        plan = CachedPlan(self.rt.plan)
        while True:
            try:
                action = cursor.next(plan)
                break
            except PlanMiss as miss:
                plan.filled[miss.key] = await self._read(miss.key)
        self._read_ahead(cursor)
        return action

    def _read_ahead(self, cursor: RankCursor) -> None:
        """Keep the reads a stream will make next off its path: the head is re-read once it
        is half its refresh interval old, and a rank's next published steps once the step
        half a read-ahead away is not cached (both in the background, grouped as ever)."""
        plan = self.rt.plan
        if plan.head_age() >= plan.refresh_seconds / 2 and self._pending_head is None:
            self._pending_head = self._background(self._heads(None), self._head_read)
        head = plan.cached_head()
        if head is None or cursor.rank in self._pending_steps:
            return
        ahead = min(cursor.pos + plan.read_ahead // 2, head.published_through)
        if ahead >= cursor.pos and plan.cached_step(ahead, cursor.rank) is None:
            first = next(n for n in range(cursor.pos, ahead + 1)
                         if plan.cached_step(n, cursor.rank) is None)
            rank = cursor.rank
            self._pending_steps[rank] = self._background(
                self._steps((first, rank)), lambda: self._pending_steps.pop(rank, None))

    def _head_read(self) -> None:
        self._pending_head = None

    def _background(self, read: Coroutine[Any, Any, Any], finished: Callable[[], object]
                    ) -> asyncio.Task:
        """Run `read` for the cache; `finished()` once it ended. (Its value and its failure
        are the business of the next read a stream waits on.)"""
        task = self.loop.create_task(read)

        def done(t: asyncio.Task) -> None:
            finished()
            if not t.cancelled():
                t.exception()  # retrieved, so asyncio does not log it

        task.add_done_callback(done)
        return task

    async def _read(self, key: tuple) -> Any:
        if key[0] == "head":
            return await self._bounded(self._heads(None))
        if key[0] == "step":
            return await self._bounded(self._steps((key[1], key[2])))
        return await self.run(self.rt.plan.epoch_end, key[1])

    async def head(self) -> PlanHead:
        """The plan's head, at most `refresh_seconds` stale."""
        return self.rt.plan.cached_head() or await self._bounded(self._heads(None))

    async def tick(self) -> None:
        """Wait until the plan may have changed: the plan's refresh interval, or sooner on
        `JobRuntime.notify`. Every stream waiting meanwhile shares one timer."""
        if self._tick is None or self._tick.done():
            self._tick = self.loop.create_future()
            self.loop.call_later(self.rt.plan.refresh_seconds, _resolve, self._tick)
        await asyncio.shield(self._tick)  # a cancelled waiter leaves the others' tick alone

    def _wake_from_any_thread(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: a runtime outlives it
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._tick is not None:
            _resolve(self._tick)

    # --- writes ---
    async def ack(self, ack: RankAck) -> None:
        """`state.ack_many` of one ack or heartbeat, grouped with the other streams' (raises
        its own refusal: `RankHeld`, `AckAheadOfPlan`, `AckNotDelivered`, ValueError)."""
        await self._bounded(self._acks(ack))

    async def record_compute(self, reports: Sequence[RankCompute]) -> None:
        """`state.record_compute`, grouped with the other streams' reports."""
        await self._bounded(asyncio.gather(*(self._compute(r) for r in reports)))

    async def grant(self, world: int, rank: int, through: int) -> Grant:
        """`state.grant`, grouped with the other streams' grants."""
        return await self._bounded(self._grants((world, rank, through)))

    # --- checks ---
    async def refresh_checks(self, rank_timeout_seconds: float) -> None:
        """Make `rt.error()` and `rt.dead_ranks()` fresh (read at most every CHECK_SECONDS),
        so the stream reads them without I/O (`refresh=False`)."""
        if time.monotonic() - self._checked_at >= CHECK_SECONDS:
            await self._bounded(self._checks(rank_timeout_seconds))

    def _read_checks(self, timeouts: Sequence[float]) -> list[None]:
        for t in set(timeouts):
            self.rt.dead_ranks(t)
        self.rt.error()
        self._checked_at = time.monotonic()
        return [None] * len(timeouts)

    # --- payloads ---
    async def build(self, step: Step, rank: int, micro: int = 0,
                    samples: Sequence[ProcessedSample] | None = None,
                    member: Member | None = None) -> WireBatch:
        """The rank's batch (micro-batch `micro`) as its messages, from `samples` (its payloads
        of the step) or fetched now; built on the loop unless its payloads need I/O. The
        members of a rank's group on this replica share one build (`_shared`)."""
        if member is not None and member.group_size > 1:
            return await self._shared((step.step, rank, micro), member,
                                      lambda: self._build(step, rank, micro, samples))
        return await self._build(step, rank, micro, samples)

    async def fetch(self, step: Step, rank: int, member: Member | None = None
                    ) -> list[ProcessedSample]:
        """The rank's payloads of the step (all its micro-batches), bounded like `build`; the
        members of its group on this replica share one fetch."""
        if member is not None and member.group_size > 1:
            return await self._shared((step.step, rank, -1), member,
                                      lambda: self._fetch(step, rank))
        return await self._fetch(step, rank)

    async def _shared(self, key: tuple[int, int, int], member: Member,
                      make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """One payload fetch, one collation of a batch (`key`: step, rank, micro-batch; -1
        the step's payloads) for all the members of its rank's group on this replica: the
        first to ask makes it, the others wait for that. It is dropped once every member took
        it, or when its rank holds `SHARED_PER_RANK` newer steps (a member that far behind
        makes its own, byte-identical); a failure is not kept (the next ask makes it again)."""
        entry = self._shared_made.get(key)
        if entry is None:
            task = self.loop.create_task(make())
            task.add_done_callback(_retrieved)
            entry = self._shared_made[key] = _Shared(task)
            rank = key[1]
            kept = sorted({k[0] for k in self._shared_made if k[1] == rank})[-SHARED_PER_RANK:]
            for old in [k for k in self._shared_made if k[1] == rank and k[0] < kept[0]]:
                del self._shared_made[old]
        try:
            got = await asyncio.shield(entry.task)
        except Exception:
            if self._shared_made.get(key) is entry:
                del self._shared_made[key]
            raise
        entry.taken.add(member.index)
        if len(entry.taken) >= member.group_size and self._shared_made.get(key) is entry:
            del self._shared_made[key]
        return got

    async def _build(self, step: Step, rank: int, micro: int,
                     samples: Sequence[ProcessedSample] | None) -> WireBatch:
        if self.rt.payloads.blocking:
            return await self._bounded(self.loop.run_in_executor(
                self.executor, self.rt.build_message, step, rank, micro, samples), payloads=True)
        return self.rt.build_message(step, rank, micro, samples)

    async def _fetch(self, step: Step, rank: int) -> list[ProcessedSample]:
        if self.rt.payloads.blocking:
            return await self._bounded(self.loop.run_in_executor(
                self.executor, self.rt.payloads.fetch, step, rank), payloads=True)
        return self.rt.payloads.fetch(step, rank)


@dataclass
class _Shared:
    task: asyncio.Task
    taken: set[int] = field(default_factory=set)  # the members that took it


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # (a build nobody awaits any more: its failure is not logged)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)

