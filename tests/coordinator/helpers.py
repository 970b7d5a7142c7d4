"""Builders shared by the coordinator tests."""

from __future__ import annotations

from pipeline.planner.types import Batch, MeasuredSample, Step, StepInfo


def make_step(n: int, world_size: int = 4, *, epoch: int = 0, salt: str = "",
              per_rank: int = 2, ranks: list[int] | None = None) -> Step:
    """A step whose sample ids are unique per (n, rank, salt): different salt, different plan."""
    batches = []
    for r in ranks if ranks is not None else range(world_size):
        samples = tuple(MeasuredSample(f"src{salt}:{n}:{r}:{i}", 10 + i + r) for i in
                        range(per_rank))
        batches.append(Batch(r, samples, cost=sum(s.num_tokens for s in samples)))
    return Step(epoch, n, tuple(batches), StepInfo(sum(len(b.samples) for b in batches),
                                                   sum(b.cost for b in batches)))
