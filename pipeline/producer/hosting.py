"""Where a job's producer runs, seen from a serving replica.

Every replica serving a job starts one host for it; the job's producer lease decides which
producer actually publishes, so starting many hosts is safe.
- `ActorHost` (jobs preprocessed by Ray Data): a supervisor thread that, while the job needs a
  producer (`needs_producer`: not fully planned, no permanent failure, no live producer lease),
  makes sure the job's producer actor exists (`actor.ensure_producer`), and has Ray restart one
  that is stuck (frozen, hung, cut off from Redis) so that a successor takes the lease over. The
  actor outlives this replica.
- `ThreadHost` (in-memory sources): a producer thread in this process; replicas that lose the
  race for the lease wait for it (the producer's claim) and take over when the holder goes
  away. It runs a new producer whenever the job needs one again: after it was fenced (it waits
  for the lease), or when a reconfiguration reopens a job it had finished (docs/elastic.md).
- `BootstrapHost` (a Ray job on a replica whose private Ray is still starting): a `ThreadHost`
  over a `LocalFeed` plans the first steps in this process; once Ray is up the job's actor is
  created, and when it answers the thread producer stops (its lease is released at a
  publication boundary: rows it read but did not publish are read again) and an `ActorHost`
  takes over, its actor resuming from the checkpoint. It plans only a job that is
  unplanned with no live producer lease; otherwise it is just the actor host, started late.

A producer that failed for good (a permanent failure, producer/failures.py) is recorded on the
job and no host re-creates it: no restart loop. A replica that starts is the operator's act that
gives the job one more try (`retry_failed_job`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from pipeline.config import TrainingJobConfig
from pipeline.errors import StateError
from pipeline.jobstate.interface import JobState
from pipeline.producer.feed import MeasuredFeed
from pipeline.producer.local_feed import LocalFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings

log = logging.getLogger(__name__)


def needs_producer(state: JobState, *, lease_free: bool = True) -> bool:
    """The job needs a producer: not fully planned, not failed for good, and (`lease_free`)
    no live producer lease (judged on the state's clock, as the lease runs on it). False when
    the state cannot be read (asked again later)."""
    try:
        if state.is_done() or state.error() is not None:
            return False
        if not lease_free:
            return True
        lease = state.producer_lease()
    except StateError:
        log.debug("job %s: producer check failed", state.job_id, exc_info=True)
        return False
    return lease is None or not lease.live


def retry_failed_job(state: JobState) -> None:
    """A replica starts: forget the job's permanent producer failure, so its producer gets one
    more try (the failure's message told the operator to fix the cause, then restart)."""
    try:
        cleared = state.clear_error()
    except StateError:
        log.debug("job %s: could not clear its failure", state.job_id, exc_info=True)
        return
    if cleared is not None:
        log.warning("job %s: its producer had failed for good (%s); this replica's start gives "
                    "it one more try", state.job_id, cleared.message,
                    extra={"job": state.job_id})


class ProducerHost(Protocol):
    def start(self) -> None: ...

    def stop(self, timeout: float = 5.0) -> None:
        """Stop what this replica runs (an actor host leaves the actor running)."""


class ThreadHost:
    def __init__(self, job: TrainingJobConfig, state: JobState, feed: MeasuredFeed, *, holder: str,
                 settings: ProducerSettings, check_seconds: float = 1.0) -> None:
        self.job, self.state, self.feed = job, state, feed
        self.holder, self.settings, self.check_seconds = holder, settings, check_seconds
        self.producer = self._new()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"producer-{job.job_id}",
                                        daemon=True)

    def _new(self) -> Producer:
        return Producer(self.job, self.state, self.feed, holder=self.holder,
                        settings=self.settings)

    def start(self) -> None:
        retry_failed_job(self.state)
        self.supervise()

    def supervise(self) -> None:
        """Start the producer thread (without `start`'s retry of a failed job)."""
        self._thread.start()

    def _run(self) -> None:
        producer = self.producer
        while True:
            outcome = producer.run()
            if outcome in (Outcome.FAILED, Outcome.STOPPED):
                return  # failed for good (recorded on the job), or asked to stop
            if outcome is Outcome.DONE and not self._wait_until_needed():
                return
            with self._lock:  # fenced (wait for the lease again) or the job reopened
                if self._stop.is_set():
                    return
                self.producer = producer = self._new()

    def _wait_until_needed(self) -> bool:
        """After the job was planned: until a reconfiguration reopens it (True) or stop."""
        while not self._stop.wait(self.check_seconds):
            if needs_producer(self.state, lease_free=False):
                return True
        return False

    @property
    def done(self) -> bool:
        """Every epoch planned and published."""
        return self.producer.outcome is Outcome.DONE

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stop.set()
            producer = self.producer
        producer.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.feed.close()


class ActorHost:
    def __init__(self, job: TrainingJobConfig, state: JobState, redis_url: str, *,
                 settings: ProducerSettings, fsync_publish: bool = False,
                 check_seconds: float = 2.0) -> None:
        self.job, self.state, self.redis_url = job, state, redis_url
        self.settings, self.fsync_publish = settings, fsync_publish
        self.check_seconds = check_seconds
        self._free_since: float | None = None  # the job needed a producer and had none since
        self._judged = -1  # the actor's process judged since then (its restart count)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise,
                                        name=f"producer-host-{job.job_id}", daemon=True)

    def start(self) -> None:
        retry_failed_job(self.state)
        self.supervise()

    def supervise(self) -> None:
        """Start supervising (without `start`'s retry of a failed job)."""
        self.ensure()  # at once: the first replica must not wait a period to start planning
        self._thread.start()

    def ensure(self) -> bool:
        """Create the producer actor when the job needs one (`needs_producer`); True if a
        creation (or a restart) was requested. An actor that exists while the lease stays free
        for `lease_seconds` is stuck if it does not answer (frozen, hung) or answers without
        taking the lease (cut off from Redis): Ray restarts it, so a successor takes over
        (the old process, fenced by the new generation, can never publish).
        Every replica supervises the job, so each judges one process of the actor: a restart
        (by any replica) gives the new process a lease period of its own, and a process is
        restarted only if the lease is still free after the verdict and the state grants its
        restart (`claim_producer_restart`: one replica restarts each stuck process, and never
        a successor that is starting or has just taken the lease)."""
        if not needs_producer(self.state):
            self._free_since = None
            return False
        from pipeline.producer.actor import (
            actor_process,
            ensure_producer,
            find_producer,
            restart_producer,
            stuck_producer,
        )

        handle = find_producer(self.job.job_id)
        if handle is None:
            ensure_producer(self.job, self.redis_url, self.settings, self.fsync_publish)
            return True
        now = time.monotonic()
        judged = actor_process(handle)
        if self._free_since is None or judged.process != self._judged:
            self._free_since, self._judged = now, judged.process
        if now - self._free_since < self.settings.lease_seconds:
            return False  # a working actor takes the lease within a second
        why = stuck_producer(handle, ping_seconds=self.check_seconds)
        if (why is None or not needs_producer(self.state)
                or not self.state.claim_producer_restart(judged.actor_id, judged.process)):
            return False
        log.warning("job %s: its producer actor is stuck: %s; Ray restarts it",
                    self.job.job_id, why, extra={"job": self.job.job_id})
        restart_producer(handle)
        return True

    def _supervise(self) -> None:
        while not self._stop.wait(self.check_seconds):
            try:
                self.ensure()
            except Exception:  # Ray briefly unreachable: try again next period
                log.warning("job %s: could not ensure its producer", self.job.job_id,
                            exc_info=True)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def _wait_until_ready(actor, stop: threading.Event, timeout: float = 120.0) -> None:
    """Until the actor answers a call (constructed: its producer waits for the lease)."""
    import ray

    deadline = time.monotonic() + timeout
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=2.0)
            return
        except Exception:  # still starting (or restarting): ask again
            log.debug("producer actor not ready yet", exc_info=True)


