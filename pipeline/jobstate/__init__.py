"""The seam between producer, replicas and where a job's shared state lives: the `JobState`
contract and the values that cross it (interface.py), a job's succession of worlds (worlds.py),
and the contract kept in process memory (memory.py; in Redis: `pipeline.coordinator`)."""

from pipeline.jobstate.interface import (
    ComputeFitStatus,
    JobCounters,
    JobState,
    MixRequest,
    PlannerCheckpoint,
    ProducerFailure,
    ProducerLease,
    Publication,
    QuarantineEntry,
    RankAck,
    RankCompute,
    RankHealth,
    RankLease,
    SourceShare,
    SourceStatus,
)
from pipeline.jobstate.memory import MemoryJobState
from pipeline.jobstate.worlds import (
    Grant,
    PlanHead,
    ScaleReason,
    ScaleRequest,
    ScaleResult,
    World,
    WorldTimings,
)

__all__ = [
    "ComputeFitStatus",
    "Grant",
    "JobCounters",
    "JobState",
    "MemoryJobState",
    "MixRequest",
    "PlanHead",
    "PlannerCheckpoint",
    "ProducerFailure",
    "ProducerLease",
    "Publication",
    "QuarantineEntry",
    "RankAck",
    "RankCompute",
    "RankHealth",
    "RankLease",
    "ScaleReason",
    "ScaleRequest",
    "ScaleResult",
    "SourceShare",
    "SourceStatus",
    "World",
    "WorldTimings",
]
