"""One job inside the server process: producer thread, payload cache, batch building.

Producer (one thread): source -> payload cache (keyed by (epoch, sample_id)) -> planner ->
JobState. A step is published to JobState *before* any sender can see it (senders only read
JobState). The producer blocks while any rank has more than `max_ahead` published-but-unacked
steps, so the cache holds at most the planner's window and pool plus max_ahead steps of samples
however slow a trainer is (the planner releases a whole pool of steps at once). Payloads are
evicted once their step is acked; a rank that rewinds (restored from an older checkpoint) gets
them rebuilt through `SampleSource.get` (byte-identical).

Senders (one per connected rank, in data_server.py) call `build_message(step, rank)`.

Round trips (the state may be Redis): one `acked_all()` per back-pressure check (not one
`acked(rank)` per rank per sample), `get_step_for(n, [rank])` to evict one rank's payloads, and
`add_counters` once per published batch of steps. States without those extras (the JobState
protocol only) get the per-rank fallbacks. Dead ranks (Guarantee 4): `dead_ranks(timeout)` asks
the state's `timed_out_ranks` at most every ~0.25 s, shared by every stream of the job.

Shared reads (senders): with a state in another process (Redis) every sender reading the plan
itself costs one round trip per check per rank; at W=256 that was most of the server's CPU. The
senders read through a per-job, in-process cache instead (`cached_published_through`,
`cached_step`, `cached_epoch_end`): `published_through` is pushed by this process's producer when
it publishes and otherwise refreshed at most every `refresh_seconds` (other replicas' publishes),
so it is stale by at most that interval and never ahead of the state; steps and END records are
write-once, so a small LRU of decoded Steps (fetched once per step per process, shared by all
ranks) is always correct. Acks of all streams go through `ack`, which groups those made while a
round trip is in flight into one pipelined round trip. Disabled (direct calls) for the
in-process MemoryJobState.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from pipeline.config import JobConfig
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import PlannerState, StepPlanner
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, Quarantined, Step
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.redis_client import RedisUnavailable
from pipeline.service import collate as col
from pipeline.service.job_state import JobState, PlannerCheckpoint
from pipeline.service.memory_state import MemoryJobState
from pipeline.service.sources import SampleSource
from pipeline.service.wire_codec import batch_message_bytes
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

log = logging.getLogger(__name__)

try:  # the coordinator is optional; its refusals below mean "the state lost recent writes"
    from pipeline.coordinator.errors import CheckpointConflict, StepGap
except ImportError:  # pragma: no cover
    class StepGap(ValueError):  # type: ignore[no-redef]
        pass

    class CheckpointConflict(ValueError):  # type: ignore[no-redef]
        pass


class StateRolledBack(RuntimeError):
    """The state's plan is shorter than what this producer published: it lost recent writes
    (e.g. Redis restarted from an AOF fsynced every second). Production resumes from the
    state's checkpoint, which was written atomically with the steps it covers."""


def policy_for(job: JobConfig) -> BatchingPolicy:
    return job.batching.policy()


def _reason_kind(why: str) -> str:
    """A planner quarantine reason ("num_tokens=9000 exceeds token_budget=4096") as a short,
    bounded counter name (the numbers would make one Redis field per sample)."""
    if why.startswith("invalid size"):
        return "invalid_size"
    if why.startswith("num_visual_tokens="):
        return "over_visual_budget"
    if why.startswith("num_tokens="):
        return "over_token_budget"
    return (why.split(":", 1)[0].split() or ["other"])[0][:32]


@dataclass
class RankInfo:
    """What this server knows of a rank's connection (for GetJob)."""

    client_id: str = ""
    connected: bool = False
    delivered: int = -1


@dataclass
class _RankSteps:
    steps: list[int] = field(default_factory=list)  # this rank's step numbers, ascending
    evicted_upto: int = 0  # index into steps: payloads of steps[:evicted_upto] were dropped


