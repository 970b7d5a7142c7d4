"""Child processes a service owns (its embedded Redis, its private Ray node): each runs in a
session of its own and dies with the service.

A session of its own: a signal to the service's process group (Ctrl-C, systemd's default
KillMode, `kill -- -PGID`) reaches the service alone, which then stops its children itself, in
order, after the drain; a child that got the group's signal first would be gone while the drain
still needs it. Dying with the service (PR_SET_PDEATHSIG, Linux): a `kill -9`-ed service leaves
nothing running either. The parent-death signal is per process and survives setsid and exec.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent_hook() -> Callable[[], None] | None:
    """A pre-exec hook: the child gets SIGKILL when the thread that started it dies. Resolved
    here, in the parent: between fork and exec the hook makes one libc call. Only for a child
    started before the process has threads (a pre-exec hook in a threaded process can deadlock
    the child); a child started later calls `die_with_parent` itself."""
    prctl = _prctl()
    if prctl is None:
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return hook


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Called first thing in a child: `sig` when its parent dies (SIGTERM for a child that
    stops children of its own on it); exits at once if the parent (`parent_pid`) is already
    gone, since the signal would then never come."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:
        os._exit(1)


def stat_fields(pid: int | str) -> list[str] | None:
    """`/proc/<pid>/stat` after the command name, None once the process is gone: [0] state,
    [1] parent pid, [3] session id, [19] start time (the name may hold spaces and parentheses,
    so the fields are read after its last ')')."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def session_members(sid: int) -> list[int]:
    """The processes of session `sid` now."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(entry.name)) is not None \
                and int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


def stop_session(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop a child started in a session of its own: SIGTERM to the child (it stops its own
    children), up to `grace_s` for it to exit, then SIGKILL to whatever of its session is left
    (including processes it started that outlived it)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    kill_session(proc)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to the child and every process left in its session; waits for the child."""
    for _ in range(3):  # a member may fork while we kill: look again
        members = session_members(proc.pid)
        if proc.poll() is None and proc.pid not in members:
            members.append(proc.pid)
        if not members:
            break
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
