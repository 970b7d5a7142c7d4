"""Freezing a process (tree) with SIGSTOP / SIGCONT: what a hung host looks like to its peers.

    with frozen(replica.pid) as ice:      # the process and its descendants stop
        ...                               # their sockets stay open; nothing answers
        ice.thaw()                        # (optional: thaw early, inside the block)
    # always thawed here, whatever the block raised

A frozen process keeps every socket open (unlike a killed one, whose sockets the kernel
closes), so its peers learn nothing from them: only their own timeouts can tell. The tree is
read from /proc once, at the freeze; the parent is stopped first so it starts no new child
meanwhile, and everything is continued at the end, children first. Processes that exit in
between are skipped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

from support.process_tree import descendants, process_state


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class Frozen:
    """The processes one `frozen()` stopped; `thaw()` continues them (once)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.frozen_at = time.time()
        self.thawed_at: float | None = None

    def thaw(self) -> None:
        if self.thawed_at is not None:
            return
        for pid in reversed(self.pids):
            _signal(pid, signal.SIGCONT)
        self.thawed_at = time.time()

    @property
    def seconds(self) -> float:
        """How long it has been (or was) frozen."""
        return (self.thawed_at or time.time()) - self.frozen_at


@contextlib.contextmanager
def frozen(pid: int, tree: bool = True) -> Iterator[Frozen]:
    """SIGSTOP `pid` (and, with `tree`, its descendants) for the block; SIGCONT at its end."""
    pids = [pid]
    _signal(pid, signal.SIGSTOP)
    ice = Frozen(pids)
    try:
        if tree:
            for child in descendants(pid):
                _signal(child, signal.SIGSTOP)
                pids.append(child)
        # SIGSTOP is asynchronous: the block starts once every process is really stopped (a
        # bound for a hang: on a loaded machine a process may take seconds to be scheduled).
        deadline = time.monotonic() + 30.0
        while any(process_state(p) not in ("T", "t", "", "Z", "X") for p in pids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} did not stop within 30 s")
            time.sleep(0.005)
        ice.frozen_at = time.time()
        yield ice
    finally:
        ice.thaw()
