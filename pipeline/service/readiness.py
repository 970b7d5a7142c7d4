"""Whether this replica can serve: its gRPC health service, and the watch that reports it
NOT_SERVING while it cannot reach its jobs' state (#40 item 2).

`ReplicaHealth` is the standard `grpc.health.v1` service, the asyncio one on the replica's
event loop: a client that watches the health (every `trainer_client` channel does) holds no
thread of the replica, and the status is set from ordinary threads. A drain is final: once
`enter_graceful_shutdown` ran, what is set later is ignored.

A replica that cannot reach a job's state (a partition from Redis, Redis frozen) can send no
step beyond its recorded grants and ends its rank streams after `state_timeout_seconds`; it must
also stop attracting them. `StateWatch` pings every job's state once per `period_s` (one
round trip each, `JobState.ping`, in threads of its own so a hung call never holds the others)
and reports the server NOT_SERVING ("" and `odb.v1.DataService`) as soon as a ping failed or has
not come back within `timeout_s`, SERVING again once every job's ping answered. What follows:
- Kubernetes' readiness probe asks `/healthz` (`observability/http_server.py`), which answers
  this status: the replica leaves the headless Service's endpoints, so a resolution no longer
  names it;
- a client balancing with health checking (`trainer_client`'s default `round_robin`) stops
  picking it at once, though its connection to it is up.
Owns the status of the health service, nothing else; never touches a stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pipeline.jobstate.interface import JobState
from pipeline.service.loop_server import LoopServer

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ReplicaHealth:
    """The replica's health service on `server` (SERVING once added), for `services` (the
    whole server "" and the service names)."""

    def __init__(self, server: LoopServer, services: tuple[str, ...]) -> None:
        self.server = server
        self.services = services
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def set(self, serving: bool) -> None:
        for name in self.services:
            self._call(self.servicer.set(name, SERVING if serving else NOT_SERVING))

    def serving(self) -> bool:
        """What a health check of the whole server ("") answers: SERVING or not (a stopped
        server serves nothing)."""
        check = self._call(self.servicer.Check(health_pb2.HealthCheckRequest(service=""), None))
        return check is not None and check.status == SERVING

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for good (a drain; again, or after the stop, it does nothing)."""
        self._call(self.servicer.enter_graceful_shutdown())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T | None:
        if self.server.loop.is_closed():
            coro.close()
            return None
        return self.server.call(coro)


class StateWatch:
    def __init__(self, health: ReplicaHealth, states: Mapping[str, JobState], *,
                 timeout_s: float, period_s: float = 0.5) -> None:
        """`states`: job id -> its state."""
        self.health = health
        self.states = dict(states)
        self.timeout_s = timeout_s
        self.period_s = period_s
        self.serving = True  # what it reported last (the server starts SERVING)
        self._pings = ThreadPoolExecutor(max(1, len(self.states)), "odb-state-ping")
        self._in_flight: dict[str, tuple[float, Future]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="odb-state-watch", daemon=True)

    def start(self) -> StateWatch:
        if self.states:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.period_s + 1.0)
        self._pings.shutdown(wait=False, cancel_futures=True)

    def unreachable(self) -> dict[str, str]:
        """Job id -> why its state is unreachable now (one round of pings, bounded by
        `timeout_s`)."""
        now = time.monotonic()
        for job, state in self.states.items():
            if job not in self._in_flight:
                self._in_flight[job] = (now, self._pings.submit(state.ping))
        out: dict[str, str] = {}
        for job, (since, fut) in list(self._in_flight.items()):
            try:
                fut.result(timeout=max(0.0, since + self.timeout_s - time.monotonic()))
            except TimeoutError:
                out[job] = f"no answer from its state within {self.timeout_s:g}s"
                continue  # still in flight: the next round waits on it again
            except Exception as exc:
                out[job] = f"{type(exc).__name__}: {exc}"
            del self._in_flight[job]
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            problems = self.unreachable()
            self._report(problems)
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - started)))

    def _report(self, problems: dict[str, str]) -> None:
        serving = not problems
        if serving == self.serving:
            return
        if serving:
            log.info("every job's state answers again: SERVING")
        else:
            log.warning("this replica cannot reach the state of job(s) %s: NOT_SERVING (%s)",
                        ", ".join(sorted(problems)),
                        "; ".join(f"{j}: {p}" for j, p in sorted(problems.items())))
        self.serving = serving
        self.health.set(serving)
