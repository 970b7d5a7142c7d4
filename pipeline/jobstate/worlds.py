"""Worlds: the succession of world sizes one job runs with, and where each one ended.

Owns the plain values a reconfiguration (docs/elastic.md) passes across the `JobState` seam and
the one rule that picks a world's end, `choose_boundary`, which `MemoryJobState` runs in Python
and `RedisJobState` mirrors in Lua (the contract tests check that both agree). No I/O.

Vocabulary:
- world generation g: 0 is the world the job registered with; each reconfiguration starts g+1.
  Step numbers stay global and write-once, so world g owns the steps from its `first_step` on.
- boundary: where world g ended. Rank r of world g runs its batches through `last_steps[r]`
  (B = their max for the ranks live at the switch); its batches in steps after that, up to the
  `published_through` of the switch, are *returned*: voided, their samples re-planned for the
  new world, whose first step is `published_through + 1`.
- grant: the highest step a rank's stream may be sent. A replica raises a rank's grant before
  it sends a batch beyond it, so "delivered" is always within the grants and the boundary can be
  chosen, atomically with freezing the grants, without ever voiding a delivered batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from pipeline.planner.types import EpochEnd, WorldStamp


class ScaleReason(str, Enum):  # noqa: UP042 (str mixin: stored and shown as text)
    INITIAL = "initial"  # the world the job registered with
    SCALE = "scale"  # an explicit request (CLI `scale`, gRPC Scale)
    ELASTIC = "elastic"  # an Open with a new world size on an `elastic` job
    SHRINK = "shrink"  # `rank_failure_policy: shrink` after a rank's lease lapsed


@dataclass(frozen=True)
class World:
    """One world of a job. `last_steps` is None while it is the current one."""

    generation: int
    world_size: int
    first_step: int
    reason: ScaleReason = ScaleReason.INITIAL
    requested_at: float = 0.0  # unix s (the state's clock) of the request that began it
    # Filled when the world ends (the boundary):
    last_steps: tuple[int, ...] | None = None  # per rank: its last step in this world
    published_through: int = -1  # the plan at the switch: later batches are the next world's
    live_ranks: tuple[int, ...] = ()  # ranks that drained to `last_step` (held a live lease)
    returned_samples: int = 0  # samples of the returned batches (fillers excluded)
    returned_tokens: int = 0

    @property
    def ended(self) -> bool:
        return self.last_steps is not None

    @property
    def last_step(self) -> int | None:
        """B: the last step any rank of this world runs (None while current)."""
        if self.last_steps is None:
            return None
        return max(self.last_steps, default=self.first_step - 1)

    def returned(self, step: int, rank: int) -> bool:
        """True if rank's batch at `step` (of this world) was voided by the boundary."""
        if self.last_steps is None or not 0 <= rank < len(self.last_steps):
            return False
        return self.last_steps[rank] < step <= self.published_through


@dataclass(frozen=True)
class PlanHead:
    """The published plan's end and the current world, read together (one round trip)."""

    published_through: int
    generation: int
    world_size: int
    first_step: int


@dataclass(frozen=True)
class ScaleRequest:
    """Ask for a new world of `world_size` ranks.

    `position`: a restored trainer state's next step (an elastic Open with a state): every step
    before it counts as consumed by every rank, everything after is returned; None: ranks with a
    live lease drain to B, the others keep what they acknowledged. `require_gone`: refuse while a
    rank of the current world holds a live lease (the implicit, torchrun-style switch).
    `expect_generation`: only reconfigure if that world is still the current one (a replica that
    saw a lapse); otherwise nothing changes."""

    world_size: int
    reason: ScaleReason = ScaleReason.SCALE
    position: int | None = None
    require_gone: bool = False
    expect_generation: int | None = None


@dataclass(frozen=True)
class ScaleResult:
    changed: bool  # False: the world already had this size (or another request came first)
    world: World  # the current world after the request
    previous: World | None = None  # the world that ended (with its boundary) when changed


@dataclass(frozen=True)
class Grant:
    """A replica's grant request's answer. While the rank's world is current, `through` is the
    highest step it may be sent (never past the published plan). Once that world has ended,
    `ended` is set: the rank's stream runs through `through` (its last step) and then gets an
    END whose reason is reconfigure, naming `next_world_size`."""

    through: int
    ended: bool = False
    next_world_size: int = 0


@dataclass(frozen=True)
class WorldTimings:
    """When the phases of the switch into world `generation` happened (unix s, state clock).

    requested -> adopted (the producer published the new world's plan) -> each old rank left
    (its END(reconfigure)) and each new rank got its first batch."""

    generation: int
    requested_at: float
    adopted_at: float | None = None
    first_batch_at: dict[int, float] = field(default_factory=dict)  # new world's ranks
    left_at: dict[int, float] = field(default_factory=dict)  # previous world's ranks

    def first_batch_seconds(self, world_size: int) -> float | None:
        """Request to the first batch at every rank of the new world (None until all had one)."""
        if len(self.first_batch_at) < world_size:
            return None
        return max(self.first_batch_at.values()) - self.requested_at


def world_of_step(worlds: Sequence[World], step: int) -> World:
    """The world that owns `step`: the last one starting at or before it (world g owns the
    steps from its `first_step` on; the batches its boundary returned are still its steps)."""
    return next((w for w in reversed(worlds) if w.first_step <= step), worlds[0])


def stamp_of_step(worlds: Sequence[World], step: int) -> WorldStamp:
    """The world stamp of a step published before stamping (exact: see `world_of_step`)."""
    w = world_of_step(worlds, step)
    return WorldStamp(w.generation, w.world_size)


def stamp_of_end(worlds: Sequence[World], end: EpochEnd) -> WorldStamp:
    """The world stamp of an END published before stamping: the world of its last step (exact:
    a world's END names only steps of that world). An END without any step (every rank got
    none) is given the latest world of its size, as builds before stamping assumed."""
    if end.last_step >= 0:
        return stamp_of_step(worlds, end.last_step)
    n = len(end.final_step)
    w = next((w for w in reversed(worlds) if w.world_size == n), worlds[-1])
    return WorldStamp(w.generation, w.world_size)


def choose_boundary(*, first_step: int, published_through: int, last_end_step: int,
                    grants: Sequence[int], acked: Sequence[int], live: Sequence[bool],
                    position: int | None = None) -> tuple[int, ...]:
    """Each rank's last step in the world that ends (index = rank).

    - With a restored `position`: every rank's last step is `position - 1` (what the trainer's
      checkpoint consumed), within the world's steps, but never before the last step of an
      epoch whose END is published: that epoch is closed (its END was delivered, the planner
      moved on), so its steps after the position stay consumed rather than re-planned into the
      next epoch (a position inside them is then refused: docs/elastic.md).
    - Otherwise a rank with a live lease may have been sent anything up to its grant, so all
      live ranks end at B = the highest grant among them; B is never before the last step of an
      epoch whose END is published (`last_end_step`), so returned batches are all of the
      planner's current epoch and no delivered END is ever taken back. A rank without a live
      lease (gone: lapsed, released or never connected) keeps what it acknowledged.
    Always within [first_step - 1, published_through].
    """
    floor = first_step - 1

    def clamp(n: int) -> int:
        return min(max(n, floor), published_through)

    if position is not None:
        return tuple(clamp(max(position - 1, last_end_step)) for _ in grants)
    b = clamp(max([g for g, ok in zip(grants, live, strict=True) if ok]
                  + [last_end_step, floor]))
    return tuple(b if ok else clamp(a) for a, ok in zip(acked, live, strict=True))
