"""One job as one serving replica sees it: the parts its rank streams share, wired together.

- `plan` (`PlanView`): the published plan, read cheaply and only per served rank;
- `payloads` (`PayloadSource`): the payloads of a rank's batch, by reference;
- `build_message`: a rank's batch as the messages it is sent as (`batch_builder`);
- `dead_ranks`: lapsed ranks for the failure policy, one query per ~0.25 s for all streams;
- `host`: where the job's producer runs (`producer.hosting`), started with the runtime;
- `ranks`: what this replica knows of its own connections (for GetJob and status, labelled
  per replica);
- `notify`/`wait`: "the plan may have changed" (a reconfiguration, a stop) for the threads and
  the event-loop waiters (`add_waker`) that poll it.
Acks and delivery grants are written by the streams' event loop (`stream_io.JobIO`).
Everything job-wide (plan, cursors, counters, errors) lives in the `JobState`; a replica holds
caches only, so any replica serves any rank and a replica can die without losing anything.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.config import TrainingJobConfig
from pipeline.jobstate.interface import JobState, ProducerFailure
from pipeline.jobstate.worlds import PlanHead
from pipeline.planner.types import Step
from pipeline.preprocess.sample import ProcessedSample
from pipeline.producer.hosting import ProducerHost
from pipeline.service.batch_builder import build_batch
from pipeline.service.chunk_framing import DEFAULT_CHUNK_BYTES, WireBatch
from pipeline.service.payloads import PayloadSource
from pipeline.service.plan_view import PlanView

log = logging.getLogger(__name__)


@dataclass
class RankConnection:
    """What this replica knows of a rank's stream (None of it is job-wide)."""

    client_id: str = ""
    connected: bool = False
    delivered: int = -1  # last step sent by this replica


@dataclass(frozen=True)
class ReplicaFacts:
    """A snapshot of this replica's side of a job, for observers (status, metrics)."""

    ranks: dict[int, RankConnection]  # ranks that have had a stream on this replica
    fetched_by_rank: dict[int, int]
    uptime_s: float
    members: dict[tuple[int, int], RankConnection] = field(default_factory=dict)  # (rank, seat)


