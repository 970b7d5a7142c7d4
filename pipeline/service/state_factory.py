"""The one place that decides where a job's state lives (the lead wires RedisJobState here)."""

from __future__ import annotations

import importlib.util

from pipeline.config import JobConfig, ServiceConfig
from pipeline.service.job_state import JobState
from pipeline.service.memory_state import MemoryJobState


def make_job_state(config: ServiceConfig, job: JobConfig) -> JobState:
    """Redis when a URL is configured and the coordinator package exists; memory otherwise."""
    if config.redis_url and importlib.util.find_spec("pipeline.coordinator") is not None:
        try:
            from pipeline.coordinator import RedisJobState  # type: ignore[attr-defined]
        except ImportError:
            pass
        else:
            return RedisJobState.connect(config.redis_url, job)  # type: ignore[no-any-return]
    return MemoryJobState(job.job_id)
