"""A real `odb-pipeline serve` process for tests: started from a command line and environment,
ready once it prints its listening line, stopped by a signal (its own drain)."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"listening on \S+:(\d+) .*?(?:metrics on :(\d+))?$")


class ServeProcess:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
        self.argv, self.env, self.cwd = argv, env, cwd
        self.lines: list[str] = []
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._ready = threading.Event()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240.0) -> ServeProcess:
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or self.port is None:
            self.stop()
            raise AssertionError("serve did not start listening:\n" + self.output())
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _LISTENING.search(line.rstrip())
            if m:
                self.port = int(m[1])
                self.metrics_port = int(m[2]) if m[2] else None
                self._ready.set()
        self._ready.set()  # exited: start() sees no port

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 180.0) -> None:
        """Until `text` appears in the output (AssertionError, with the output, if the process
        exits or the time runs out first)."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert time.monotonic() < deadline and self.proc is not None \
                and self.proc.poll() is None, f"no {text!r} from serve:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def wait_for_ray(self) -> None:
        """Until the private Ray is up: a test that is not about start-up asks its questions
        once the job's producer has moved to its Ray actor."""
        self.wait_for("Ray is up")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        """Signal it and wait; kill it if it does not stop in time. Returns its exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
