"""Which world a rank's Open belongs to, and where its stream starts (docs/elastic.md).

An Open names a world size, not a world generation; a reconfiguration never keeps the size (a
request for the current size changes nothing), so the size tells them apart:
- the current world's size: a rank of the current world. A resume position before the world's
  first step that is past the previous world's last step (a state saved at or after that
  world's END(reconfigure), from any of its ranks) starts at the new world's first step; an
  earlier one is OUT_OF_RANGE (those steps were run by the old world and cannot be re-planned);
- the previous world's size: a rank of the world a reconfiguration ended, which drains to its
  last step and then gets END(reconfigure) (at once when it has nothing left); unless it
  restores a position past the current world's first step, which no rank of the previous
  world can hold (they never ran the current world's steps): that is a new world of the
  previous size (a lost node came back: 2 -> 1 -> 2), as below;
- another size, on an `elastic` job: the implicit reconfiguration (torchrun restarted the
  trainers with a new WORLD_SIZE), made once every rank of the current world ended or lost its
  lease; with a restored position every step before it counts as consumed;
- anything else: INVALID_ARGUMENT.
Refusals are domain errors (`BadRequest`, `PositionUnavailable`, the state's `ScaleRefused`);
the gRPC adapter gives each its status code. Reads the job's state through the replica's
runtime; the only write is the implicit reconfiguration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipeline.errors import (
    BadRequest,
    GroupRefused,
    PositionUnavailable,
    RanksLive,
    ScaleInProgress,
)
from pipeline.jobstate.interface import GROUP_HOLDER_PREFIX, MAX_GROUP_SIZE, Member
from pipeline.jobstate.worlds import PlanHead, ScaleReason, ScaleRequest, World
from pipeline.planner.types import EpochEnd
from pipeline.service.job_runtime import JobRuntime
from pipeline.service.scaling import refuse_finished
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire_format import GROUP_REFUSED_PREFIX

log = logging.getLogger(__name__)

RESUME_FROM_CURSOR = -1  # Open.resume_step: continue at the rank's first unacknowledged step
# Requests are small and their fields bounded (they reach Redis and the logs).
MAX_CREDITS = 1 << 16  # per Open or Ack (a stream holds at most the replica's prefetch window)
MAX_CLIENT_ID = 256  # characters


@dataclass(frozen=True)
class StreamStart:
    """Where a stream starts: its world and position, and for a rank of an ended world its
    last step and the next world's size. `beyond_plan`: the position is past the published
    plan (the state lost publications the client had received): the stream waits for the
    producer to publish it again (`rank_stream`)."""

    world: int
    world_size: int
    pos: int
    epoch: int
    limit: int | None = None
    next_world_size: int = 0
    beyond_plan: bool = False

    @property
    def has_work(self) -> bool:
        """False for a rank of an ended world with nothing left before its END(reconfigure)."""
        return self.limit is None or self.pos <= self.limit


def beyond_the_plan(job_id: str, step: int, through: int, why: str = "") -> PositionUnavailable:
    return PositionUnavailable(
        f"resume_step {step} is beyond the plan of job {job_id!r}: its last published step is "
        f"{through}{why}, so step {step} was never delivered")


def _epoch_first(ends: list[EpochEnd], epoch: int) -> int:
    """The first step an epoch can have: after the last step of every earlier epoch."""
    return max((e.last_step for e in ends if e.epoch < epoch), default=-1) + 1


def member_of(op: pb.Open, rt: JobRuntime) -> Member | None:
    """The Open's seat in its rank's model-parallel group (None: the rank is the client's
    alone): INVALID_ARGUMENT for a seat outside [0, group_size) or a size beyond
    MAX_GROUP_SIZE; FAILED_PRECONDITION (`GroupRefused`) for a group on a job that does not
    say how its sequences are padded (every split of a sequence across a group, context or
    sequence parallelism, needs a multiple: `batching.pad_to_multiple`, 1 when none is)."""
    size = op.group_size or 1
    if not 1 <= size <= MAX_GROUP_SIZE or not 0 <= op.group_rank < size:
        raise BadRequest(f"group_rank must be in [0, group_size) and group_size in [1, "
                         f"{MAX_GROUP_SIZE}], got group_rank {op.group_rank} and group_size "
                         f"{op.group_size}")
    if size == 1:
        return None
    if rt.job.batching.pad_to_multiple is None:
        raise GroupRefused(
            f"{GROUP_REFUSED_PREFIX}: job {rt.job.job_id!r} does not set "
            f"batching.pad_to_multiple, and rank {op.rank} was opened by a model-parallel "
            f"group (group_size {size}): set it to the multiple every sequence must be padded "
            "to for the group's layout (2 x CP for context parallelism, TP for sequence "
            "parallelism, 8 or 16 for FP8 kernels; 1 when the layout splits no sequence)")
    return Member(op.group_rank, size)


def resolve(op: pb.Open, rt: JobRuntime) -> StreamStart:
    if not 0 <= op.credits <= MAX_CREDITS:
        raise BadRequest(f"credits must be in [0, {MAX_CREDITS}], got {op.credits}")
    if len(op.client_id) > MAX_CLIENT_ID:
        raise BadRequest(f"client_id must be at most {MAX_CLIENT_ID} characters, got "
                         f"{len(op.client_id)}")
    if op.client_id.startswith(GROUP_HOLDER_PREFIX):
        raise BadRequest(f"client_id must not start with {GROUP_HOLDER_PREFIX!r} (it names a "
                         f"group's lease), got {op.client_id!r}")
    if op.resume_step < RESUME_FROM_CURSOR:
        raise BadRequest(f"resume_step must be >= 0 (or {RESUME_FROM_CURSOR}: where the rank "
                         f"left off), got {op.resume_step}")
    head = rt.plan.fresh_head()
    if op.world_size != head.world_size:
        worlds = rt.state.worlds()
        prev = worlds[head.generation - 1] if head.generation >= 1 else None
        if (prev is not None and op.world_size == prev.world_size
                and op.resume_step <= head.first_step):
            return _drain_start(op, rt, prev, head)
        if not rt.job.elastic:
            history = " -> ".join(str(w.world_size) for w in worlds)
            job_id = rt.job.job_id
            raise BadRequest(
                f"job {job_id!r} runs {head.world_size} ranks, this rank opened with world_size "
                f"{op.world_size}" + (f" (world sizes so far: {history})" if prev else "")
                + f": start {head.world_size} ranks, or move the job onto {op.world_size} "
                f"first (`odb-pipeline scale --job {job_id} --world-size {op.world_size}`, or "
                "`elastic: true` on the job so an Open with a new world size does)")
        head = _elastic_switch(op, rt, head, worlds)
    if not 0 <= op.rank < head.world_size:
        raise BadRequest(f"rank {op.rank} is outside [0, {head.world_size}) for job "
                         f"{rt.job.job_id!r}")
    return _current_start(op, rt, head)


def _map_position(rt: JobRuntime, head: PlanHead, step: int, epoch: int) -> int:
    """A resume position of a rank of the current world (see the module docstring): a position
    past everything the previous world ran (or, through worlds that ran nothing, an earlier
    one) is the current world's first step."""
    if step >= head.first_step or head.generation == 0:
        return step
    worlds = rt.state.worlds()
    effective = max(step, _epoch_first(rt.state.epoch_ends(), epoch))
    g = head.generation
    while effective < worlds[g].first_step:
        prev = worlds[g - 1]
        if effective > prev.last_step:
            break
        if prev.last_step >= prev.first_step:
            raise _inside(rt, head, step, prev)
        g -= 1  # that world ran nothing: the position may be at the end of the one before
    return head.first_step