class JobRuntime:
    def __init__(
        self, job: JobConfig, state: JobState, source: SampleSource, *,
        prefetch_steps: int = 4, pad_id: int = 0, max_ahead: int | None = None,
        pool_steps: int | None = None, shared_cache: bool | None = None,
        refresh_seconds: float = 0.025, step_cache_size: int | None = None,
    ) -> None:
        self.job = job
        self.state = state
        if isinstance(state, MemoryJobState) and state.world_size is None:
            state.world_size = job.world_size  # for its acked_all()
        self.source = source
        self.pad_id = pad_id
        self.mode = job.mode
        self.world_size = job.world_size
        self.collate = job.batching.collate
        # Planner balancing pool in steps (None: the job's config, else the planner's default).
        self.pool_steps = pool_steps if pool_steps is not None else job.batching.pool_steps
        # Room for a full client window plus the step held by the trainer and the one in flight.
        self.max_ahead = max_ahead if max_ahead is not None else 2 * prefetch_steps + 2
        self.changed = threading.Condition()  # notified on publish / ack / stop
        self.ranks = [RankInfo() for _ in range(job.world_size)]
        self.samples_in = 0
        self.quarantined: list[str] = []
        self.error: str | None = None
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, str], ProcessedSample] = {}
        self._rank_steps = [_RankSteps() for _ in range(job.world_size)]
        self._loss: OrderedDict[int, dict[int, int]] = OrderedDict()  # step -> rank -> n
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at = time.monotonic()
        self._dead_lock = threading.Lock()
        self._dead_cache: tuple[float, float, dict[int, float]] | None = None  # (at, timeout, v)
        self._known_through = -1  # steps <= this were published before this runtime (restart)
        self._last_published = -1  # highest step this producer published
        self._counts: Counter = Counter()  # pending add_counters: samples, tokens, q:<reason>
        # How long the producer keeps retrying a state it cannot reach (e.g. Redis restarting)
        # before the job fails; each retry resumes from the state's planner checkpoint.
        self.state_retry_seconds = 60.0
        # Per-job read cache for the senders (see the module docstring).
        self.shared_cache = (not isinstance(state, MemoryJobState) if shared_cache is None
                             else shared_cache)
        self.refresh_seconds = refresh_seconds
        self._pt_lock = threading.Lock()
        self._pt: tuple[float, int | None, BaseException | None] | None = None  # (at, v, err)
        self._steps_lock = threading.Lock()  # guards _steps
        self._fetch_lock = threading.Lock()  # one fetch of a step at a time per process
        self._steps: OrderedDict[int, Step] = OrderedDict()
        self._steps_max = step_cache_size or max(64, 4 * self.max_ahead)
        self._ends_lock = threading.Lock()
        self._ends: dict[int, EpochEnd] = {}
        self._ends_at = -1.0
        # Acks of all streams grouped into pipelined round trips (see `ack`).
        self._ack_lock = threading.Lock()
        self._ack_queue: list[tuple[int, int, list]] = []
        self._ack_flushing = False

    # --- state access, cheap where the state allows it ---
    def acked_all(self) -> list[int]:
        """Every rank's ack cursor: one round trip when the state has `acked_all`."""
        fn = getattr(self.state, "acked_all", None)
        if fn is not None:
            out = list(fn())[:self.world_size]
            return out + [-1] * (self.world_size - len(out))
        return [self.state.acked(r) for r in range(self.world_size)]

    def step_for(self, step: int, rank: int) -> Step | None:
        """`step` restricted to `rank`'s batch where the state can (one HMGET in Redis)."""
        fn = getattr(self.state, "get_step_for", None)
        return fn(step, [rank]) if fn is not None else self.state.get_step(step)

    # --- the senders' shared read cache ---
    def cached_published_through(self) -> int:
        """`state.published_through()`, at most `refresh_seconds` stale (one round trip per
        interval per process, whatever the number of streams). Never ahead of the state: it is
        either read from it or pushed by this producer right after its publish returned. A
        failed read is re-raised to the readers of the same interval (no retry storm)."""
        if not self.shared_cache:
            return self.state.published_through()
        with self._pt_lock:
            c = self._pt
            if c is None or time.monotonic() - c[0] >= self.refresh_seconds:
                at = time.monotonic()
                try:
                    c = (at, self.state.published_through(), None)
                except Exception as exc:
                    c = (at, None, exc)
                self._pt = c
            if c[2] is not None:
                raise c[2]
            return c[1]  # type: ignore[return-value]

    def _push_published(self, step: int) -> None:
        """This producer published `step`: readers of this process see it at once."""
        if not self.shared_cache:
            return
        with self._pt_lock:
            c = self._pt
            if c is not None and c[2] is None and c[1] is not None and c[1] >= step:
                return
            self._pt = (time.monotonic(), step, None)

    def cached_step(self, n: int) -> Step | None:
        """The published step `n` (None: not in the state), decoded once per process and shared
        by every stream; steps are write-once, so a cached one is always correct. Call only for
        n <= `cached_published_through()` (never serves an unpublished step: only what the state
        returned is cached)."""
        if not self.shared_cache:
            return self.state.get_step(n)
        with self._steps_lock:
            hit = self._steps.get(n)
            if hit is not None:
                self._steps.move_to_end(n)
                return hit
        with self._fetch_lock:  # the other streams wanting `n` wait for this one fetch
            with self._steps_lock:
                hit = self._steps.get(n)
                if hit is not None:
                    return hit
            step = self.state.get_step(n)
            if step is not None:
                with self._steps_lock:
                    self._steps[n] = step
                    while len(self._steps) > self._steps_max:
                        self._steps.popitem(last=False)
            return step

    def cached_epoch_end(self, epoch: int) -> EpochEnd | None:
        """Epoch `epoch`'s END record, None if not yet published. ENDs are write-once: once
        seen they are kept; a miss re-reads the state at most every `refresh_seconds`."""
        if not self.shared_cache:
            return next((e for e in self.state.epoch_ends() if e.epoch == epoch), None)
        with self._ends_lock:
            hit = self._ends.get(epoch)
            if hit is not None or time.monotonic() - self._ends_at < self.refresh_seconds:
                return hit
            self._ends_at = time.monotonic()  # a failed read is not retried by every stream
            ends = self.state.epoch_ends()
            for e in ends:
                self._ends.setdefault(e.epoch, e)
            return self._ends.get(epoch)

    def ack(self, rank: int, step: int) -> None:
        """`state.ack(rank, step)`, with the acks that streams make while a round trip is in
        flight sent together in one pipelined round trip (`ack_heartbeat_many` without a client
        id: the same script and checks as `ack`). Group commit: the first caller flushes the
        queue until it is empty, the others wait for their result. A failing batch is redone
        one ack at a time (acks are idempotent), so each caller gets its own error
        (AckAheadOfPlan, RedisUnavailable) exactly as with `state.ack`."""
        many = getattr(self.state, "ack_heartbeat_many", None)
        if not self.shared_cache or many is None or step < 0:
            self.state.ack(rank, step)
            return
        slot: list = [None, threading.Event()]  # [error, done]
        with self._ack_lock:
            self._ack_queue.append((rank, step, slot))
            lead = not self._ack_flushing
            self._ack_flushing = True
        if lead:
            while True:
                with self._ack_lock:
                    batch, self._ack_queue = self._ack_queue, []
                    if not batch:
                        self._ack_flushing = False
                        break
                self._flush_acks(batch, many)
        slot[1].wait()
        if slot[0] is not None:
            raise slot[0]

    def _flush_acks(self, batch: list[tuple[int, int, list]], many) -> None:
        try:
            if len(batch) == 1:
                raise LookupError  # one ack: the plain call
            many([(r, "", s) for r, s, _ in batch], 0.0)
        except BaseException:
            for r, s, slot in batch:
                try:
                    self.state.ack(r, s)
                except BaseException as exc:
                    slot[0] = exc
        finally:
            for _, _, slot in batch:
                slot[1].set()

    def dead_ranks(self, rank_timeout_seconds: float) -> dict[int, float]:
        """rank -> seconds its lease has been lapsed, for ranks lapsed (held before, no live
        holder, not re-claimed) longer than `rank_timeout_seconds` (Guarantee 4).

        Needs the state's optional `timed_out_ranks` (RedisJobState, MemoryJobState); {}
        without it. A freshly started runtime does not count lapse time from before it was up
        longer than its own uptime: after a server restart every rank gets the full timeout to
        reconnect. Cached ~0.25 s so many waiting streams cost one query."""
        fn = getattr(self.state, "timed_out_ranks", None)
        if fn is None:
            return {}
        now = time.monotonic()
        with self._dead_lock:
            c = self._dead_cache
            if c is not None and c[1] == rank_timeout_seconds and now - c[0] < 0.25:
                return c[2]
        uptime = now - self.started_at
        if uptime <= rank_timeout_seconds:
            out: dict[int, float] = {}
        else:
            try:
                timed_out = fn(rank_timeout_seconds)
            except Exception:  # e.g. Redis restarting: a status probe never kills a stream
                log.debug("job %s: timed_out_ranks failed", self.job.job_id, exc_info=True)
                timed_out = {}
            out = {r: min(float(t), uptime) for r, t in timed_out.items()}
        with self._dead_lock:
            self._dead_cache = (now, rank_timeout_seconds, out)
        return out

    # --- lifecycle ---
    def start(self) -> JobRuntime:
        if self.state.is_done():  # the whole plan survives in JobState (e.g. Redis): serve it
            return self
        self._thread = threading.Thread(target=self._produce, name=f"producer-{self.job.job_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.source.close()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def wait(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)

    # --- producer ---
    def _restore(self) -> tuple[StepPlanner, int, int]:
        """The planner and source position to continue from (a restarted server resumes the
        published plan: the same inputs replay the same steps, and republishing is a no-op)."""
        policy = policy_for(self.job)
        self._known_through = self.state.published_through()
        self._last_published = self._known_through
        cp = self.state.load_checkpoint()
        if cp is None or not cp.state:
            planner = StepPlanner(policy, self.world_size, self.mode, self.job.seed,
                                  self.pool_steps)
            return planner, 0, 0
        snap = PlannerState.from_dict(json.loads(cp.state))
        planner = StepPlanner.restore(snap, policy, self.world_size, self.mode, self.job.seed,
                                      self.pool_steps)
        # Re-index the published steps still pending somewhere (for back-pressure).
        low = min(self.acked_all()) + 1
        for n in range(max(0, low), self._known_through + 1):
            step = self.state.get_step(n)
            for b in step.batches if step else ():
                self._rank_steps[b.rank].steps.append(n)
        log.info("job %s: planner restored at epoch %d row %d, next step %d",
                 self.job.job_id, cp.epoch, cp.samples_consumed, cp.next_step)
        return planner, cp.epoch, cp.samples_consumed

    def _checkpoint(self, planner: StepPlanner, epoch: int, rows: int) -> None:
        self.state.save_checkpoint(PlannerCheckpoint(
            epoch=epoch, samples_consumed=rows, next_step=planner.next_step,
            state=json.dumps(planner.snapshot().to_dict()).encode()))

    def _produce(self) -> None:
        """Run the plan; an unreachable state (Redis restarting) is retried from the saved
        checkpoint (republishing identical steps is a no-op) for `state_retry_seconds`."""
        failing_since: float | None = None
        while not self._stop.is_set():
            attempt = time.monotonic()
            try:
                self._produce_once()
                return
            except (RedisUnavailable, StateRolledBack, StepGap, CheckpointConflict) as exc:
                now = time.monotonic()
                if failing_since is None or now - attempt > 5.0:  # it had recovered
                    failing_since = now
                if now - failing_since > self.state_retry_seconds:
                    log.exception("job %s: state unreachable for %.0fs", self.job.job_id,
                                  now - failing_since)
                    self.error = f"{type(exc).__name__}: {exc}"
                    self.notify()
                    return
                log.warning("job %s: state unreachable or rolled back (%s: %s); resuming "
                            "from its checkpoint", self.job.job_id, type(exc).__name__, exc)
                self._stop.wait(0.5)
                self._rank_steps = [_RankSteps() for _ in range(self.world_size)]
                self._counts.clear()
            except Exception as exc:  # a producer failure must reach the ranks, not vanish
                log.exception("job %s: producer failed", self.job.job_id)
                self.error = f"{type(exc).__name__}: {exc}"
                self.notify()
                return

    def _produce_once(self) -> None:
        planner, first_epoch, start_row = self._restore()
        for epoch in range(first_epoch, self.job.epochs):
            rows = start_row if epoch == first_epoch else 0  # source rows consumed
            for item in self.source.iter_epoch(epoch, rows):
                if self._stop.is_set():
                    return
                rows += 1
                if isinstance(item, QuarantinedRecord):
                    self.quarantined.append(
                        f"{item.source}:{item.row}: {item.reason}: {item.detail}")
                    self._counts[f"q:{item.reason}"] += 1
                    continue
                with self._lock:
                    self._cache[(epoch, item.sample_id)] = item
                self.samples_in += 1
                if self._handle(planner.feed(item.measured()), epoch):
                    self._checkpoint(planner, epoch, rows)  # after its steps are published
                    self._wait_for_room()  # room only shrinks when steps are published
            self._handle(planner.end_epoch(), epoch)
            self._checkpoint(planner, epoch + 1, 0)
        self._flush_counters()
        self.state.mark_done()
        self.notify()

    def _handle(self, events: list, epoch: int) -> bool:
        """Publish the planner's events; True if any step was published."""
        published = False
        for ev in events:
            if isinstance(ev, Step):
                self._loss_tokens(ev)  # needs payloads: compute while they are cached
                self.state.publish_step(ev)
                published = True
                self._last_published = max(self._last_published, ev.step)
                self._push_published(ev.step)
                if ev.step > self._known_through:  # a replay after restart is not new output
                    self._counts["samples"] += ev.info.step_samples
                    self._counts["tokens"] += ev.info.step_tokens
                for b in ev.batches:
                    rs = self._rank_steps[b.rank].steps
                    if not rs or rs[-1] < ev.step:  # a replay after restart republishes
                        rs.append(ev.step)
            elif isinstance(ev, Quarantined):
                self.quarantined.append(f"{ev.sample.sample_id}: {ev.reason}")
                self._counts[f"q:{_reason_kind(ev.reason)}"] += 1
                with self._lock:  # never emitted: drop its payload now
                    for e in (epoch, epoch - 1):
                        self._cache.pop((e, str(ev.sample.sample_id)), None)
            elif isinstance(ev, EpochEnd):
                self.state.publish_epoch_end(ev)
                if self.shared_cache:
                    with self._ends_lock:
                        self._ends.setdefault(ev.epoch, ev)
        if published:
            self._flush_counters()
        if events:
            self.notify()
        return published

    def _flush_counters(self) -> None:
        """One `add_counters` call (one round trip) per published batch of steps; metrics only,
        so a failure is logged, never fatal."""
        fn = getattr(self.state, "add_counters", None)
        if fn is None or not self._counts:
            self._counts.clear()
            return
        c, self._counts = self._counts, Counter()
        quarantined = {k[2:]: n for k, n in c.items() if k.startswith("q:")}
        try:
            fn(samples=c["samples"], tokens=c["tokens"], quarantined=quarantined)
        except Exception:
            log.warning("job %s: add_counters failed", self.job.job_id, exc_info=True)

    def pending(self, rank: int, acked: list[int] | None = None) -> int:
        """Published steps of `rank` after its last ack (`acked`: from `acked_all()`)."""
        rs = self._rank_steps[rank]
        cur = acked[rank] if acked is not None else self.state.acked(rank)
        return len(rs.steps) - bisect.bisect_right(rs.steps, cur)

    def _wait_for_room(self) -> None:
        while not self._stop.is_set():
            acked = self.acked_all()  # one round trip per check
            self._evict_acked(acked)
            if max(self.pending(r, acked) for r in range(self.world_size)) <= self.max_ahead:
                return
            through = self.state.published_through()  # stalled: did the state lose steps?
            if through < self._last_published:
                raise StateRolledBack(f"job {self.job.job_id}: the state holds steps through "
                                      f"{through}, this producer published through "
                                      f"{self._last_published}")
            self.wait(0.1)  # acks notify; the timeout covers acks made on other replicas

    def _evict_acked(self, acked: list[int] | None = None) -> None:
        acked = acked if acked is not None else self.acked_all()
        for rank, rs in enumerate(self._rank_steps):
            upto = bisect.bisect_right(rs.steps, acked[rank])
            while rs.evicted_upto < upto:
                step = self.step_for(rs.steps[rs.evicted_upto], rank)
                rs.evicted_upto += 1
                b = step.batch_for(rank) if step else None
                if b is None:
                    continue
                with self._lock:
                    for s in b.samples:
                        for e in (step.epoch, step.epoch - 1):
                            self._cache.pop((e, str(s.sample_id)), None)

    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)

    # --- payloads and batches ---
    def _payload(self, s: MeasuredSample, epoch: int) -> ProcessedSample:
        """The payload the planner measured. Quota carry-over plans a sample of epoch e-1 in
        epoch e, so both are candidates; the measured length disambiguates."""
        sid = str(s.sample_id)
        with self._lock:
            for e in (epoch, epoch - 1):
                p = self._cache.get((e, sid))
                if p is not None and p.num_tokens == s.num_tokens:
                    return p
        for e in (epoch, epoch - 1):
            if e < 0:
                continue
            p = self.source.get(sid, e)
            if p.num_tokens == s.num_tokens:
                return p
        raise LookupError(f"job {self.job.job_id}: no payload of {sid} with "
                          f"{s.num_tokens} tokens in epoch {epoch} or {epoch - 1}")

    def _pieces(self, batch: Batch, epoch: int) -> list[col.Piece]:
        return [col.Piece(self._payload(s, epoch), batch.truncated_to.get(s.sample_id))
                for s in batch.samples]

    def _loss_tokens(self, step: Step) -> dict[int, int]:
        with self._lock:
            hit = self._loss.get(step.step)
        if hit is not None:
            return hit
        counts = {b.rank: col.loss_tokens(self._pieces(b, step.epoch), self.collate)
                  for b in step.batches}
        with self._lock:
            self._loss[step.step] = counts
            while len(self._loss) > 100_000:  # small ints; bound anyway
                self._loss.popitem(last=False)
        return counts

    def build_message(self, step: Step, rank: int) -> bytes | None:
        """The rank's Batch of `step` as serialized ServerMessage bytes (None: no batch there).

        Framed by `wire_codec.batch_message_bytes` (payloads are megabytes: one copy)."""
        batch = step.batch_for(rank)
        if batch is None:
            return None
        arrays = col.collate(self._pieces(batch, step.epoch), self.collate, self.pad_id)
        loss = self._loss_tokens(step)
        out = pb.Batch(step=step.step, epoch=step.epoch, rank=rank,
                       sample_ids=[str(i) for i in batch.sample_ids], collate=self.collate,
                       over_budget=batch.over_budget)
        info = out.info
        info.step_samples = step.info.step_samples
        info.step_tokens = step.info.step_tokens
        info.rank_samples = len(batch.samples)
        info.rank_tokens = batch.num_tokens
        info.step_loss_tokens = sum(loss.values())
        info.rank_loss_tokens = loss.get(rank, 0)
        info.world_size = self.world_size
        return batch_message_bytes(out, arrays)
