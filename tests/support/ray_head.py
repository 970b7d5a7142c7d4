"""A Ray head of its own for a test topology: a separate process tree that can be frozen or
killed without touching the test process or the session's Ray.

    head = RayHead(tmp_dir).start()     # head.address: the GCS address replicas join
    head.pids("gcs_server")             # its processes, by name (for freezing)
    head.actor_pids("ProducerActor")    # worker processes running an actor of that class
    head.call("odb", "producer:j", "info")   # a method of a named actor, answered as JSON
    head.stop()                         # the whole tree goes (Ray's processes die with it)

Run as a script, this module is that process: it starts a local Ray (`ray.init`, private:
no token auth, no dashboard, sessions under the given temp dir), prints `GCS <address>`, then
answers `CALL <namespace> <actor> <method>` lines on its stdin (it is a driver of its own
cluster: the test process need not be one), until its stdin closes or it gets SIGTERM/SIGINT;
then it shuts Ray down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from support.process_tree import cmdline, descendants

TESTS = Path(__file__).resolve().parents[1]
_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0",
        "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


class RayHead:
    def __init__(self, num_cpus: int = 2, object_store_mb: int = 256) -> None:
        self.num_cpus, self.object_store_mb = num_cpus, object_store_mb
        self.temp_dir = tempfile.mkdtemp(prefix="odb-head-", dir="/tmp")
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.lines: list[str] = []
        self._answers: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._call_lock = threading.Lock()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 120.0) -> RayHead:
        env = {**os.environ, **_ENV,
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "support.ray_head", "--temp-dir", self.temp_dir, "--num-cpus",
             str(self.num_cpus), "--object-store-mb", str(self.object_store_mb)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("GCS "):
                    self.address = line.split()[1]
                    ready.set()
                elif line.startswith(("RESULT ", "ERROR ")):
                    self._answers.put(line)
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or not self.address:
            self.stop()
            raise AssertionError("the Ray head did not start:\n" + "".join(self.lines[-40:]))
        return self

    def call(self, namespace: str, actor: str, method: str, timeout: float = 30.0) -> Any:
        """`method()` of the named actor, through the head's driver (RuntimeError: it failed)."""
        assert self.proc is not None and self.proc.stdin is not None
        with self._call_lock:
            self.proc.stdin.write(f"CALL {namespace} {actor} {method}\n")
            self.proc.stdin.flush()
            try:
                answer = self._answers.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"{actor}.{method}(): no answer in {timeout}s") from None
        kind, _, body = answer.partition(" ")
        if kind == "ERROR":
            raise RuntimeError(f"{actor}.{method}(): {body.strip()}")
        return json.loads(body)

    def pids(self, name: str) -> list[int]:
        """Processes of the head's tree whose command line names `name` (e.g. gcs_server)."""
        return [p for p in descendants(self.pid) if name in cmdline(p)]

    def actor_pids(self, class_name: str) -> list[int]:
        """Worker processes of the head running an actor of `class_name` (Ray titles them
        `ray::<class>` or `ray::<class>.<method>`)."""
        return [p for p in descendants(self.pid)
                if cmdline(p).startswith((f"ray::{class_name} ", f"ray::{class_name}."))
                or cmdline(p).strip() == f"ray::{class_name}"]

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            tree = descendants(self.proc.pid)
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            for pid in tree:  # anything Ray left behind (it was frozen, say)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _serve(args: argparse.Namespace) -> None:
    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _temp_dir=args.temp_dir,
             object_store_memory=args.object_store_mb * 1024 * 1024, log_to_driver=False,
             configure_logging=False)
    print("GCS", ray.get_runtime_context().gcs_address, flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())

    def answer() -> None:
        for line in sys.stdin:
            _, namespace, name, method = line.split()
            try:
                actor = ray.get_actor(name, namespace=namespace)
                result = ray.get(getattr(actor, method).remote(), timeout=20)
                print("RESULT", json.dumps(result), flush=True)
            except Exception as exc:
                print("ERROR", f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        done.set()

    threading.Thread(target=answer, daemon=True).start()
    done.wait()
    ray.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--temp-dir", required=True)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--object-store-mb", type=int, default=256)
    _serve(p.parse_args())
