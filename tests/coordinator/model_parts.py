"""The pieces the protocol model check (test_protocol_model.py) drives: a real `Producer` in a
thread whose input advances only when the test says so, a Redis that can be killed and restarted
from its AOF, and the plan the planner makes without any interruption (the reference every
published step is compared with)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pipeline.config import TrainingJobConfig
from pipeline.coordinator import RedisJobState
from pipeline.errors import StateUnavailable
from pipeline.jobstate import Publication, QuarantineEntry
from pipeline.order.cursor import OrderCursor
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import EpochEnd, MeasuredSample, Quarantined, Step
from pipeline.producer.feed import FeedItem
from pipeline.producer.producer import Outcome, Producer, ProducerSettings
from pipeline.redis_server import LocalRedis, free_port

QUIET_TIMEOUT = 20.0  # a producer that neither waits for input nor ends by then is stuck

# The renewer never fires within an example (period = lease / 3): lapses are the model's rules.
SETTINGS = ProducerSettings(lease_seconds=600.0, max_ahead=10**6, linger_seconds=0.0,
                            poll_seconds=0.01, retry_cap_seconds=0.5)


# ----------------------------------------------------------------------------- the reference
@dataclass
class ReferencePlan:
    """The job's plan made in one uninterrupted run of the planner."""

    steps: list[Step]
    ends: list[EpochEnd]
    planner_quarantined: set[str]  # samples the planner set aside (over budget, ...)

    def epoch_steps(self, epoch: int) -> range:
        first = sum(e.steps for e in self.ends[:epoch])
        return range(first, first + self.ends[epoch].steps)

    def epoch_of(self, step: int) -> int:
        return self.steps[step].epoch


def reference_plan(items: Sequence[FeedItem], job: TrainingJobConfig) -> ReferencePlan:
    planner = StepPlanner(job.batching.policy(), job.world_size, job.mode, job.seed,
                          job.batching.pool_steps)
    steps: list[Step] = []
    ends: list[EpochEnd] = []
    quarantined: set[str] = set()

    def take(events) -> None:
        for ev in events:
            if isinstance(ev, Step):
                steps.append(ev)
            elif isinstance(ev, EpochEnd):
                ends.append(ev)
            elif isinstance(ev, Quarantined):
                quarantined.add(str(ev.sample.sample_id))

    for epoch in range(job.epochs):
        for item in items:
            if isinstance(item, MeasuredSample):
                take(planner.feed(item))
        # As the producer does: the last epoch closes the job (quota's remainder is one
        # aligned step with fillers, not carried).
        take(planner.end_epoch(last_epoch=epoch == job.epochs - 1))
    assert [s.step for s in steps] == list(range(len(steps)))
    return ReferencePlan(steps, ends, quarantined)


# ----------------------------------------------------------------------------------- Redis
class ModelRedis:
    """A redis-server with its AOF fsynced at every write, killed (-9) and restarted on the same
    port and directory; a restart may be left to a thread (Redis down while a producer works)."""

    def __init__(self, data_dir: str) -> None:
        self.server = LocalRedis(port=free_port(), data_dir=data_dir, appendonly=True,
                                 appendfsync="always").start()
        self._restarter: threading.Thread | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.server.url

    def restart(self) -> None:
        self.server.kill()
        self.server.start()
        self.restarts += 1

    def kill_and_restart_after(self, down: float) -> None:
        self.server.kill()

        def later() -> None:
            time.sleep(down)
            self.server.start()
            self.restarts += 1

        self._restarter = threading.Thread(target=later, daemon=True)
        self._restarter.start()

    def join(self) -> None:
        if self._restarter is not None:
            self._restarter.join(30)
            assert not self._restarter.is_alive(), "Redis did not come back"
            self._restarter = None

    def cleanup(self) -> None:
        self.join()
        self.server.cleanup()


