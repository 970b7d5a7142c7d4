"""What the one-shot CLI commands (`inspect`, `plan --data`) share to run the real preprocessing.

`PrivateRay`: a local Ray for this command only (an already initialized Ray is reused and left
running). `job_config`: the JobConfig of `--config FILE [--job ID]` (or defaults) with the
sources replaced by the command's data and optional overrides (explicit CLI flags) on top.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from pipeline.config import ConfigError, JobConfig, _deep_merge, read_config_file
from pipeline.errors import UserError


class PrivateRay:
    """A local Ray for this command only (reuses one that is already initialized)."""

    def __init__(self, prefix: str = "odb-cli-ray-") -> None:
        self.prefix = prefix
        self.owned = False
        self.tmp: str | None = None

    def __enter__(self) -> PrivateRay:
        import ray

        self.owned = not ray.is_initialized()
        if self.owned:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            os.environ.setdefault("RAY_worker_niceness", "0")
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            self.tmp = tempfile.mkdtemp(prefix=self.prefix, dir="/tmp")
            ray.init(include_dashboard=False, _temp_dir=self.tmp, log_to_driver=False,
                     configure_logging=False, object_store_memory=256 * 1024 * 1024)
            # Ray Data's per-dataset INFO/WARNING chatter ("execution finished", "progress bars
            # disabled") is noise in a one-shot command's output.
            import ray.data  # configures its loggers on import: set the level after

            logging.getLogger("ray.data").setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            import ray

            ray.shutdown()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)


def job_config(config: str | None, job_id: str | None, paths: list[str] | None, *,
               default_job_id: str, overrides: Mapping[str, Any] | None = None) -> JobConfig:
    """The job to preprocess with: `config` is a service config (the job `job_id`, else its
    first job) or a single job mapping; None = all defaults (world_size 1). `paths` replace the
    job's sources (None keeps the config's, or a placeholder when it has none); `overrides`
    (a partial job mapping, e.g. {"batching": {"token_budget": 4096}}) are merged on top."""
    from pydantic import ValidationError

    base: dict[str, Any] = {}
    if config:
        raw = read_config_file(config)
        if "jobs" in raw:
            jobs = raw.get("jobs") or []
            chosen = next((j for j in jobs if j.get("job_id") == job_id), None) if job_id \
                else (jobs[0] if jobs else None)
            if job_id and chosen is None:
                raise ConfigError(f"--job {job_id}: no such job in {config}")
            base = dict(chosen or {})
        else:
            base = dict(raw)
    elif job_id:
        raise UserError("--job needs --config")
    source = dict(base.get("source") or {})
    if paths is not None:
        source["paths"] = list(paths)
    elif not source.get("paths"):
        source["paths"] = ["<none>"]
    job = {**base, "job_id": base.get("job_id", default_job_id),
           "world_size": base.get("world_size", 1), "source": source}
    job = _deep_merge(job, overrides or {})
    try:
        return JobConfig.model_validate(job)
    except ValidationError as exc:
        from pipeline.config import _format_validation_error

        raise ConfigError(_format_validation_error(exc)) from None