class BootstrapHost:
    def __init__(self, job: TrainingJobConfig, state: JobState, redis_url: str, *, holder: str,
                 settings: ProducerSettings, ray_ready: threading.Event,
                 fsync_publish: bool = False) -> None:
        self.job, self.state, self.holder, self.settings = job, state, holder, settings
        self.ray_ready = ray_ready
        self.feed = LocalFeed(job)
        self.actor_host = ActorHost(job, state, redis_url, settings=settings,
                                    fsync_publish=fsync_publish)
        self._local: ThreadHost | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hand_over,
                                        name=f"producer-bootstrap-{job.job_id}", daemon=True)

    def start(self) -> None:
        retry_failed_job(self.state)
        if needs_producer(self.state):
            self._local = ThreadHost(self.job, self.state, self.feed, holder=self.holder,
                                     settings=self.settings)
            self._local.supervise()
            log.info("job %s: planning in this process while Ray starts", self.job.job_id,
                     extra={"job": self.job.job_id})
        self._thread.start()

    def _hand_over(self) -> None:
        while not self.ray_ready.wait(0.2):
            if self._stop.is_set():
                return
        if self._local is not None and not self._local.done:
            # The actor starts (its imports and Ray Data take seconds) while this process
            # still plans; once it answers, its producer waits for the lease we release.
            from pipeline.producer.actor import ensure_producer

            actor = ensure_producer(self.job, self.actor_host.redis_url, self.settings,
                                    self.actor_host.fsync_publish)
            _wait_until_ready(actor, self._stop)
            self._local.stop()  # releases the lease: the actor resumes from the checkpoint
            log.info("job %s: Ray is up; the producer actor takes over", self.job.job_id,
                     extra={"job": self.job.job_id})
        if not self._stop.is_set():
            self.actor_host.supervise()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._local is not None:
            self._local.stop(timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.actor_host.stop(timeout)
        self.feed.drop()
