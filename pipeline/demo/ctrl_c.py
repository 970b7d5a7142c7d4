"""How the demo takes Ctrl-C (SIGINT), and SIGTERM alike: at once, but never between starting a
child process and holding its handle, nor in the middle of stopping the children.

Python raises KeyboardInterrupt at whatever line the main thread is on when SIGINT arrives. Cut
between `Popen` and keeping the handle, a child (redis-server, a trainer rank) would outlive the
demo; cut inside the cleanup, the rest of the cleanup would not run. Inside `held()` a SIGINT is
recorded and raised when the section ends. `received` stays True once one arrived, so the
command exits non-zero even if a SIGINT lands where nothing can raise any more.

    with CtrlC() as ctrl_c:
        with ctrl_c.held():
            procs.append(subprocess.Popen(...))
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType

_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; `kill`, systemd, a container's stop


class CtrlC:
    def __init__(self) -> None:
        self.received = False
        self._held = 0
        self._previous: dict[signal.Signals, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if not self._held:
            raise KeyboardInterrupt

    def __enter__(self) -> CtrlC:
        self._previous = {sig: signal.signal(sig, self._handler) for sig in _SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]

    def held(self) -> _Held:
        return _Held(self)


class _Held:
    def __init__(self, owner: CtrlC) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        self.owner._held += 1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.owner._held -= 1
        if not self.owner._held and self.owner.received and exc_type is None:
            raise KeyboardInterrupt
