"""A small cluster of real processes for fault scenarios: one Redis, a Ray head of its own, and
N `odb-pipeline serve` replicas sharing both, with TCP proxies on the links a fault cuts.

    topo = Topology(tmp, jobs, settings, replicas=2, redis_proxied=(1,)).start()
    topo.endpoint(first=0)             # "ipv4:127.0.0.1:A,127.0.0.1:B": replica 0 first
    topo.replicas[1].client_proxy      # between the trainers and replica 1
    topo.replicas[1].redis_proxy       # between replica 1 and Redis (redis_proxied only)
    topo.replicas[0].pid, topo.head, topo.redis
    topo.restart(0)                    # kill -9 replica 0 and start it again, same port
    topo.stop()                        # everything; returns the processes that outlived it

Trainers dial the replicas through their client proxies. Replica 0 starts first, so the jobs'
producer actors are created by it (with its direct Redis URL, never a proxied one): a fault on a
replica's Redis link cuts that replica alone. Every replica serves every job of `jobs` under
one config (`settings`: the ServiceConfig fields besides the jobs, Redis, Ray and ports).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.redis_server import LocalRedis, free_port
from support.process_tree import descendants, process_state
from support.ray_head import RayHead
from support.serve_process import REPO, ServeProcess
from support.tcp_proxy import TcpProxy
from support.waiting import wait_until


@dataclass
class Replica:
    index: int
    port: int
    config: Path
    client_proxy: TcpProxy
    redis_proxy: TcpProxy | None
    serve: ServeProcess | None = None

    @property
    def pid(self) -> int:
        assert self.serve is not None and self.serve.proc is not None
        return self.serve.proc.pid

    @property
    def address(self) -> str:
        """What a trainer dials for this replica (its client proxy)."""
        return self.client_proxy.address

    def output(self) -> str:
        return self.serve.output() if self.serve is not None else ""


class Topology:
    def __init__(self, tmp: Path, jobs: list[dict], settings: dict[str, Any], *,
                 replicas: int = 2, redis_proxied: tuple[int, ...] = ()) -> None:
        self.tmp, self.jobs, self.settings = tmp, jobs, settings
        self.n, self.redis_proxied = replicas, redis_proxied
        self.redis = LocalRedis()
        self.head = RayHead()
        self.replicas: list[Replica] = []
        self._pids: set[int] = set()  # every process this topology started, for stop()

    def start(self) -> Topology:
        try:
            self.redis.start()
            assert self.redis.proc is not None
            self._pids.add(self.redis.proc.pid)
            self.head.start()
            self._pids.update([self.head.pid, *descendants(self.head.pid)])
            for i in range(self.n):
                self.replicas.append(self._replica(i))
            for r in self.replicas:  # one after the other: replica 0 creates the producers
                self._start(r)
        except BaseException:
            self.stop()
            raise
        return self

    def _replica(self, i: int) -> Replica:
        port = free_port()
        redis_proxy = None
        redis_url = self.redis.url
        if i in self.redis_proxied:
            redis_proxy = TcpProxy(("127.0.0.1", self.redis.port)).start()
            redis_url = f"redis://{redis_proxy.address}/0"
        cfg = {**self.settings, "redis_url": redis_url, "ray": {"address": self.head.address},
               "state_dir": str(self.tmp / f"state-{i}"), "metrics_port": 0,
               "grpc": {**self.settings.get("grpc", {}), "host": "127.0.0.1", "port": port},
               "jobs": self.jobs}
        path = self.tmp / f"replica-{i}.json"
        path.write_text(json.dumps(cfg))
        return Replica(i, port, path, TcpProxy(("127.0.0.1", port)).start(), redis_proxy)

    def _start(self, r: Replica) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        r.serve = ServeProcess([sys.executable, "-m", "pipeline.cli", "serve", "--config",
                                str(r.config), "--port", str(r.port)], env)
        try:
            r.serve.start()
        finally:
            if r.serve.proc is not None:
                self._pids.add(r.serve.proc.pid)

    def endpoint(self, first: int = 0) -> str:
        """A gRPC target naming every replica (through its client proxy), `first` first."""
        order = [self.replicas[first]] + [r for r in self.replicas if r.index != first]
        return "ipv4:" + ",".join(r.address for r in order)

    def restart(self, i: int) -> None:
        """kill -9 replica `i`, then start it again on the same port."""
        r = self.replicas[i]
        assert r.serve is not None and r.serve.proc is not None
        r.serve.proc.kill()
        r.serve.proc.wait(10)
        self._start(r)

    def processes(self) -> set[int]:
        """Every process this topology started (the Ray head's tree as it is now included)."""
        if self.head.proc is not None and self.head.proc.poll() is None:
            self._pids.update(descendants(self.head.pid))
        return set(self._pids)

    def stop(self) -> set[int]:
        """Stop everything (thawing anything a test left frozen); the pids still alive after."""
        pids = self.processes()
        for pid in pids:  # a frozen process cannot act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for r in self.replicas:
            if r.serve is not None:
                r.serve.stop(signal.SIGTERM, timeout=20)
            r.client_proxy.close()
            if r.redis_proxy is not None:
                r.redis_proxy.close()
        self.head.stop()
        self.redis.cleanup()

        def alive() -> set[int]:
            return {pid for pid in pids if process_state(pid) not in ("", "Z", "X")}

        wait_until(lambda: not alive(), 10.0)  # (killed processes take a moment to exit)
        return alive()
