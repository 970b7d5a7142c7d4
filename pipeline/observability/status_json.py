"""`JobStatus` as JSON (`/status.json`, `odb-pipeline status --json`) and back (the status
client reads a replica's `/status.json` into the same value).

Keys are the dataclass field names (job_status.py); a job also carries its derived
`padding_efficiency` and `budget_utilisation`, and its `coordinator` part is written `redis`
(where it comes from). Integer-keyed maps (`first_batch_s_by_rank`) get string keys in JSON and
are read back as ints; keys a reader does not know are ignored, so older and newer replicas
answer the same client.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from enum import Enum
from functools import cache
from typing import Any

from pipeline.observability.job_status import JobStatus, ServiceStatus

_DERIVED = ("padding_efficiency", "budget_utilisation")


def job_to_dict(job: JobStatus) -> dict[str, Any]:
    out = dataclasses.asdict(job)
    out["redis"] = out.pop("coordinator")
    out.update({k: getattr(job, k) for k in _DERIVED})
    return out


def service_to_dict(status: ServiceStatus) -> dict[str, Any]:
    return {"generated_at": status.generated_at,
            "service_started_at": status.service_started_at,
            "replica_id": status.replica_id, "jobs": [job_to_dict(j) for j in status.jobs]}


def job_from_dict(data: Mapping[str, Any]) -> JobStatus:
    return _read(JobStatus, {**data, "coordinator": data.get("redis")})


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _read(tp: Any, value: Any) -> Any:
    """`value` (parsed JSON) as type `tp`: dataclasses field by field, tuples, maps, enums."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _read(inner, value)
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        return tp(**{f.name: _read(hints[f.name], value[f.name])
                     for f in dataclasses.fields(tp) if f.name in value})
    if origin is tuple:
        (item, _) = typing.get_args(tp)
        return tuple(_read(item, v) for v in value)
    if origin is Mapping:
        key, item = typing.get_args(tp)
        return {_read(key, k): _read(item, v) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(value)
    if tp is int:
        return int(value)
    if tp is float:
        return float(value)
    return value
