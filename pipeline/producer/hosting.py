"""Where a job's producer runs, seen from a serving replica.

Every replica serving a job starts one host for it; the job's producer lease decides which
producer actually publishes, so starting many hosts is safe.
- `ActorHost` (jobs preprocessed by Ray Data): a supervisor thread that, while the job is not
  fully planned and no producer lease is live, makes sure the job's producer actor exists
  (`actor.ensure_producer`). The actor outlives this replica.
- `ThreadHost` (in-memory sources): a producer thread in this process; replicas that lose the
  race for the lease wait in `Producer._claim` and take over when the holder goes away.
- `BootstrapHost` (a Ray job on a replica whose private Ray is still starting): a `ThreadHost`
  over a `LocalFeed` plans the first steps in this process; once Ray is up the job's actor is
  created, and when it answers the thread producer stops (its lease is released at a
  publication boundary: rows it read but did not publish are read again) and an `ActorHost`
  takes over, its actor resuming from the checkpoint. It plans only a job that is
  unplanned with no live producer lease; otherwise it is just the actor host, started late.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from pipeline.config import JobConfig
from pipeline.errors import StateError
from pipeline.jobstate.interface import JobState
from pipeline.producer.feed import MeasuredFeed
from pipeline.producer.local_feed import LocalFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings

log = logging.getLogger(__name__)


class ProducerHost(Protocol):
    def start(self) -> None: ...

    def stop(self, timeout: float = 5.0) -> None:
        """Stop what this replica runs (an actor host leaves the actor running)."""


class ThreadHost:
    def __init__(self, job: JobConfig, state: JobState, feed: MeasuredFeed, *, holder: str,
                 settings: ProducerSettings) -> None:
        self.producer = Producer(job, state, feed, holder=holder, settings=settings)
        self._thread = threading.Thread(target=self.producer.run,
                                        name=f"producer-{job.job_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def done(self) -> bool:
        """Every epoch planned and published."""
        return self.producer.outcome is Outcome.DONE

    def stop(self, timeout: float = 5.0) -> None:
        self.producer.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.producer.feed.close()


class ActorHost:
    def __init__(self, job: JobConfig, state: JobState, redis_url: str, *,
                 settings: ProducerSettings, fsync_publish: bool = False,
                 check_seconds: float = 2.0) -> None:
        self.job, self.state, self.redis_url = job, state, redis_url
        self.settings, self.fsync_publish = settings, fsync_publish
        self.check_seconds = check_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise,
                                        name=f"producer-host-{job.job_id}", daemon=True)

    def start(self) -> None:
        self.ensure()  # at once: the first replica must not wait a period to start planning
        self._thread.start()

    def ensure(self) -> bool:
        """Create the producer actor when the job needs one and none holds the lease; True if
        a creation was requested."""
        from pipeline.producer.actor import ensure_producer

        try:
            if self.state.is_done():
                return False
            lease = self.state.producer_lease()
            if lease is not None and lease.expires_at > time.time():
                return False
        except StateError:
            log.debug("job %s: producer check failed", self.job.job_id, exc_info=True)
            return False
        ensure_producer(self.job, self.redis_url, self.settings, self.fsync_publish)
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
    def __init__(self, job: JobConfig, state: JobState, redis_url: str, *, holder: str,
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
        if self._needs_producer():
            self._local = ThreadHost(self.job, self.state, self.feed, holder=self.holder,
                                     settings=self.settings)
            self._local.start()
            log.info("job %s: planning in this process while Ray starts", self.job.job_id,
                     extra={"job": self.job.job_id})
        self._thread.start()

    def _needs_producer(self) -> bool:
        try:
            if self.state.is_done():
                return False
            lease = self.state.producer_lease()
        except StateError:
            return False
        return lease is None or lease.expires_at <= time.time()

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
            self.actor_host.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._local is not None:
            self._local.stop(timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.actor_host.stop(timeout)
        self.feed.drop()
