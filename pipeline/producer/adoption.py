"""How a producer moves its plan onto a new world (a reconfiguration, docs/elastic.md).

The state's checkpoint names the world its planner state was planned for. When a boundary
ended that world, the producer restores the planner from the checkpoint (which covers every
published step) and hands it back the batches the boundary returned, for the next world's size
and first step (`StepPlanner.reconfigure`); it then publishes at once for the new world, which
adopts it. A fully planned job's boundary may reopen its last epoch: the planner goes back into
it (`StepPlanner.reopen_epoch`) first, and the producer closes it again for the new world.
Deterministic: the same checkpoint and boundary give the same plan, so a producer that dies
half-way and its successor adopt identically.

Global steps (docs/global-steps.md) come back whole: a step is one optimizer step of every rank
(the all-reduce of each rank's last micro-batch needs them all), so a step that any rank did
not run (after that rank's last step) is voided for all of them and re-emitted as the same
global step for the new world (`voided_steps`).

Reads the state (the world records, the returned steps); never writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.jobstate.interface import JobState
from pipeline.jobstate.worlds import World
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Batch, PlanEvent, Step


def returned_batches(state: JobState, world: World) -> list[Batch]:
    """The batches `world`'s boundary voided (after each rank's last step, up to the plan at
    the switch), in (step, rank) order."""
    return [b for step in voided_steps(state, world)
            for b in sorted(step.batches, key=lambda b: b.rank)
            if world.returned(step.step, b.rank)]


def voided_steps(state: JobState, world: World) -> list[Step]:
    """The published steps of `world` that some rank did not run (after the lowest rank's last
    step, up to the plan at the switch), whole, in step order: a global step is handed back
    whole; of a per-rank step only the returned batches (`returned_batches`)."""
    if world.last_steps is None:
        return []
    out: list[Step] = []
    first = min(world.last_steps, default=world.published_through) + 1
    for n in range(first, world.published_through + 1):
        step = state.get_step(n)
        if step is None:
            raise LookupError(f"step {n}, voided by the end of world {world.generation}, is "
                              "not in the state any more")
        out.append(step)
    return out


def adopt(planner: StepPlanner, planned_for: int, worlds: Sequence[World], state: JobState,
          pool_steps: int | None, epochs: int) -> list[PlanEvent]:
    """Move `planner`, restored for world `planned_for`, onto the current (last) world through
    every boundary since; returns the steps it can emit at once. A planner that had ended the
    job's last epoch (of `epochs`) goes back into it: a boundary reopened the fully planned job
    (voiding that epoch's END), and the epoch's rest is re-planned for the new world."""
    if planner.epoch >= epochs > 0:
        planner.reopen_epoch()
    events: list[PlanEvent] = []
    whole = planner.policy.global_steps
    for old, new in zip(worlds[planned_for:-1], worlds[planned_for + 1:], strict=True):
        events += planner.reconfigure(
            new.world_size, [] if whole else returned_batches(state, old),
            first_step=new.first_step, pool_steps=pool_steps,
            voided=voided_steps(state, old) if whole else ())
    return events
