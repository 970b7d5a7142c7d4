"""Reconfigurations a replica asks for, and how worlds look on the wire (docs/elastic.md).

- `scale`: the authenticated Scale call (an operator, a launcher, a Kubernetes operator):
  validates the size (`BadRequest`), asks the job's state to switch and answers with both
  worlds; the state's refusals (`ScaleRefused`, `StateUnavailable`) reach the caller as they
  are (the gRPC adapter gives each its status code).
- `shrink`: `rank_failure_policy: shrink`: once ranks of the current world have been gone
  longer than the timeout, the state switches to a world of the live ranks (one replica wins,
  the others find the world already changed).
- `world_message`: a `World` and the timings of the switch into it as the wire's `World`.
The state does the switch atomically; nothing here holds state of its own.
"""

from __future__ import annotations

import logging

from pipeline.errors import BadRequest, JobFinished, PlanningComplete, ScaleInProgress
from pipeline.jobstate.worlds import ScaleReason, ScaleRequest, ScaleResult, World, WorldTimings
from pipeline.service.job_runtime import JobRuntime
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

log = logging.getLogger(__name__)


def world_message(w: World, timings: WorldTimings | None) -> pb.World:
    out = pb.World(generation=w.generation, world_size=w.world_size, first_step=w.first_step,
                   last_step=-1 if w.last_step is None else w.last_step,
                   rank_last_steps=list(w.last_steps or ()), reason=w.reason.value,
                   requested_at=w.requested_at, returned_samples=w.returned_samples,
                   adopted_seconds=-1.0, first_batch_seconds=-1.0)
    if timings is not None:
        if timings.adopted_at is not None:
            out.adopted_seconds = timings.adopted_at - timings.requested_at
        first = timings.first_batch_seconds(w.world_size)
        if first is not None:
            out.first_batch_seconds = first
    return out


def refuse_finished(rt: JobRuntime) -> None:
    """`JobFinished` once every rank of the job's world acknowledged its last step: a finished
    job's world stays the one it ran (a reconfiguration would reopen it with nothing to do)."""
    st = rt.state
    ends = st.epoch_ends() if st.is_done() else []
    if not ends:
        return
    finals = [-1 if s is None else s for s in ends[-1].final_step]
    if all(a >= f for a, f in zip(st.acked_all(), finals, strict=False)):
        raise JobFinished(f"job {rt.job.job_id!r} has finished (every rank acknowledged its "
                          "last step): its world is not changed; a new run needs a new job_id, "
                          f"or `odb-pipeline job reset {rt.job.job_id}` to start this one over")


def scale(rt: JobRuntime, world_size: int) -> ScaleResult:
    job = rt.job
    if not 1 <= world_size <= job.world_size_cap():
        raise BadRequest(f"world_size must be in [1, {job.world_size_cap()}] for job "
                         f"{job.job_id!r} (its max_world_size), got {world_size}")
    refuse_finished(rt)
    res = rt.state.scale(ScaleRequest(world_size, ScaleReason.SCALE))
    if res.changed:
        log.info("job %s: reconfiguration %d -> %d ranks: the old world runs through step %d, "
                 "the new one starts at step %d (%d samples re-planned)", job.job_id,
                 res.previous.world_size, world_size, res.previous.last_step,
                 res.world.first_step, res.previous.returned_samples,
                 extra={"job": job.job_id})
        rt.notify()
    return res


def scale_reply(rt: JobRuntime, res: ScaleResult) -> pb.ScaleReply:
    st = rt.state
    out = pb.ScaleReply(job_id=rt.job.job_id, changed=res.changed,
                        world=world_message(res.world, st.world_timings(res.world.generation)))
    if res.previous is not None:
        out.previous.CopyFrom(world_message(res.previous,
                                            st.world_timings(res.previous.generation)))
    return out


def shrink(rt: JobRuntime, timeout_seconds: float) -> str | None:
    """Switch to a world of the live ranks; None when done (or already done by another replica,
    or pending, or nobody is gone any more), else why it cannot (the caller fails the ranks).

    The lapses are read again here, after the head: a cached view could be of the world a
    previous shrink already ended (its gone ranks' leases are dropped with it)."""
    head = rt.plan.fresh_head()
    dead = {r: t for r, t in rt.state.timed_out_ranks(timeout_seconds).items()
            if r < head.world_size}
    if not dead:
        return None
    try:
        refuse_finished(rt)  # (its ranks are done, not dead)
    except JobFinished:
        return None
    # The new world is the ranks live now (a lease held and not lapsed), which the boundary
    # lets drain; the timed-out ones and any other without a live lease keep what they acked.
    live = sum(1 for h in rt.state.rank_health() if h.client_id is not None and not h.lapsed)
    if live < 1:
        return "no rank of the world is live: nothing to shrink to"
    try:
        res = rt.state.scale(ScaleRequest(live, ScaleReason.SHRINK,
                                          expect_generation=head.generation))
    except ScaleInProgress:
        return None  # the previous switch completes first; the lapse is still there after it
    except PlanningComplete as exc:
        return f"{exc}: rank_failure_policy=shrink cannot move it onto the live ranks"
    if res.changed:
        log.warning("job %s: ranks %s gone longer than the timeout; rank_failure_policy=shrink: "
                    "%d -> %d ranks, the live ranks run through step %d", rt.job.job_id,
                    sorted(dead), head.world_size, live, res.previous.last_step,
                    extra={"job": rt.job.job_id})
        rt.notify()
    return None
