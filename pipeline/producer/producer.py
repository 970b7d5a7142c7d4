"""The producer of one job: feed -> planner -> fenced, atomic publications of the plan.

Exactly one producer per job publishes, however many processes run this code: it must hold the
job's producer lease (`JobState.claim_producer`), every publication carries the lease generation
(the fencing token) and the state refuses an old one, so a producer that lost its lease can
never publish. Each publication holds new steps, END records, the planner checkpoint that
produced them and what the input yielded since the previous one (samples, quarantined records),
all applied atomically: a producer that dies and restarts continues from the checkpoint and never
publishes a step twice or differently.

Host-agnostic: a Ray actor (producer/actor.py) runs it for jobs preprocessed by Ray Data; a
replica runs it in a thread for in-memory sources. Before publishing, steps' payloads are staged
(`MeasuredFeed.stage`) so replicas can fetch a rank's batch by reference; once every rank of a
batch acknowledged its step the payloads are released. Back-pressure: planning pauses while any
rank has more than `max_ahead` published steps it has not acknowledged.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import Enum

from pipeline.config import TrainingJobConfig
from pipeline.errors import (
    Fenced,
    StateError,
    StateUnavailable,
    WorldChanged,
)
from pipeline.jobstate.interface import (
    JobState,
    PlannerCheckpoint,
    Publication,
    QuarantineEntry,
)
from pipeline.order.cursor import OrderCursor
from pipeline.planner.compute_fit import ComputeModel
from pipeline.planner.step_planner import PlannerState, StepPlanner
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, PlanEvent, Quarantined, Step
from pipeline.producer.adoption import adopt, returned_batches
from pipeline.producer.compute_balancing import ComputeBalancer
from pipeline.producer.failures import (
    Backoff,
    Cause,
    LeaseUnconfirmed,
    StateRolledBack,
    classify,
    describe,
)
from pipeline.producer.feed import MeasuredFeed
from pipeline.producer.mixing import Mixing

log = logging.getLogger(__name__)
# Compute balancing: the models of this many recent publications are remembered for a replay
# (a Redis without fsync_publish loses ~1 s of them in a crash).
REPLAY_MODELS = 4096


class Outcome(str, Enum):  # noqa: UP042 (str mixin: printable in logs and status)
    DONE = "done"  # every epoch planned and published
    STOPPED = "stopped"  # asked to stop
    FENCED = "fenced"  # another producer took over the job
    FAILED = "failed"  # an error the ranks are told about (`JobState.error`)


@dataclass(frozen=True)
class ProducerSettings:
    lease_seconds: float = 10.0
    max_ahead: int = 10  # published, unacknowledged steps per rank before planning pauses
    # Transient failures (failures.py) are retried after retry_first_seconds, doubling up to
    # retry_cap_seconds; a streak longer than give_up_seconds fails the job.
    retry_first_seconds: float = 0.5
    retry_cap_seconds: float = 30.0
    give_up_seconds: float = 600.0
    linger_seconds: float = 120.0  # after planning, keep payloads this long without ack progress
    poll_seconds: float = 0.05  # back-pressure poll of the ranks' cursors
    compute_poll_seconds: float = 1.0  # compute balancing: how often the ranks' reports are read

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.retry_first_seconds, self.retry_cap_seconds, self.give_up_seconds)


class Producer:
    """Plans one job while it holds the job's producer lease. `run()` blocks until the job is
    planned (and its staged payloads released or given up), `stop()` is called, or another
    producer fences it out."""

    def __init__(self, job: TrainingJobConfig, state: JobState, feed: MeasuredFeed, *, holder: str,
                 settings: ProducerSettings | None = None) -> None:
        self.job = job
        self.state = state
        self.feed = feed
        self.holder = holder
        self.settings = settings or ProducerSettings()
        self.generation: int | None = None
        self.outcome: Outcome | None = None
        self._stop = threading.Event()
        self._fenced = threading.Event()
        self._world = job.world_size
        self._world_gen = 0  # the world generation this producer plans for (docs/elastic.md)
        self._world_first = 0
        # Per rank: published steps holding a batch of it that it has not acknowledged.
        self._unacked: list[deque[int]] = [deque() for _ in range(self._world)]
        # Staged batches of an ended world's ranks, released once the new world runs.
        self._retired: list[tuple[int, int]] = []
        self._adoption: list[PlanEvent] | None = None
        self._last_published = -1
        self._failing_since: float | None = None  # a streak of transient failures: its start
        self._attempts = 0
        self._job_failed = False  # the job has a permanent failure: nothing to do
        self._lease_until = 0.0  # monotonic: the lease is surely ours until then
        cb = job.batching.compute_balancing
        self._compute = ComputeBalancer(
            state, cb, job.batching.collate,
            poll_seconds=self.settings.compute_poll_seconds) if cb.enabled else None
        # A mixture's changes at step boundaries and its per-source status (None: one source;
        # built when production starts: it reads the sources' indexes, which may fail).
        self._mixing: Mixing | None = None
        self._planner_targets: tuple | None = None  # (epoch, changes) the planner's are for
        self._voided: list[Batch] = []  # batches the adopted reconfigurations returned
        # The model each recent publication's checkpoint holds, by its position: a replay of
        # publications the state lost (a Redis rollback) plans with the same models.
        self._models: OrderedDict[tuple[int, int, int, int], ComputeModel | None] = OrderedDict()

    # --- lifecycle ---
    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> Outcome:
        self.generation = self._claim()
        if self.generation is None:  # stopped, or the job failed for good meanwhile
            self.outcome = Outcome.FAILED if self._job_failed else Outcome.STOPPED
            return self.outcome
        log.info("job %s: producer %s holds the lease (generation %d)", self.job.job_id,
                 self.holder, self.generation, extra={"job": self.job.job_id})
        renewer = threading.Thread(target=self._renew, name=f"lease-{self.job.job_id}",
                                   daemon=True)
        renewer.start()
        try:
            while True:
                self.outcome = self._produce_with_retries()
                if self.outcome is not Outcome.DONE or not self._linger():
                    break
                log.info("job %s: a reconfiguration reopened the planned job; adopting it",
                         self.job.job_id, extra={"job": self.job.job_id})
        finally:
            self._stop.set()
            renewer.join(5.0)
            if not self._fenced.is_set():
                try:
                    self.state.release_producer(self.generation)
                except StateError:
                    log.debug("job %s: lease release failed", self.job.job_id, exc_info=True)
        if self._fenced.is_set() and self.outcome is not Outcome.DONE:
            self.outcome = Outcome.FENCED
        log.info("job %s: producer generation %d ends: %s", self.job.job_id, self.generation,
                 self.outcome.value, extra={"job": self.job.job_id})
        return self.outcome

    def _claim(self) -> int | None:
        """Wait for the lease (another live producer holds it until it stops or lapses); None
        once stopped, or when the job has failed for good (no producer may retry it)."""
        waited = False
        while not self._stop.is_set():
            try:
                if self.state.error() is not None:
                    self._job_failed = True
                    return None
                sent = time.monotonic()
                gen = self.state.claim_producer(self.holder, self.settings.lease_seconds)
            except StateUnavailable:
                gen = None
            if gen is not None:
                self._lease_until = sent + self.settings.lease_seconds
                return gen
            if not waited:
                log.info("job %s: another producer holds the lease; %s waits", self.job.job_id,
                         self.holder, extra={"job": self.job.job_id})
                waited = True
            self._stop.wait(min(1.0, self.settings.lease_seconds / 3))
        return None

    def _renew(self) -> None:
        period = self.settings.lease_seconds / 3
        while not self._stop.wait(period):
            try:
                self._renew_once()
            except Fenced:
                log.warning("job %s: producer generation %d was fenced out", self.job.job_id,
                            self.generation, extra={"job": self.job.job_id})
                self._fenced.set()
                self._stop.set()
                return
            except StateError:
                log.debug("job %s: lease renewal failed", self.job.job_id, exc_info=True)

    def _renew_once(self) -> None:
        """Renew the lease; on success it is ours until `lease_seconds` after the call was sent
        (Redis counts from when it ran, later): a conservative local deadline."""
        sent = time.monotonic()
        self.state.renew_producer(self.generation, self.settings.lease_seconds)
        self._lease_until = max(self._lease_until, sent + self.settings.lease_seconds)

    def _check_lease(self) -> None:
        """Before a publication: past the local lease deadline (renewals failed, e.g. Redis
        partitioned away) renew first; if that fails, do not publish (the lease may have
        expired and a successor may hold it). The state fences a publication that arrives late
        anyway; this keeps a producer that cannot confirm its lease from sending one."""
        if time.monotonic() < self._lease_until:
            return
        try:
            self._renew_once()
        except StateUnavailable as exc:
            raise LeaseUnconfirmed(f"job {self.job.job_id!r}: producer generation "
                                   f"{self.generation} could not renew its lease: {exc}") from exc

    # --- production ---
    def _produce_with_retries(self) -> Outcome:
        """Run the plan. A failure is classified (failures.py): a transient one is recorded as
        the job's trouble and retried from the state's checkpoint with bounded exponential
        backoff (republishing identical steps is a no-op; a publication ends the streak and
        clears the record); a permanent one, or a streak longer than the retry bound, is
        recorded as the job's error once and ends this producer (FAILED)."""
        backoff = self.settings.backoff
        while not self._stop.is_set():
            try:
                return self._produce_once()
            except Fenced:
                self._fenced.set()
                return Outcome.FENCED
            except WorldChanged:  # a reconfiguration: re-plan from the checkpoint at once
                log.info("job %s: the world changed; adopting it", self.job.job_id,
                         extra={"job": self.job.job_id})
                continue
            except Exception as exc:  # a producer failure must reach the ranks, not vanish
                cause = classify(exc)
                now = time.monotonic()
                if self._failing_since is None:
                    self._failing_since, self._attempts = now, 0
                self._attempts += 1
                if not cause.transient or now - self._failing_since > backoff.give_up_seconds:
                    log.error("job %s: producer failed (%s)", self.job.job_id, cause.value,
                              exc_info=True, extra={"job": self.job.job_id})
                    self._fail(cause, self._permanent_message(cause, exc, now))
                    return Outcome.FAILED
                delay = backoff.delay(self._attempts)
                log.warning("job %s: producer failure %d in a row (%s: %s); retrying from the "
                            "checkpoint in %.1fs", self.job.job_id, self._attempts, cause.value,
                            describe(exc), delay, extra={"job": self.job.job_id},
                            exc_info=self._attempts == 1)
                self._fail(cause, f"{cause.value}: {describe(exc)} (failure {self._attempts} in "
                                  f"a row; the producer retries)", transient=True)
                self._stop.wait(delay)
        return Outcome.FENCED if self._fenced.is_set() else Outcome.STOPPED

    def _permanent_message(self, cause: Cause, exc: BaseException, now: float) -> str:
        streak = (f" (failing for {now - self._failing_since:.0f}s, {self._attempts} attempts)"
                  if cause.transient else "")
        return (f"job {self.job.job_id!r}: the producer failed for good ({cause.value}){streak}: "
                f"{describe(exc)}. {cause.advice}.")

    def _fail(self, cause: Cause, message: str, *, transient: bool = False) -> None:
        """Record the failure on the job (best effort: the state may be what failed)."""
        try:
            self.state.set_error(message, fence=self.generation, cause=cause.value,
                                 transient=transient)
        except StateError:
            log.log(logging.DEBUG if transient else logging.ERROR,
                    "job %s: could not record the producer failure: %s", self.job.job_id,
                    message, extra={"job": self.job.job_id})

    def _restore(self) -> tuple[StepPlanner, PlannerCheckpoint | None]:
        policy = self.job.batching.policy()
        pool = self.job.batching.pool_steps
        self.state.reveal(fence=self.generation)  # a predecessor's held publication, if any
        cp = self.state.load_checkpoint()
        self._last_published = self.state.published_through()
        self._enter_world()
        worlds = self.state.worlds()
        planned_for = cp.world if cp is not None else 0
        size = worlds[planned_for].world_size
        if cp is None or not cp.state:
            planner = StepPlanner(policy, size, self.job.mode, self.job.seed, pool,
                                  generation=planned_for)
        else:
            snap = PlannerState.from_dict(json.loads(cp.state))
            planner = StepPlanner.restore(snap, policy, size, self.job.mode, self.job.seed, pool,
                                          generation=planned_for)
            log.info("job %s: planner restored at epoch %d row %d, next step %d",
                     self.job.job_id, cp.epoch, cp.samples_consumed, cp.next_step,
                     extra={"job": self.job.job_id})
        if self._compute is not None:
            self._compute.adopt(planner)
        self._adoption = None
        if planned_for != self._world_gen:
            self._adoption = adopt(planner, planned_for, worlds[:self._world_gen + 1],
                                   self.state, pool, self.job.epochs)
            if self._mixing is not None:  # published before, planned again: counted once
                self._voided = [b for w in worlds[planned_for:self._world_gen]
                                for b in returned_batches(self.state, w)]
            log.info("job %s: plan moved onto world %d (%d ranks from step %d)",
                     self.job.job_id, self._world_gen, self._world, self._world_first,
                     extra={"job": self.job.job_id})
        return planner, cp

    def _enter_world(self) -> None:
        """Follow the state's current world; after a reconfiguration the old world's staged
        batches are kept for its draining ranks until the new world runs."""
        head = self.state.head()
        if head.generation != self._world_gen:
            self._retired += [(n, r) for r, steps in enumerate(self._unacked) for n in steps]
        self._world_gen, self._world, self._world_first = (head.generation, head.world_size,
                                                           head.first_step)
        self._index_published()

    def _index_published(self) -> None:
        """Which published steps each rank still has to acknowledge (back-pressure after a
        restart counts the previous producer's steps too)."""
        self._unacked = [deque() for _ in range(self._world)]
        acked = self.state.acked_all()
        for n in range(max(0, min(acked) + 1), self._last_published + 1):
            step = self.state.get_step(n)
            for r in step.ranks() if step else ():
                if n > acked[r]:
                    self._unacked[r].append(n)

    def _produce_once(self) -> Outcome:
        if self._mixing is None and self.job.source.mixture is not None:
            self._mixing = Mixing.for_job(self.job, self.state, self.feed)
        planner, cp = self._restore()
        self._planner_targets = None  # a planner restored: tell it the targets again
        if self.state.is_done():
            return Outcome.DONE
        first_epoch = cp.epoch if cp is not None else 0
        cursor = (OrderCursor.restore(cp.samples_consumed, cp.order) if cp is not None
                  else OrderCursor())
        epochs = self.job.epochs
        pending = _Pending()
        if self._adoption is not None:  # publish for the new world at once: it adopts it
            if self._mixing is not None:
                cursor = self._mixing.tally(cursor, self._voided, sign=-1)
            self._take(pending, self._adoption)
            cursor = self._publish_counted(pending, planner, first_epoch, cursor)
        for epoch in range(first_epoch, epochs):
            # The epoch's order from the cursor (its position: rows of the order fed), read
            # again from the cursor after a mixture change.
            while True:
                cursor = self._mix(epoch, cursor, planner)
                items = self.feed.iter_epoch(epoch, cursor)
                changed = False
                for item in items:
                    if self._stop.is_set():
                        return Outcome.STOPPED
                    cursor = cursor.at(cursor.position + 1)
                    if isinstance(item, QuarantineEntry):
                        pending.quarantined.append(item)
                        continue
                    pending.samples_in += 1
                    events = planner.feed(item)
                    if events and self._take(pending, events):
                        cursor = self._publish_counted(pending, planner, epoch, cursor)
                        self._wait_for_room()
                        mixed = self._mix(epoch, cursor, planner)
                        if mixed is not cursor:
                            cursor, changed = mixed, True
                            break
                items.close()  # (after a change: what it read ahead is let go)
                if not changed:
                    break
            last = epoch == epochs - 1
            # The last epoch closes the job: quota mode's remainder forms one aligned step.
            self._take(pending, planner.end_epoch(last_epoch=last))
            cursor = self._publish_counted(pending, planner, epoch + 1, cursor, done=last,
                                           ended=epoch)
        if planner.epoch < epochs:  # a reopened last epoch (its input all read): close it
            self._take(pending, planner.end_epoch(last_epoch=True))
        if not self.state.is_done():  # (an empty job, zero epochs to run, finishes too)
            self._publish(pending, planner, epochs, cursor.at(0), done=True)
        return Outcome.DONE

    def _mix(self, epoch: int, cursor: OrderCursor, planner: StepPlanner) -> OrderCursor:
        """The cursor with the mixture changes due now (the same cursor when none); the
        planner keeps each source's share of the mixture in force from its next step on."""
        if self._mixing is None:
            return cursor
        mixed = self._mixing.apply(epoch, cursor, planner.next_step)
        if mixed is not cursor or self._planner_targets != (epoch, mixed.changes):
            planner.set_source_targets(self._mixing.epoch_counts(epoch, mixed),
                                       self.job.source.mix_by)
            self._planner_targets = (epoch, mixed.changes)
        return mixed

    def _publish_counted(self, pending: _Pending, planner: StepPlanner, epoch: int,
                         cursor: OrderCursor, *, done: bool = False,
                         ended: int | None = None) -> OrderCursor:
        """Publish, a mixture's per-source counts in the checkpoint and its status after it;
        `ended`: the epoch this publication closes (the checkpoint is the next one's start).
        Returns the cursor the checkpoint holds."""
        if self._mixing is not None:
            cursor = self._mixing.tally(cursor, [b for s in pending.steps for b in s.batches],
                                        pending.quarantined)
        closing = cursor
        if ended is not None:
            cursor = cursor.next_epoch()
        self._publish(pending, planner, epoch, cursor, done=done)
        if self._mixing is not None:
            self._mixing.report(epoch if ended is None else ended, closing)
        return cursor

    def _take(self, pending: _Pending, events: list[PlanEvent]) -> bool:
        """Collect the planner's events; True when a step is among them (time to publish)."""
        stepped, dropped = pending.take(events)
        if dropped:
            self.feed.discard(dropped)
        return stepped

    def _publish(self, pending: _Pending, planner: StepPlanner, epoch: int,
                 cursor: OrderCursor, *, done: bool = False) -> None:
        steps = tuple(pending.steps)
        at = (self._world_gen, epoch, cursor.position, planner.next_step)
        self._hand_model(planner, at)
        cp = PlannerCheckpoint(epoch=epoch, samples_consumed=cursor.position,
                               next_step=planner.next_step,
                               state=json.dumps(planner.snapshot().to_dict()).encode(),
                               world=self._world_gen, order=cursor.extras())
        pub = Publication(checkpoint=cp, steps=steps, ends=tuple(pending.ends),
                          samples_in=pending.samples_in, quarantined=tuple(pending.quarantined),
                          done=done)
        if steps:
            self.feed.stage(steps)
        self._check_lease()
        try:
            self.state.publish(pub, fence=self.generation)
        except Fenced:
            # An expired lease nobody took over yet is still ours: renew and retry once.
            self._renew_once()
            self.state.publish(pub, fence=self.generation)
        pending.clear()
        self._failing_since = None  # published: a streak of transient failures is over
        for step in steps:
            self._last_published = max(self._last_published, step.step)
            for r in step.ranks():
                self._unacked[r].append(step.step)
        if self._compute is not None:
            self._models[at] = planner.compute_model
            self._models.move_to_end(at)
            while len(self._models) > REPLAY_MODELS:
                self._models.popitem(last=False)

    def _hand_model(self, planner: StepPlanner, at: tuple[int, int, int, int]) -> None:
        """Compute balancing, before a checkpoint is taken at `at`: the model in force becomes
        the planner's, so the checkpoint holds the model that plans the steps after it. A
        position this producer published before (the state lost it: a replay) gets the model
        it had then, so the replayed steps are the ones the ranks may have received."""
        if self._compute is None:
            return
        self._update_compute()
        planner.set_compute_model(self._models.get(at, self._compute.model))

    def _update_compute(self) -> None:
        """Compute balancing: read the ranks' reports and fit (throttled to
        `compute_poll_seconds`). What a report holds never fails the job: the fit rejects or
        absorbs it; should the balancing fail anyway, the model in force stays and the next
        call tries again. Only the state's own errors go on (the producer's retries)."""
        if self._compute is None:
            return
        try:
            self._compute.update(self._world_gen, self._world_first, self._world)
        except StateError:
            raise
        except Exception:
            log.exception("job %s: compute balancing failed; the model in force stays",
                          self.job.job_id, extra={"job": self.job.job_id})

    def _release_acked(self, acked: list[int]) -> None:
        if len(acked) != len(self._unacked):  # the cursors of another world: re-plan first
            raise WorldChanged(f"job {self.job.job_id}: {len(acked)} ranks now, this producer "
                               f"plans for {len(self._unacked)}")
        done: list[tuple[int, int]] = []
        if self._retired and min(acked, default=-1) >= self._world_first:
            done, self._retired = self._retired, []  # every new rank runs: the drain is over
        for rank, steps in enumerate(self._unacked):
            while steps and steps[0] <= acked[rank]:
                done.append((steps.popleft(), rank))
        if done:
            self.feed.release(done)

    def _wait_for_room(self) -> None:
        while not self._stop.is_set():
            acked = self.state.acked_all()  # one round trip per check
            self._release_acked(acked)
            if max(len(s) for s in self._unacked) <= self.settings.max_ahead:
                return
            self._update_compute()  # the ranks are training: their reports come in
            head = self.state.head()  # stalled: did the world change, or the state lose steps?
            if head.generation != self._world_gen:
                raise WorldChanged(f"job {self.job.job_id}: world {head.generation} replaced "
                                   f"world {self._world_gen}")
            through = head.published_through
            if through < self._last_published:
                raise StateRolledBack(f"job {self.job.job_id}: the state holds steps through "
                                      f"{through}, this producer published through "
                                      f"{self._last_published}")
            self._stop.wait(self.settings.poll_seconds)

    def _linger(self) -> bool:
        """Planning is over: keep releasing payloads as ranks acknowledge, until all are
        released or no rank made progress for `linger_seconds` (a rank that never returns).
        True when a reconfiguration reopened the job meanwhile (plan again: `run`)."""
        last, since = None, time.monotonic()
        while any(self._unacked) and not self._stop.is_set():
            try:
                head = self.state.head()
                if head.generation != self._world_gen:
                    if not self.state.is_done():
                        return True  # the payloads stay for the draining ranks (_enter_world)
                    break  # a new world with nothing to plan: this one's payloads go
                if head.published_through < self._last_published:  # Redis lost the reveal
                    self.state.reveal(fence=self.generation)
                acked = self.state.acked_all()
                self._update_compute()  # planning is over; the fit's status follows the ranks
            except Fenced:  # a successor holds the lease: its payloads are its own
                self._fenced.set()
                break
            except StateUnavailable:
                acked = last or [-1] * self._world
            self._release_acked(acked)
            if acked != last:
                last, since = acked, time.monotonic()
            elif time.monotonic() - since > self.settings.linger_seconds:
                log.info("job %s: no acknowledgement for %.0fs; releasing the rest",
                         self.job.job_id, self.settings.linger_seconds)
                break
            self._stop.wait(max(self.settings.poll_seconds, 0.2))
        rest = [(n, r) for r, steps in enumerate(self._unacked) for n in steps] + self._retired
        self._retired = []
        self._unacked = [deque() for _ in range(self._world)]
        if rest:
            self.feed.release(rest)
        return False


@dataclass
class _Pending:
    """What the next publication carries (collected since the previous one)."""

    samples_in: int = 0

    def __post_init__(self) -> None:
        self.steps: list[Step] = []
        self.ends: list[EpochEnd] = []
        self.quarantined: list[QuarantineEntry] = []

    def take(self, events: list[PlanEvent]) -> tuple[bool, list[MeasuredSample]]:
        """Add the planner's events: (a step is among them, the samples it set aside)."""
        stepped = False
        dropped: list[MeasuredSample] = []
        for ev in events:
            if isinstance(ev, Step):
                self.steps.append(ev)
                stepped = True
            elif isinstance(ev, EpochEnd):
                self.ends.append(ev)
            elif isinstance(ev, Quarantined):
                self.quarantined.append(QuarantineEntry(str(ev.sample.sample_id),
                                                        ev.reason.value, ev.detail))
                dropped.append(ev.sample)
        return stepped, dropped

    def clear(self) -> None:
        self.samples_in = 0
        self.steps.clear()
        self.ends.clear()
        self.quarantined.clear()
