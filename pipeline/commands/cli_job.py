"""The job the one-shot CLI commands (`inspect`, `plan --data`) preprocess with: the job config
(training or refill) of `--config FILE [--job ID]` (or defaults) with the sources replaced by
the command's data and optional overrides (explicit CLI flags) on top; and their progress lines
(on stderr: stdout keeps what `--json` prints).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from pipeline.config import ConfigError, JobConfig, deep_merge, parse_job, read_config_file
from pipeline.errors import UserError
from pipeline.modes import JobMode


def progress(command: str, text: str) -> None:
    """One progress line of a one-shot command (Ray's start and preprocessing take seconds)."""
    print(f"odb-pipeline {command}: {text}", file=sys.stderr, flush=True)


def job_config(config: str | None, job_id: str | None, paths: list[str] | None, *,
               default_job_id: str, overrides: Mapping[str, Any] | None = None,
               names: Mapping[tuple[str, ...], str] | None = None) -> JobConfig:
    """The job to preprocess with: `config` is a service config (the job `job_id`, else its
    first job) or a single job mapping; None = all defaults (world_size 1). `paths` replace the
    job's sources (None keeps the config's, or a placeholder when it has none); `overrides`
    (a partial job mapping, e.g. {"batching": {"token_budget": 4096}}) are merged on top;
    `names`: what a validation error calls a field (the flag that set it)."""
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
    if paths is not None:  # the command's data is the job's one source
        for name in ("mixture", "schedule", "mix_by", "epoch_samples"):
            source.pop(name, None)
        source["paths"] = list(paths)
    elif not source.get("paths") and not source.get("mixture"):
        source["paths"] = ["<none>"]
    job = {**base, "job_id": base.get("job_id", default_job_id), "source": source}
    if base.get("mode") != JobMode.REFILL:  # a training job: one rank unless it says
        job["world_size"] = base.get("world_size", 1)
    return parse_job(deep_merge(job, overrides or {}), names=names)
