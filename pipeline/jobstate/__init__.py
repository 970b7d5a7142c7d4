"""The seam between producer, replicas and where a job's shared state lives (interface.py)."""

from pipeline.jobstate.interface import (
    JobCounters,
    JobState,
    PlannerCheckpoint,
    ProducerLease,
    Publication,
    QuarantineEntry,
    RankHealth,
    RankLease,
)
from pipeline.jobstate.memory import MemoryJobState

__all__ = ["JobCounters", "JobState", "MemoryJobState", "PlannerCheckpoint", "ProducerLease",
           "Publication", "QuarantineEntry", "RankHealth", "RankLease"]
