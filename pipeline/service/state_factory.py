"""The one place that decides where a job's state lives."""

from __future__ import annotations

import logging

from pipeline.config import ServiceConfig, TrainingJobConfig
from pipeline.jobstate.interface import JobState
from pipeline.jobstate.memory import MemoryJobState

log = logging.getLogger(__name__)


def make_job_state(config: ServiceConfig, job: TrainingJobConfig
                   ) -> tuple[JobState, TrainingJobConfig]:
    """Redis (shared, survives restarts) when a URL is configured; process memory otherwise.
    With it, the job as it is served: a job an earlier build registered before `source.shuffle`
    existed keeps reading its files in order (its plan was made so)."""
    if config.redis_url:
        from pipeline.coordinator import RedisJobState
        from pipeline.coordinator.registry import in_file_order

        state = RedisJobState.connect(config.redis_url, job, fsync_publish=config.fsync_publish)
        if state.registered_in_file_order:
            log.warning("job %s was registered by an earlier build that read its files in "
                        "order: it keeps that order (source.shuffle applies to new jobs)",
                        job.job_id, extra={"job": job.job_id})
            job = in_file_order(job)
        return state, job
    return MemoryJobState(job.job_id, job.world_size, job.mode), job
