"""The seam between the data plane and where a job's shared state lives.

`MemoryJobState` (pipeline/service/memory_state.py) keeps it in-process; `RedisJobState`
(pipeline/coordinator/) keeps it in Redis so any server replica can serve any rank and a restarted
server continues. Both implement this protocol; the gRPC server only talks to the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipeline.planner.types import EpochEnd, Step


class StepConflict(RuntimeError):
    """A step number was published twice with different content (must never happen)."""


class RankHeld(RuntimeError):
    """Another live client holds this rank's lease."""


@dataclass(frozen=True)
class RankLease:
    rank: int
    client_id: str
    expires_at: float  # unix seconds


@dataclass(frozen=True)
class PlannerCheckpoint:
    """Enough to restart planning where it stopped: input position and what is published."""

    epoch: int
    samples_consumed: int  # input rows of `epoch` already fed to the planner
    next_step: int  # the next step number the planner will publish
    state: bytes = b""  # opaque planner state (e.g. buffered + carried sample ids), JSON


class JobState(Protocol):
    job_id: str

    # --- the plan: write-once steps ---
    def publish_step(self, step: Step) -> None:
        """Store step before any rank sees it; identical republish is a no-op, else StepConflict."""

    def get_step(self, step: int) -> Step | None: ...

    def published_through(self) -> int:
        """Highest published step number, -1 if none."""

    def publish_epoch_end(self, end: EpochEnd) -> None: ...

    def epoch_ends(self) -> list[EpochEnd]: ...

    def mark_done(self) -> None:
        """All epochs planned: no more steps will ever be published."""

    def is_done(self) -> bool: ...

    # --- planner position, saved atomically with the steps it produced ---
    def save_checkpoint(self, checkpoint: PlannerCheckpoint) -> None: ...

    def load_checkpoint(self) -> PlannerCheckpoint | None: ...

    # --- ranks: leases, cursors ---
    def claim_rank(self, rank: int, client_id: str, lease_seconds: float) -> RankLease:
        """Take or renew the rank's lease; RankHeld if another client's lease is live."""

    def release_rank(self, rank: int, client_id: str) -> None: ...

    def heartbeat(self, rank: int, client_id: str, lease_seconds: float) -> None: ...

    def lapsed_ranks(self) -> list[int]:
        """Ranks that had a lease which expired without release (reported, see Guarantee 4)."""

    def ack(self, rank: int, step: int) -> None:
        """Rank consumed everything through `step` (monotonic; lower values ignored)."""

    def acked(self, rank: int) -> int:
        """Last step acknowledged by rank, -1 if none."""
