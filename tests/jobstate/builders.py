"""Plain values the job-state tests publish: steps whose content is a function of a salt, and
publications around them (one place, shared by tests/jobstate and tests/coordinator). Steps and
ENDs carry their world (`WorldStamp`), as the planner stamps them."""

from __future__ import annotations

from dataclasses import replace

from pipeline.jobstate import PlannerCheckpoint, Publication, QuarantineEntry
from pipeline.planner.types import Batch, EpochEnd, MeasuredSample, Step, StepInfo, WorldStamp


def make_step(n: int, world_size: int = 4, *, epoch: int = 0, salt: str = "",
              per_rank: int = 2, ranks: list[int] | None = None, generation: int = 0) -> Step:
    """A step whose sample ids are unique per (n, rank, salt): another salt, another plan; of
    world `generation` of `world_size` ranks."""
    batches = []
    for r in ranks if ranks is not None else range(world_size):
        samples = tuple(MeasuredSample(f"src{salt}:{n}:{r}:{i}", 10 + i + r) for i in
                        range(per_rank))
        batches.append(Batch(r, samples, cost=sum(s.num_tokens for s in samples)))
    return Step(epoch, n, tuple(batches), StepInfo(sum(len(b.samples) for b in batches),
                                                   sum(b.cost for b in batches)),
                WorldStamp(generation, world_size))


def make_global_step(n: int, micros: tuple[int, ...], *, epoch: int = 0, salt: str = "",
                     optimizer_step: int | None = None, generation: int = 0,
                     truncated: bool = False) -> Step:
    """A global step (docs/global-steps.md): rank r runs `micros[r]` micro-batches of two
    samples each (with `truncated`, the first sample of each micro-batch cut to 5 tokens)."""
    batches = []
    for r, count in enumerate(micros):
        for m in range(count):
            samples = tuple(MeasuredSample(f"g{salt}:{n}:{r}:{m}:{i}", 10 + i + m, 0, 3 + i)
                            for i in range(2))
            cut = {samples[0].sample_id: 5} if truncated else {}
            batches.append(Batch(r, samples, cost=2 * samples[-1].num_tokens,
                                 truncated_to=cut, micro=m))
    real = [b for b in batches if not b.filler]
    return Step(epoch, n, tuple(batches),
                StepInfo(sum(len(b.samples) for b in real), sum(b.num_tokens for b in real),
                         sum(b.loss_tokens for b in real),
                         n if optimizer_step is None else optimizer_step),
                WorldStamp(generation, len(micros)))


def make_end(epoch: int, final_step: tuple[int | None, ...], steps: int,
             carried_over: tuple[MeasuredSample, ...] = (), *, generation: int = 0) -> EpochEnd:
    """An epoch END of world `generation`, whose ranks are those `final_step` names."""
    return EpochEnd(epoch, final_step, steps, carried_over,
                    WorldStamp(generation, len(final_step)))


def steps(first: int, last: int, world_size: int = 4, **kw) -> tuple[Step, ...]:
    """Steps first..last (inclusive) built by `make_step`."""
    return tuple(make_step(n, world_size, **kw) for n in range(first, last + 1))


def publication(step_list: tuple[Step, ...] | list[Step] = (), *, epoch: int = 0,
                rows: int | None = None, next_step: int | None = None,
                ends: tuple[EpochEnd, ...] = (), samples_in: int = 0,
                quarantined: tuple[QuarantineEntry, ...] = (), done: bool = False,
                state: bytes = b"", world: int = 0) -> Publication:
    """A publication whose checkpoint defaults to "just after the last of these steps" (the
    input position `rows` defaults to that step number + 1, so later publications move on).
    Steps and ENDs are stamped for world `world`, as a producer planning for it stamps them (an
    END built without a world: with as many ranks as it names)."""
    step_list = tuple(replace(s, world=WorldStamp(world, s.world.size)) for s in step_list)
    ends = tuple(replace(e, world=WorldStamp(world, e.world.size or len(e.final_step)))
                 for e in ends)
    if next_step is None:
        next_step = step_list[-1].step + 1 if step_list else 0
    if rows is None:
        rows = next_step
    return Publication(checkpoint=PlannerCheckpoint(epoch, rows, next_step, state, world),
                       steps=step_list, ends=tuple(ends), samples_in=samples_in,
                       quarantined=tuple(quarantined), done=done)
