"""How `serve` takes SIGTERM and SIGINT: a first one asks for an orderly stop, bounded in time;
a second one (or the bound running out) is a fast stop.

Installed first thing, before anything is started, so a signal at any moment of the start is
an orderly stop too. The handler only sets `requested`: the main thread checks it between start
steps and in its wait loop, and then stops what it started, in order. From the first signal on,
a watchdog gives that `grace_s`; past it, or at a second signal, every registered fast-stop
action runs (each kills one child outright) and the process exits 1, with nothing left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

DEFAULT_GRACE_S = 10.0


class StopSignals:
    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s
        self.requested = threading.Event()
        self._fast_stops: list[Callable[[], None]] = []
        self._fast_lock = threading.Lock()

    def install(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def on_fast_stop(self, action: Callable[[], None]) -> None:
        """Register how to kill one started child at once (run newest first)."""
        self._fast_stops.append(action)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            self.fast_stop(f"a second {signal.Signals(signum).name}")
            return
        self.requested.set()
        watchdog = threading.Timer(self.grace_s, self.fast_stop,
                                   args=(f"the stop took over {self.grace_s:g} s",))
        watchdog.daemon = True
        watchdog.start()

    def fast_stop(self, why: str) -> None:
        """Kill every registered child and exit 1 (from any thread)."""
        if not self._fast_lock.acquire(blocking=False):
            return  # one fast stop at a time: the other one exits the process
        print(f"odb-pipeline: {why}: stopping at once", file=sys.stderr, flush=True)
        for action in reversed(self._fast_stops):
            with contextlib.suppress(Exception):
                action()
        os._exit(1)
