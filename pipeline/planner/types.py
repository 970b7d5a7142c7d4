"""Plain data classes the planner consumes and produces.

These are the vocabulary of DESIGN.md (sample, batch, step, plan) as values: no I/O, no Ray, no
gRPC. Every other part of the service (preprocessing, gRPC data plane, Redis coordinator) speaks
in these types, so field names here are a contract; add fields, do not rename them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from pipeline.quarantine import QuarantineReason

if TYPE_CHECKING:
    from pipeline.planner.compute_fit import ComputeModel

# Opaque and hashable. The service uses "<source>:<row>" strings; the `plan` CLI uses the
# line number of a lengths file (int) or whatever the JSONL file names.
SampleId = int | str


class Collate(str, Enum):  # noqa: UP042 (str mixin kept: a contract)
    PADDED = "padded"  # cost = len(batch) * max_len(batch)
    PACKED = "packed"  # cost = sum(len)


@dataclass(frozen=True, slots=True)
class MeasuredSample:
    """What the planner knows of a sample: its id and its true, post-preprocessing size."""

    sample_id: SampleId
    num_tokens: int
    num_visual_tokens: int = 0
    # Tokens that carry a label (count toward the loss) under the job's collate. Carried so a
    # step's all-rank loss-token total is known from metadata alone (Guarantee 6): whoever sends
    # one rank its batch never needs the other ranks' payloads.
    loss_tokens: int = 0
    # The mixture source it comes from (its index in `source.mixture`; 0 without a mixture):
    # what the planner keeps each source's share by (source_shares.py).
    source: int = 0


@dataclass(frozen=True, slots=True)
class Batch:
    """The samples one rank runs at one step."""

    rank: int
    samples: tuple[MeasuredSample, ...]
    cost: int
    # Set when the batch exists only because of the over-budget policy (`alone`/`truncate`).
    over_budget: bool = False
    # For `truncate`: sample_id -> tokens kept (the payload must be cut to this length).
    truncated_to: dict[SampleId, int] = field(default_factory=dict)
    # A copy of a real sample of the step, sent so that a rank without a sample of its own
    # still runs the step (quota mode's closing step; a global step with fewer samples than
    # ranks). Trained with zero loss weight, never counted as coverage, not in StepInfo.
    filler: bool = False
    # Global steps (`BatchingPolicy.global_token_budget`): the index of this micro-batch among
    # its rank's micro-batches of the step (0 otherwise: one batch per rank and step).
    micro: int = 0

    @property
    def sample_ids(self) -> tuple[SampleId, ...]:
        return tuple(s.sample_id for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(self.truncated_to.get(s.sample_id, s.num_tokens) for s in self.samples)

    @property
    def loss_tokens(self) -> int:
        """Loss tokens of the batch. A truncated sample counts at most its kept length: exact
        when preprocessing already cut it (the service), an upper bound for lengths-only plans.
        A filler has none: its loss weight is zero."""
        if self.filler:
            return 0
        return sum(min(s.loss_tokens, self.truncated_to.get(s.sample_id, s.num_tokens))
                   for s in self.samples)


@dataclass(frozen=True, slots=True)
class PendingBatch:
    """A formed batch not yet placed in a step (no rank yet): what the planner pools, what a
    global step is made of, what its checkpoint holds."""

    samples: tuple[MeasuredSample, ...]
    over_budget: bool = False
    truncated_to: tuple[tuple[SampleId, int], ...] = ()

    def lengths(self) -> list[int]:
        """Each sample's tokens as it will run (a truncated sample at its kept length)."""
        if self.truncated_to:
            cut = dict(self.truncated_to)
            return [cut.get(s.sample_id, s.num_tokens) for s in self.samples]
        return [s.num_tokens for s in self.samples]


