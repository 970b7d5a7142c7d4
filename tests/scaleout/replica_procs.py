"""Real `odb-pipeline serve` replicas for the scale-out tests: separate processes that join the
test session's Ray cluster and share one Redis, started and killed like pods."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
CHATS = ROOT / "pipeline" / "sample_data" / "chats.jsonl"


def service_config(tmp: Path, redis_url: str, ray_address: str, job: dict,
                   **kw: Any) -> Path:
    cfg = {"redis_url": redis_url, "ray": {"address": ray_address}, "lease_seconds": 3.0,
           "state_dir": str(tmp / "state"),  # where serve records itself for `status`
           "grpc": {"host": "127.0.0.1", "port": 0}, "metrics_port": 0,
           "jobs": [job], **kw}
    path = tmp / f"odb-{job['job_id']}.json"
    path.write_text(json.dumps(cfg))
    return path


class ReplicaProc:
    """One `serve` process; `address` and `metrics` once `wait_ready()` saw it listening."""

    def __init__(self, config: Path, name: str, port: int = 0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled",
               "OMP_NUM_THREADS": "1"}
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "serve", "--config", str(config),
             "--port", str(port)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = self.metrics_port = 0

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on \S+:(\d+).*metrics on :(\d+)", line)
            if m:
                self.port, self.metrics_port = int(m[1]), int(m[2])
                self._ready.set()

    def wait_ready(self, timeout: float = 180.0) -> ReplicaProc:
        if not self._ready.wait(timeout):
            self.kill()
            raise AssertionError(f"replica {self.name} did not start in {timeout}s:\n"
                                 + "".join(self.lines[-60:]))
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def status(self, job: str) -> dict:
        url = f"http://127.0.0.1:{self.metrics_port}/status.json?job={job}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)["jobs"][0]

    def fetched_ranks(self, job: str) -> set[int]:
        """Ranks this replica has fetched payloads for (from its own payload accounting)."""
        return {r["rank"] for r in self.status(job)["ranks"] if r["replica"]["samples_fetched"]}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


__all__ = ["CHATS", "ReplicaProc", "free_port", "service_config"]
