"""The streams' event-loop side of a job (`stream_io.JobIO`) and its grouped calls
(`AsyncCoalescer`): a cursor decides from the cache and reads only what it lacks, off the loop;
reads ahead happen in the background; concurrent asks share one call; a cancelled caller or a
failed call harms nobody else."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from service_helpers import job_dict
from test_plan_view import CountingState, _publish, _step, gated_call_many

from pipeline.config import TrainingJobConfig
from pipeline.jobstate import MemoryJobState
from pipeline.preprocess.array_source import ArraySource
from pipeline.service.coalescer import AsyncCoalescer
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.payloads import ArrayPayloads
from pipeline.service.rank_cursor import Missing, RankCursor, Send, Wait
from pipeline.service.stream_io import JobIO


@pytest.fixture
def io_threads():
    pool = ThreadPoolExecutor(4)
    yield pool
    pool.shutdown()


def test_async_coalescer_groups_waiting_calls_and_keeps_errors_per_caller(io_threads):
    seen: list[list[int]] = []
    gate = threading.Event()

    async def main() -> dict[int, object]:
        c = AsyncCoalescer(gated_call_many(seen, gate), io_threads)

        async def call(k: int) -> object:
            try:
                return await c(k)
            except ValueError as exc:
                return exc

        first = asyncio.ensure_future(call(0))
        await asyncio.sleep(0.1)  # its call is in flight: the others queue behind it
        rest = [asyncio.ensure_future(call(k)) for k in range(1, 8)]
        await asyncio.sleep(0.1)
        gate.set()
        out = await asyncio.gather(first, *rest)
        return dict(enumerate(out))

    out = asyncio.run(main())
    assert seen == [[0], list(range(1, 8))]  # the seven waiting callers went together
    assert isinstance(out[5], ValueError) and out[3] == 30 and out[0] == 0


def test_async_coalescer_a_failed_call_reaches_its_callers_and_a_cancelled_one_nobody(
        io_threads):
    calls = 0

    def call_many(keys):
        nonlocal calls
        calls += 1
        time.sleep(0.05)
        if calls == 1:
            raise ConnectionError("state down")
        return list(keys)

    async def main() -> None:
        c = AsyncCoalescer(call_many, io_threads)
        with pytest.raises(ConnectionError):
            await c(1)
        gone = asyncio.ensure_future(c(2))
        await asyncio.sleep(0.01)
        gone.cancel()
        assert await c(3) == 3  # the next call goes on, without the cancelled caller's result
        assert await c(4) == 4

    asyncio.run(main())
    assert calls == 4  # the cancelled caller's call was already in flight: it ran


def _runtime(state) -> JobRuntime:
    job = TrainingJobConfig.model_validate(job_dict(world_size=2))
    return JobRuntime(job, state, ArrayPayloads(ArraySource([])), None, refresh_seconds=60.0)


def test_a_cursor_reads_only_what_the_cache_lacks_and_its_next_steps_in_the_background(
        io_threads):
    inner = MemoryJobState("j", 2)
    _publish(inner, *(_step(n, ranks=(0, 1)) for n in range(12)))
    state = CountingState(inner)
    rt = _runtime(state)

    async def main() -> list:
        jio = JobIO(rt, io_threads, asyncio.get_running_loop())
        cursor = RankCursor(1, epochs=1, pos=0, epoch=0)
        actions = []
        for _ in range(12):
            a = await jio.next_action(cursor)
            actions.append(a)
            cursor.sent(a.step)
            await asyncio.sleep(0.02)  # the consumer's pace: read-ahead lands meanwhile
        return actions

    actions = asyncio.run(main())
    assert all(isinstance(a, Send) for a in actions)
    assert [a.step.step for a in actions] == list(range(12))
    assert all([b.rank for b in a.step.batches] == [1] for a in actions)  # its batch only
    # One head read for the whole run (refresh 60 s); steps read 8 at a time, ahead.
    assert state.calls["head"] == 1
    assert state.calls["get_steps_for"] <= 3


class _Trimmed(CountingState):
    """Its head names published steps, but it holds none of them (trimmed)."""

    def get_steps_for(self, wanted):
        return [None] * len(wanted)


@pytest.mark.parametrize("pos, expected", [(0, Missing), (3, Wait)])
def test_an_absent_step_or_end_is_an_answer_not_a_retry_loop(io_threads, pos, expected):
    inner = MemoryJobState("j", 2)
    _publish(inner, *(_step(n, ranks=(0, 1)) for n in range(3)))
    rt = _runtime(_Trimmed(inner))

    async def main() -> object:
        jio = JobIO(rt, io_threads, asyncio.get_running_loop())
        # pos 0: published but not in the state; pos 3: past the plan, no END yet.
        return await asyncio.wait_for(jio.next_action(RankCursor(0, 1, pos=pos, epoch=0)), 5)

    assert isinstance(asyncio.run(main()), expected)


def test_tick_wakes_every_waiting_stream_on_notify_from_another_thread(io_threads):
    rt = _runtime(MemoryJobState("j", 2))

    async def main() -> float:
        jio = JobIO(rt, io_threads, asyncio.get_running_loop())
        t0 = time.monotonic()
        threading.Timer(0.1, rt.notify).start()
        await asyncio.wait_for(asyncio.gather(*(jio.tick() for _ in range(50))), 5)
        return time.monotonic() - t0

    # refresh_seconds is 60: only the notify can have ended the wait.
    assert asyncio.run(main()) < 5
