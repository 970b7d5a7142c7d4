"""A `grpc.aio` server on an event loop of its own, driven from ordinary (threaded) code.

The rank streams are coroutines on this loop (one thread for all of them: on a small machine a
thread per stream and per ack reader spent most of the replica's CPU handing the GIL and gRPC's
completions between threads). Handlers that are plain functions (the unary calls, Refill) run in
`handler_threads`, as on a threaded server; blocking calls of the coroutines run in `io`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

T = TypeVar("T")


class LoopServer:
    def __init__(self, options: Sequence[tuple[str, Any]], *, handler_threads: int,
                 io_threads: int) -> None:
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="odb-io")
        self._handlers = ThreadPoolExecutor(handler_threads, thread_name_prefix="odb")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="odb-grpc-loop",
                                        daemon=True)
        self._thread.start()
        self._stopped = threading.Event()

        async def make() -> grpc.aio.Server:
            return grpc.aio.server(migration_thread_pool=self._handlers, options=list(options))

        self.server = self.call(make())

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

    def stop(self, grace: float | None) -> threading.Event:
        """Stop accepting calls, give the live ones `grace` seconds, then close the loop; the
        returned event is set once everything is down (like `grpc.Server.stop`)."""
        if self._stopped.is_set() or self.loop.is_closed():
            return self._stopped

        async def stop() -> None:
            try:
                await self.server.stop(grace)
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)
            finally:
                self.loop.call_soon(self.loop.stop)

        fut = asyncio.run_coroutine_threadsafe(stop(), self.loop)

        def finished(_f: object) -> None:
            threading.Thread(target=self._close, daemon=True).start()

        fut.add_done_callback(finished)
        return self._stopped

    def _close(self) -> None:
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()
        self._handlers.shutdown(wait=False, cancel_futures=True)
        self.io.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True once stopped (False: `timeout` passed first)."""
        return self._stopped.wait(timeout)