class JobRuntime:
    def __init__(self, job: TrainingJobConfig, state: JobState, payloads: PayloadSource,
                 host: ProducerHost | None, *, pad_id: int = 0,
                 refresh_seconds: float = 0.025, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 batch_notice: str | None = None) -> None:
        self.job = job
        self.state = state
        self.payloads = payloads
        self.host = host
        self.pad_id = pad_id
        self.chunk_bytes = chunk_bytes  # a batch over this travels in chunks of it
        self.batch_notice = batch_notice  # what `serve` said of the job's largest batch
        self.mode = state.mode
        self.collate = job.batching.collate
        # Room for every rank's read-ahead and credit window in the largest world.
        self.plan = PlanView(state, refresh_seconds=refresh_seconds,
                             cache_size=max(4096, 16 * job.world_size_cap()))
        self._wakers: list[Callable[[], None]] = []
        # By rank id (a reconfiguration changes the world size, the ids are reused).
        self.ranks: defaultdict[int, RankConnection] = defaultdict(RankConnection)
        # A model-parallel group's streams, by (rank, member): the members of a grouped rank.
        self.members: defaultdict[tuple[int, int], RankConnection] = defaultdict(
            RankConnection)
        self.started_at = time.monotonic()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._dead_lock = threading.Lock()
        self._dead_cache: tuple[float, float, dict[int, float]] | None = None
        self._error_lock = threading.Lock()
        self._error: tuple[float, ProducerFailure | None] = (-1.0, None)

    # --- lifecycle ---
    def start(self) -> JobRuntime:
        if self.host is not None:
            self.host.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.notify()
        if self.host is not None:
            self.host.stop(timeout)
        self.payloads.close()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def add_waker(self, wake: Callable[[], None]) -> None:
        """Call `wake()` (from any thread) on every `notify`."""
        with self._changed:
            self._wakers.append(wake)

    def wait(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    # --- shared reads ---
    def error(self, refresh: bool = True) -> str | None:
        """The producer's permanent failure (read at most every second; `refresh=False`: the
        last value read, without I/O). A transient one is not an error: streams wait."""
        failure = self.producer_failure(refresh)
        return failure.message if failure is not None and failure.permanent else None

    def producer_failure(self, refresh: bool = True) -> ProducerFailure | None:
        """The producer's recorded failure, permanent or transient (cached as `error`)."""
        now = time.monotonic()
        with self._error_lock:
            at, value = self._error
            if refresh and now - at >= 1.0:
                # An unreachable state: streams learn it from their own reads.
                with contextlib.suppress(Exception):
                    value = self.state.producer_failure()
                self._error = (now, value)
            return value

    def dead_ranks(self, rank_timeout_seconds: float, refresh: bool = True) -> dict[int, float]:
        """rank -> seconds its lease has been lapsed, for ranks lapsed (held before, no live
        holder, not re-claimed) longer than the timeout (Guarantee 4). A freshly started
        replica does not count lapse time from before it was up longer than its own uptime:
        after a restart every rank gets the full timeout to reconnect. Cached ~0.25 s
        (`refresh=False`: the last value read, without I/O)."""
        now = time.monotonic()
        with self._dead_lock:
            c = self._dead_cache
            if c is not None and c[1] == rank_timeout_seconds and (
                    now - c[0] < 0.25 or not refresh):
                return c[2]
            if not refresh:
                return {}
        uptime = now - self.started_at
        out: dict[int, float] = {}
        if uptime > rank_timeout_seconds:
            try:
                timed_out = self.state.timed_out_ranks(rank_timeout_seconds)
            except Exception:  # a status probe never kills a stream
                log.debug("job %s: timed_out_ranks failed", self.job.job_id, exc_info=True)
                timed_out = {}
            out = {r: min(float(t), uptime) for r, t in timed_out.items()}
        with self._dead_lock:
            self._dead_cache = (now, rank_timeout_seconds, out)
        return out

    def resume_position(self, rank: int, head: PlanHead) -> tuple[int, int]:
        """(step, epoch) of the rank's first unacknowledged step of the current world (`head`,
        just read): where a rank that opens without a state of its own continues
        (Guarantee 5)."""
        nxt = max(self.state.acked(rank) + 1, head.first_step)
        if nxt <= head.published_through:
            step = self.plan.step_for(nxt, rank)
            if step is not None:
                return nxt, step.epoch
        ends = self.state.epoch_ends()
        epoch = sum(1 for e in ends if e.last_step < nxt)
        # A rank done with the whole job gets its final END again, never a silent stream.
        return nxt, min(epoch, self.job.epochs - 1)

    def build_message(self, step: Step, rank: int, micro: int = 0,
                      samples: Sequence[ProcessedSample] | None = None) -> WireBatch:
        """Rank's batch (micro-batch `micro`) of `step` as the messages it is sent as, from
        `samples` (the rank's payloads of the step, all micro-batches) or fetched now."""
        if samples is None:
            samples = self.payloads.fetch(step, rank)
        return build_batch(step, rank, samples, collate=self.collate, pad_id=self.pad_id,
                           chunk_bytes=self.chunk_bytes, micro=micro,
                           pad_to_multiple=self.job.batching.pad_to_multiple)

    def facts(self) -> ReplicaFacts:
        return ReplicaFacts(ranks={r: RankConnection(c.client_id, c.connected, c.delivered)
                                   for r, c in list(self.ranks.items())},
                            members={k: RankConnection(c.client_id, c.connected, c.delivered)
                                     for k, c in list(self.members.items())},
                            fetched_by_rank=self.payloads.fetched_by_rank(),
                            uptime_s=time.monotonic() - self.started_at)
