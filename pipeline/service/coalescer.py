"""Group commit: calls made while a batched call is in flight go together in the next one.

Many rank streams of one replica each want one small thing from a shared backend at about the
same time (an ack recorded, a step read, a payload reference). `Coalescer` turns those into one
batched round trip: the first caller becomes the leader and flushes the queue until it is empty;
the others wait for their own result. Each caller gets its own value or its own exception.
`AsyncCoalescer` is the same for the coroutines of one event loop: the batched call runs in an
executor (it blocks), and what is asked meanwhile waits for the next one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


def _call_grouped(call_many: Callable[[Sequence[K]], Sequence[V | BaseException]],
                  keys: Sequence[K]) -> Sequence[V | BaseException]:
    """One result per key; a failed round trip is every caller's exception."""
    try:
        results = call_many(keys)
        if len(results) != len(keys):
            raise RuntimeError(f"batched call returned {len(results)} results for "
                               f"{len(keys)} keys")
        return results
    except BaseException as exc:
        return [exc] * len(keys)


class Coalescer(Generic[K, V]):
    def __init__(self, call_many: Callable[[Sequence[K]], Sequence[V | BaseException]]) -> None:
        """`call_many(keys)` returns one result per key, in order: a value or an exception."""
        self._call_many = call_many
        self._lock = threading.Lock()
        self._queue: list[tuple[K, list]] = []
        self._flushing = False

    def __call__(self, key: K) -> V:
        slot: list = [None, None, threading.Event()]  # [value, error, done]
        with self._lock:
            self._queue.append((key, slot))
            lead = not self._flushing
            self._flushing = True
        if lead:
            while True:
                with self._lock:
                    batch, self._queue = self._queue, []
                    if not batch:
                        self._flushing = False
                        break
                self._flush(batch)
        slot[2].wait()
        if slot[1] is not None:
            raise slot[1]
        return slot[0]

    def _flush(self, batch: list[tuple[K, list]]) -> None:
        results = _call_grouped(self._call_many, [k for k, _ in batch])
        for (_, slot), res in zip(batch, results, strict=True):
            if isinstance(res, BaseException):
                slot[1] = res
            else:
                slot[0] = res
            slot[2].set()

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._flushing and not self._queue


class AsyncCoalescer(Generic[K, V]):
    def __init__(self, call_many: Callable[[Sequence[K]], Sequence[V | BaseException]],
                 executor: Executor) -> None:
        """`call_many` as for `Coalescer`; it runs in `executor`, one call at a time."""
        self._call_many = call_many
        self._executor = executor
        self._queue: list[tuple[K, asyncio.Future]] = []
        self._flushing = False
        self._task: asyncio.Task | None = None

    async def __call__(self, key: K) -> V:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((key, fut))
        if not self._flushing:
            self._flushing = True
            self._task = loop.create_task(self._flush_all())  # (held: tasks are weakly kept)
        return await fut

    async def _flush_all(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                results = await loop.run_in_executor(self._executor, _call_grouped,
                                                     self._call_many, [k for k, _ in batch])
                for (_, fut), res in zip(batch, results, strict=True):
                    if fut.done():  # its caller was cancelled
                        continue
                    if isinstance(res, BaseException):
                        fut.set_exception(res)
                    else:
                        fut.set_result(res)
        finally:  # (cancelled with the loop: nobody waits on what was still queued)
            self._flushing = False
