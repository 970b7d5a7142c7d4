"""Redis coordinator: a job's shared state (plan, cursors, leases, counters) in Redis.

`RedisJobState` implements `pipeline.jobstate.JobState`, so any replica can serve any rank and a
restarted producer continues where the last one stopped. Key schema: docs/redis-schema.md
(keys.py is its code). Imports nothing of the service.
"""

from pipeline.coordinator.operator_view import JobSummary, job_summary, list_jobs
from pipeline.coordinator.redis_job_state import RedisJobState
from pipeline.coordinator.registry import JobRecord

__all__ = ["JobRecord", "JobSummary", "RedisJobState", "job_summary", "list_jobs"]
