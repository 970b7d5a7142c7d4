"""One `JobStatus` out of several answers for the same job, and rates between two reports.

The answers come from different sources, maybe from different replicas (GetJob from the one
the gRPC target picked, `/status.json` from the metrics port's, Redis from none): each knows
some fields and leaves the others None. `merge` takes each field from the first answer that
knows it, in the caller's order of authority (GetJob, then the metrics port, then Redis); nested
parts (a rank, the quarantine, a refill job's counts) merge the same way, ranks by rank id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pipeline.observability.job_status import (
    JobStatus,
    RankStatus,
    RefillRates,
    Throughput,
    Totals,
)


def merge(parts: Sequence[JobStatus]) -> JobStatus:
    """`parts` of one job, most authoritative first."""
    return _merge(list(parts))


def _merge(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    if not known:
        return None
    first = known[0]
    if not dataclasses.is_dataclass(first) or any(type(v) is not type(first) for v in known):
        return first
    return dataclasses.replace(first, **{
        f.name: (_ranks if f.name == "ranks" else _merge)([getattr(v, f.name) for v in known])
        for f in dataclasses.fields(first)})


def _ranks(values: list[tuple[RankStatus, ...] | None]) -> tuple[RankStatus, ...] | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    ids = sorted({r.rank for ranks in known for r in ranks})
    by_rank = [{r.rank: r for r in ranks} for ranks in known]
    return tuple(_merge([b.get(i) for b in by_rank]) for i in ids)


def with_interval_rates(now: JobStatus, before: JobStatus | None, window_s: float) -> JobStatus:
    """`now` with its rates over the `window_s` seconds since `before` (a refresh of
    `status --watch`), where both know the counts; else `now` as it is."""
    if before is None:
        return now
    w = max(window_s, 1e-9)
    if now.totals is not None and before.totals is not None:
        a, b = now.totals, before.totals
        steps = (_last_acked(now) - _last_acked(before)) / w
        return dataclasses.replace(now, throughput=Throughput(
            "interval", window_s, _per_s(a, b, "samples_emitted", w),
            _per_s(a, b, "tokens_emitted", w), _per_s(a, b, "batches_emitted", w), steps))
    if now.refill is not None and before.refill is not None:
        rates = RefillRates("interval", window_s,
                            (now.refill.admitted - before.refill.admitted) / w,
                            (now.refill.completed - before.refill.completed) / w)
        return dataclasses.replace(now, refill=dataclasses.replace(now.refill, rates=rates))
    return now


def _per_s(a: Totals, b: Totals, name: str, window_s: float) -> float:
    return (getattr(a, name) - getattr(b, name)) / window_s


def _last_acked(job: JobStatus) -> int:
    return max((r.acked_step for r in job.ranks or ()), default=-1)
