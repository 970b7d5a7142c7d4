"""A `grpc.aio` server on an event loop of its own, driven from ordinary (threaded) code.

The rank streams are coroutines on this loop (one thread for all of them: on a small machine a
thread per stream and per ack reader spent most of the replica's CPU handing the GIL and gRPC's
completions between threads). Handlers that are plain functions (the unary calls, Refill) run in
`handler_threads`, as on a threaded server; blocking calls of the coroutines run in `io`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

T = TypeVar("T")
log = logging.getLogger(__name__)


class LoopServer:
    def __init__(self, options: Sequence[tuple[str, Any]], *, handler_threads: int,
                 io_threads: int) -> None:
        self._stopped = threading.Event()
        self._started = False
        self._stop_lock = threading.Lock()
        self._stopping: threading.Thread | None = None
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="odb-io")
        self._handlers = ThreadPoolExecutor(handler_threads, thread_name_prefix="odb")
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._unhandled)
        self._thread = threading.Thread(target=self.loop.run_forever, name="odb-grpc-loop",
                                        daemon=True)
        self._thread.start()

        async def make() -> grpc.aio.Server:
            return grpc.aio.server(migration_thread_pool=self._handlers, options=list(options))

        self.server = self.call(make())

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        # Calls cut by the stop fail (or are cancelled) inside gRPC with nobody left to read it.
        exc = context.get("exception")
        if self._stopping is not None and (isinstance(exc, asyncio.CancelledError)
                                           or "ExecuteBatchError" in repr(exc)):
            return
        loop.default_exception_handler(context)

    def responsive(self, timeout: float) -> bool:
        """The loop runs a callback within `timeout` seconds: what the liveness probe asks
        (every rank stream and health watch is a coroutine of this loop, so a loop that is
        blocked or gone serves nobody, while the process still accepts connections)."""
        ran = threading.Event()
        try:
            self.loop.call_soon_threadsafe(ran.set)
        except RuntimeError:  # the loop is closed
            return False
        return ran.wait(timeout)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        """Run `coro` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # Set-up calls of grpc.aio.Server, made on the loop's thread.
    def _on_loop(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)

        return self.call(run())

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._on_loop(self.server.add_generic_rpc_handlers, handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._on_loop(self.server.add_registered_method_handlers, service, handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._on_loop(self.server.add_insecure_port, address)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self._on_loop(self.server.add_secure_port, address, credentials)

    def start(self) -> None:
        self.call(self.server.start())
        self._started = True

    def stop(self, grace: float | None) -> threading.Event:
        """Stop accepting calls, give the live ones `grace` seconds, then close the loop; the
        returned event is set once everything is down (like `grpc.Server.stop`)."""
        with self._stop_lock:
            if self._stopping is None:
                self._stopping = threading.Thread(target=self._shut, args=(grace,),
                                                  name="odb-grpc-stop", daemon=True)
                self._stopping.start()
        return self._stopped

    def _shut(self, grace: float | None) -> None:
        try:
            if not self._started:  # gRPC core releases a bound port only at a started server's
                self.start()  # stop (a start that failed half-way, then stopped, frees it)
            self.call(self.server.stop(grace), timeout=(grace or 0) + 30)
        except Exception:  # a loop already gone: close what is left
            log.debug("grpc server stop failed", exc_info=True)
        # Plain handlers (Refill) read their requests through the loop: cancelling the loop's
        # tasks ends those reads, so the handler threads end too, while the loop still runs.
        # (A handler thread left waiting on a stopped loop would hold the interpreter's exit.)
        self._cancel_tasks()
        self._handlers.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + 10.0
        for t in list(self._handlers._threads):  # (the executor's own list of its threads)
            t.join(max(0.0, deadline - time.monotonic()))
        self._cancel_tasks()  # whatever the handlers started meanwhile
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()
        self.io.shutdown(wait=False, cancel_futures=True)
        for t in list(self.io._threads):  # each ends with its current (bounded) call
            t.join(max(0.0, deadline + 10.0 - time.monotonic()))
        self._stopped.set()

    def _cancel_tasks(self) -> None:
        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.call(cancel_the_rest(), timeout=10)
        except Exception:
            log.debug("cancelling the loop's tasks failed", exc_info=True)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True once stopped (False: `timeout` passed first)."""
        return self._stopped.wait(timeout)