def _inside(rt: JobRuntime, head: PlanHead, step: int, prev: World) -> PositionUnavailable:
    return PositionUnavailable(
        f"resume_step {step} of job {rt.job.job_id!r} is inside world {prev.generation} "
        f"({prev.world_size} ranks, which ran through step {prev.last_step} before the switch "
        f"to {head.world_size}): those steps cannot be re-planned. Restore a state saved at or "
        "after the END(reconfigure), or open without a state to start at the new world's first "
        f"step {head.first_step}")


def _elastic_switch(op: pb.Open, rt: JobRuntime, head: PlanHead, worlds: list[World]
                    ) -> PlanHead:
    job = rt.job
    if not 1 <= op.world_size <= job.world_size_cap():
        raise BadRequest(f"world_size {op.world_size} is outside [1, {job.world_size_cap()}] "
                         f"(job {job.job_id!r}'s max_world_size)")
    refuse_finished(rt)
    position = None
    if op.resume_step >= 0:
        position = _map_position(rt, head, op.resume_step, op.resume_epoch)
    try:
        res = rt.state.scale(ScaleRequest(op.world_size, ScaleReason.ELASTIC, position=position,
                                          require_gone=True, expect_generation=head.generation))
    except RanksLive as exc:
        raise RanksLive(f"{exc}: an Open with world_size {op.world_size} moves the elastic job "
                        "onto it once they ended or their leases lapsed; retrying") from None
    if res.changed:
        log.info("job %s: elastic reconfiguration %d -> %d ranks at step %s (Open of rank %d)",
                 job.job_id, res.previous.world_size, res.world.world_size,
                 res.previous.last_step, op.rank, extra={"job": job.job_id})
        rt.notify()
    head = rt.plan.fresh_head()
    if head.world_size != op.world_size:
        raise ScaleInProgress(f"job {job.job_id!r} was reconfigured to {head.world_size} ranks "
                              f"meanwhile, not {op.world_size}")
    return head