@dataclass(frozen=True, slots=True)
class StepInfo:
    """All-rank totals of one step, carried on every batch for exact loss scaling (Guarantee 6):
    for a global step, of the whole step (every rank, every micro-batch).

    Real samples only: filler batches add nothing.
    `optimizer_step`: global steps only (None otherwise): the step's ordinal among the job's
    trained steps, voided steps excluded, so the same at any world size and across
    reconfigurations (a voided step comes back with its number).
    """

    step_samples: int
    step_tokens: int
    step_loss_tokens: int = 0
    optimizer_step: int | None = None


@dataclass(frozen=True, slots=True)
class WorldStamp:
    """The world a step or an epoch END was planned for (docs/elastic.md): its generation (0 is
    the world the job registered with; each reconfiguration starts the next) and its number of
    ranks. The planner stamps what it emits; `size == 0` means "not stamped" (a record a build
    before stamping published: the job's state derives its stamp when it reads it)."""

    generation: int = 0
    size: int = 0

    @property
    def stamped(self) -> bool:
        return self.size > 0


@dataclass(frozen=True, slots=True)
class Step:
    """The batches that run together. Once published it never changes.

    Without a global token budget a rank has at most one batch per step. A global step holds
    one batch per (rank, micro-batch) and every rank of its world has at least one: a rank
    accumulates its micro-batches (`micros_for`) into one optimizer step. `batches` is sorted
    by (rank, micro).

    `step` is global and monotonic across the job's epochs (epoch e+1 starts after every rank's
    last step of epoch e), so a single integer identifies a resume point.
    A rank that has no batch at a step (join mode, after its final step) is absent from `batches`.
    `world`: the world whose ranks run it (its size is the batches' `world_size` on the wire).
    `compute`: the fitted compute model its batches were balanced by (None: by tokens), recorded
    so a replayed step is explained by its record alone.
    """

    epoch: int
    step: int
    batches: tuple[Batch, ...]
    info: StepInfo
    world: WorldStamp = WorldStamp()
    compute: ComputeModel | None = None

    def batch_for(self, rank: int) -> Batch | None:
        """The rank's (first) batch; None if it has none."""
        for b in self.batches:
            if b.rank == rank:
                return b
        return None

    def micros_for(self, rank: int) -> tuple[Batch, ...]:
        """The rank's batches in micro-batch order (one without global steps; () if none)."""
        return tuple(b for b in self.batches if b.rank == rank)

    def ranks(self) -> list[int]:
        """The ranks with a batch in this step, ascending, each once."""
        return sorted({b.rank for b in self.batches})

    def rank_samples(self, rank: int) -> tuple[MeasuredSample, ...]:
        """The rank's samples over all its micro-batches, in order: what its payloads hold."""
        return tuple(s for b in self.micros_for(rank) for s in b.samples)


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A sample the planner set aside, with its reason (a label) and a sentence for people."""

    sample: MeasuredSample
    reason: QuarantineReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class EpochEnd:
    """Closes an epoch. `final_step[r]` is rank r's last step in this epoch (None: it got none).

    In quota mode every rank has the same final step and `carried_over` holds the samples that
    could not fill the last aligned step; they open the next epoch. The job's last epoch carries
    nothing: its remainder forms one closing step, with filler batches for the ranks it cannot
    give a sample (`StepPlanner.end_epoch(last_epoch=True)`).
    `world`: the world in which the epoch ended (`final_step` names its ranks); an epoch that
    spans a reconfiguration ends in the later world.
    """

    epoch: int
    final_step: tuple[int | None, ...]
    steps: int
    carried_over: tuple[MeasuredSample, ...] = ()
    world: WorldStamp = WorldStamp()

    @property
    def last_step(self) -> int:
        """The epoch's last step on any rank (-1 if it had none)."""
        return max((s for s in self.final_step if s is not None), default=-1)

    def final_for(self, rank: int) -> int | None:
        """Rank's last step of the epoch; None if it had none (or is not a rank of this END's
        world: a rank of a later, larger world)."""
        return self.final_step[rank] if 0 <= rank < len(self.final_step) else None


PlanEvent = Step | Quarantined | EpochEnd
