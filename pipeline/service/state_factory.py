"""The one place that decides where a job's state lives."""

from __future__ import annotations

from pipeline.config import ServiceConfig, TrainingJobConfig
from pipeline.jobstate.interface import JobState
from pipeline.jobstate.memory import MemoryJobState


def make_job_state(config: ServiceConfig, job: TrainingJobConfig) -> JobState:
    """Redis (shared, survives restarts) when a URL is configured; process memory otherwise."""
    if config.redis_url:
        from pipeline.coordinator import RedisJobState

        return RedisJobState.connect(config.redis_url, job, fsync_publish=config.fsync_publish)
    return MemoryJobState(job.job_id, job.world_size, job.mode)