def _drain_start(op: pb.Open, rt: JobRuntime, prev: World, head: PlanHead) -> StreamStart:
    if not 0 <= op.rank < prev.world_size:
        raise BadRequest(f"rank {op.rank} is outside [0, {prev.world_size}) for world "
                         f"{prev.generation} of job {rt.job.job_id!r}")
    last = prev.last_steps[op.rank]
    # The ENDs published before its world ended (a later world's END is not its epoch's end).
    ends = [e for e in rt.state.epoch_ends() if e.world.generation <= prev.generation]
    if op.resume_step == RESUME_FROM_CURSOR:
        pos = last + 1  # no state of its own: the world it was in has ended
        epoch = sum(1 for e in ends if e.last_step < pos)
    else:
        pos, epoch = op.resume_step, op.resume_epoch
        if not 0 <= epoch <= rt.job.epochs:
            raise BadRequest(f"resume_epoch {epoch} is outside [0, {rt.job.epochs}]")
        if pos < prev.first_step:
            raise PositionUnavailable(f"resume_step {pos} is before world {prev.generation} of "
                                      f"job {rt.job.job_id!r} (it starts at step "
                                      f"{prev.first_step})")
    return StreamStart(prev.generation, prev.world_size, pos, min(epoch, rt.job.epochs - 1),
                       limit=last, next_world_size=head.world_size)


def _current_start(op: pb.Open, rt: JobRuntime, head: PlanHead) -> StreamStart:
    job = rt.job
    if op.resume_step == RESUME_FROM_CURSOR:
        pos, epoch = rt.resume_position(op.rank, head)
        return StreamStart(head.generation, head.world_size, pos, epoch)
    if not 0 <= op.resume_epoch <= job.epochs:
        raise BadRequest(f"resume_epoch {op.resume_epoch} is outside [0, {job.epochs}]")
    step = _map_position(rt, head, op.resume_step, op.resume_epoch)
    # A step can only have been delivered once published. A position past the plan is one
    # the state lost (a Redis restarted without the last publications): the producer publishes
    # it again, and the stream waits for it; unless no step will ever be published again.
    if step > rt.plan.published_through() + 1:
        through = rt.plan.fresh_published_through()
        if step > through + 1:
            if rt.state.is_done() or rt.error():
                raise beyond_the_plan(job.job_id, step, through)
            return StreamStart(head.generation, head.world_size, step, op.resume_epoch,
                               beyond_plan=True)
    trimmed = rt.state.trimmed_through()
    if step <= trimmed:
        raise PositionUnavailable(
            f"resume_step {step} of job {job.job_id!r} is in an epoch every rank has finished "
            f"(steps through {trimmed} are no longer kept; the plan of the current and the "
            "previous epoch is): resume from a later checkpoint")
    return StreamStart(head.generation, head.world_size, step, op.resume_epoch)
