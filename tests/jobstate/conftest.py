"""Every implementation of `JobState` behind one fixture, so each contract test runs on all.

`make_env(world_size, mode)` gives a fresh job and the clock its leases run on: `MemoryJobState`
gets a clock the test moves by hand (`env.sleep` is instant), `RedisJobState` a fresh job on the
session's real redis-server, whose leases run on the Redis clock (`env.sleep` really sleeps, so
tests keep leases short, e.g. `SHORT` = 0.2 s).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pipeline.coordinator import RedisJobState
from pipeline.jobstate import JobState, MemoryJobState

SHORT = 0.2  # a lease that a test lets lapse (seconds)
LONG = 60.0  # a lease that stays live for the whole test
LAPSE = SHORT + 0.1  # how long to wait for a SHORT lease to lapse

_jobs = itertools.count()


class ManualClock:
    """Time that moves only when the test says so."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class Env:
    kind: str
    state: JobState
    now: Callable[[], float]  # the clock the state's leases are measured on
    sleep: Callable[[float], None]
    holders: itertools.count = field(default_factory=itertools.count)

    def producer(self, lease_seconds: float = LONG) -> int:
        """Claim the producer lease for a new holder; its generation (the fence)."""
        gen = self.state.claim_producer(f"producer-{next(self.holders)}", lease_seconds)
        assert gen is not None
        return gen


@pytest.fixture(params=["memory", "redis"])
def make_env(request) -> Callable[..., Env]:
    made: list[JobState] = []
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("redis_client")  # a flushed db for this test

    def make(world_size: int = 4, mode: str = "join") -> Env:
        job_id = f"contract{next(_jobs)}"
        if request.param == "memory":
            clock = ManualClock()
            env = Env("memory", MemoryJobState(job_id, world_size, mode, clock=clock), clock,
                      clock.sleep)
        else:
            env = Env("redis", RedisJobState(url, job_id, config_hash="contract",
                                             world_size=world_size, mode=mode),
                      time.time, time.sleep)
        made.append(env.state)
        return env

    yield make
    for st in made:
        st.close()


@pytest.fixture
def env(make_env) -> Env:
    """A fresh W=4 join-mode job."""
    return make_env()
