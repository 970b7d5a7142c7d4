"""Redis coordinator: a job's shared state (plan, cursors, leases, counters) in Redis.

`RedisJobState` implements `pipeline.service.job_state.JobState`, so any gRPC server replica can
serve any rank and a restarted server continues where the last one stopped. Key schema:
docs/redis-schema.md (keys.py is its code).
"""

from pipeline.coordinator.errors import (
    AckAheadOfPlan,
    CheckpointConflict,
    DurabilityUnavailable,
    JobMismatch,
    SchemaMismatch,
    StepGap,
)
from pipeline.coordinator.operator_view import JobSummary, job_summary, list_jobs
from pipeline.coordinator.redis_job_state import RankHealth, RedisJobState
from pipeline.coordinator.registry import JobRecord

__all__ = [
    "AckAheadOfPlan",
    "CheckpointConflict",
    "DurabilityUnavailable",
    "JobMismatch",
    "JobRecord",
    "JobSummary",
    "RankHealth",
    "RedisJobState",
    "SchemaMismatch",
    "StepGap",
    "job_summary",
    "list_jobs",
]
