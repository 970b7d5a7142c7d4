"""One job inside the server process: producer thread, payload cache, batch building.

Producer (one thread): source -> payload cache (keyed by (epoch, sample_id)) -> planner ->
JobState. A step is published to JobState *before* any sender can see it (senders only read
JobState). The producer blocks while any rank has more than `max_ahead` published-but-unacked
steps, so the cache holds at most the planner's window and pool plus max_ahead steps of samples
however slow a trainer is (the planner releases a whole pool of steps at once). Payloads are
evicted once their step is acked; a rank that rewinds (restored from an older checkpoint) gets
them rebuilt through `SampleSource.get` (byte-identical).

Senders (one per connected rank, in data_server.py) call `build_message(step, rank)`.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from pipeline.config import JobConfig
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import PlannerState, StepPlanner
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, Quarantined, Step
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.service import collate as col
from pipeline.service.job_state import JobState, PlannerCheckpoint
from pipeline.service.sources import SampleSource
from pipeline.service.wire_codec import batch_message_bytes
from pipeline.wire.odb.v1 import data_service_pb2 as pb

log = logging.getLogger(__name__)


def policy_for(job: JobConfig) -> BatchingPolicy:
    b = job.batching
    return BatchingPolicy(
        token_budget=b.token_budget, collate=b.collate, attn_a=b.attn_a, attn_b=b.attn_b,
        max_visual_tokens=b.max_visual_tokens, buffer_size=b.buffer_size,
        over_budget=b.over_budget,
    )


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
        pool_steps: int | None = None,
    ) -> None:
        self.job = job
        self.state = state
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
        cp = self.state.load_checkpoint()
        if cp is None or not cp.state:
            planner = StepPlanner(policy, self.world_size, self.mode, self.job.seed,
                                  self.pool_steps)
            return planner, 0, 0
        snap = PlannerState.from_dict(json.loads(cp.state))
        planner = StepPlanner.restore(snap, policy, self.world_size, self.mode, self.job.seed,
                                      self.pool_steps)
        # Re-index the published steps still pending somewhere (for back-pressure).
        low = min(self.state.acked(r) for r in range(self.world_size)) + 1
        for n in range(max(0, low), self.state.published_through() + 1):
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
        try:
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
                        continue
                    with self._lock:
                        self._cache[(epoch, item.sample_id)] = item
                    self.samples_in += 1
                    if self._handle(planner.feed(item.measured()), epoch):
                        self._checkpoint(planner, epoch, rows)  # after its steps are published
                        self._wait_for_room()  # room only shrinks when steps are published
                self._handle(planner.end_epoch(), epoch)
                self._checkpoint(planner, epoch + 1, 0)
            self.state.mark_done()
            self.notify()
        except Exception as exc:  # a producer failure must reach the ranks, not vanish
            log.exception("job %s: producer failed", self.job.job_id)
            self.error = f"{type(exc).__name__}: {exc}"
            self.notify()

    def _handle(self, events: list, epoch: int) -> bool:
        """Publish the planner's events; True if any step was published."""
        published = False
        for ev in events:
            if isinstance(ev, Step):
                self._loss_tokens(ev)  # needs payloads: compute while they are cached
                self.state.publish_step(ev)
                published = True
                for b in ev.batches:
                    rs = self._rank_steps[b.rank].steps
                    if not rs or rs[-1] < ev.step:  # a replay after restart republishes
                        rs.append(ev.step)
            elif isinstance(ev, Quarantined):
                self.quarantined.append(f"{ev.sample.sample_id}: {ev.reason}")
                with self._lock:  # never emitted: drop its payload now
                    for e in (epoch, epoch - 1):
                        self._cache.pop((e, str(ev.sample.sample_id)), None)
            elif isinstance(ev, EpochEnd):
                self.state.publish_epoch_end(ev)
        if events:
            self.notify()
        return published

    def pending(self, rank: int) -> int:
        """Published steps of `rank` after its last ack."""
        rs = self._rank_steps[rank]
        return len(rs.steps) - bisect.bisect_right(rs.steps, self.state.acked(rank))

    def _wait_for_room(self) -> None:
        while not self._stop.is_set():
            self._evict_acked()
            if max(self.pending(r) for r in range(self.world_size)) <= self.max_ahead:
                return
            self.wait(0.1)  # acks notify; the timeout covers acks made on other replicas

    def _evict_acked(self) -> None:
        for rank, rs in enumerate(self._rank_steps):
            upto = bisect.bisect_right(rs.steps, self.state.acked(rank))
            while rs.evicted_upto < upto:
                step = self.state.get_step(rs.steps[rs.evicted_upto])
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