# ---------------------------------------------------------------------- a producer, gated
class GatedFeed:
    """The source rows of every epoch (the same each epoch); a row is handed out only when the
    test opened the gate for it, so the producer thread pauses at a known point: waiting for
    its next row, everything before it (planning, publishing) done."""

    def __init__(self, items: Sequence[FeedItem]) -> None:
        self.items = list(items)
        self._cv = threading.Condition()
        self._permits = 0
        self._waiting = False
        self._closed = False

    def iter_epoch(self, epoch: int, cursor: OrderCursor) -> Iterator[FeedItem]:
        for item in self.items[cursor.position:]:
            with self._cv:
                while self._permits == 0 and not self._closed:
                    self._waiting = True
                    self._cv.notify_all()
                    self._cv.wait()
                self._waiting = False
                if not self._closed:
                    self._permits -= 1
            yield item  # once closed, the producer sees its stop flag at this row

    def open(self, rows: int) -> None:
        with self._cv:
            self._permits += rows
            self._waiting = False
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def wait_quiet(self, thread: threading.Thread) -> None:
        """Until the producer waits for a row it was not given, or its thread ended."""
        deadline = time.monotonic() + QUIET_TIMEOUT
        with self._cv:
            while not (self._waiting and self._permits == 0) and thread.is_alive():
                assert time.monotonic() < deadline, "the producer neither waits nor ends"
                self._cv.wait(0.01)

    def stage(self, steps: Sequence[Step]) -> None:
        pass

    def release(self, keys: Sequence[tuple[int, int]]) -> None:
        pass

    def discard(self, samples: Sequence[MeasuredSample]) -> None:
        pass


@dataclass
class Published:
    generation: int
    publication: Publication


@dataclass
class PublishLog:
    """Every publication that landed, in order, with the generation that published it."""

    landed: list[Published] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)  # generation -> publish calls


class ObservedState:
    """A producer's `RedisJobState`, recording what it publishes and able to fail the next
    publish the way a Redis crash does: Redis is gone before the call ("down"); the script ran
    but its reply was lost with the connection ("reply_lost": the producer sees the error); or
    the client resent the call once Redis was back, as redis-py's retry does ("resent": the
    script runs twice)."""

    def __init__(self, state: RedisJobState, log: PublishLog, redis: ModelRedis) -> None:
        self._state, self._log, self._redis = state, log, redis
        self.fault: tuple[str, float] | None = None

    def __getattr__(self, name: str):
        return getattr(self._state, name)

    def publish(self, publication: Publication, *, fence: int) -> int:
        self._log.attempts[fence] = self._log.attempts.get(fence, 0) + 1
        fault, self.fault = self.fault, None
        if fault is not None and fault[0] == "down":
            self._redis.kill_and_restart_after(fault[1])
        new = self._state.publish(publication, fence=fence)
        self._log.landed.append(Published(fence, publication))
        if fault is not None and fault[0] == "reply_lost":
            self._redis.kill_and_restart_after(fault[1])
            raise StateUnavailable("the connection died before the publish reply (injected)")
        if fault is not None and fault[0] == "resent":
            self._redis.restart()
            again = self._state.publish(publication, fence=fence)
            assert again == 0, "a resent publication added steps"
        return new


class ProducerInstance:
    """One producer process: `Producer.run()` in a thread over its own client and gated feed."""

    def __init__(self, identity: str, job: TrainingJobConfig, items: Sequence[FeedItem], url: str,
                 log: PublishLog, redis: ModelRedis) -> None:
        self.identity = identity
        self.feed = GatedFeed(items)
        self.client_state = RedisJobState.connect(url, job, retries=1, socket_timeout=2.0)
        self.state = ObservedState(self.client_state, log, redis)
        self.producer = Producer(job, self.state, self.feed, holder=identity, settings=SETTINGS)
        self.thread = threading.Thread(target=self.producer.run, daemon=True,
                                       name=f"model-producer-{identity}")

    def start(self) -> None:
        self.thread.start()
        self.feed.wait_quiet(self.thread)

    def advance(self, rows: int) -> None:
        self.feed.open(rows)
        self.feed.wait_quiet(self.thread)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def generation(self) -> int | None:
        return self.producer.generation

    @property
    def outcome(self) -> Outcome | None:
        return self.producer.outcome

    def stop(self) -> None:
        self.producer.stop()
        self.feed.close()
        self.thread.join(QUIET_TIMEOUT)
        assert not self.thread.is_alive(), "a stopped producer did not end"

    def close(self) -> None:
        if self.thread.is_alive():
            self.stop()
        self.client_state.close()


def quarantine_entry(sample_id: str) -> QuarantineEntry:
    return QuarantineEntry(sample_id, "parse", f"row {sample_id}: not JSON (model input)")
