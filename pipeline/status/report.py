"""What `odb-pipeline status` prints: every job's merged `JobStatus` and where the answers came
from, as JSON (`to_dict`) or text (`text.py`); with --watch each report after the first has
its rates over the interval since the one before."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeline.observability.job_status import JobStatus
from pipeline.observability.status_json import job_to_dict
from pipeline.status.merge import with_interval_rates


@dataclass(frozen=True)
class StatusReport:
    generated_at: float
    sources: dict[str, Any]  # `Sources.describe()`
    jobs: tuple[JobStatus, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"generated_at": self.generated_at, "sources": self.sources,
                "jobs": [job_to_dict(j) for j in self.jobs]}

    def shown(self, before: StatusReport | None, *, records: bool) -> StatusReport:
        """This report as printed: rates over the interval since `before` where both know the
        counts; quarantine records only when asked for (--quarantine)."""
        prev = {j.job_id: j for j in before.jobs} if before else {}
        window = self.generated_at - before.generated_at if before else 0.0
        jobs = []
        for job in self.jobs:
            job = with_interval_rates(job, prev.get(job.job_id), window)
            if not records and job.quarantine is not None:
                job = replace(job, quarantine=replace(job.quarantine, records=None))
            jobs.append(job)
        return replace(self, jobs=tuple(jobs))
