"""What a producer failure is: transient (retried with backoff) or permanent (the job fails once).

One table (`RULES`, first match wins) maps an exception to a `Cause`; each cause says whether it
heals by itself and what an operator does about it. The producer (producer.py) retries a
transient failure with bounded exponential backoff (`Backoff`) and records it on the job as
*trouble* (streams keep waiting; the next publication clears it); a permanent one is recorded
as the job's error once (streams end with a status naming the cause, replicas stop re-creating
the producer until a replica starts again).

    cause              heals?  examples
    state_unavailable  yes     Redis unreachable or timing out (StateUnavailable, LeaseUnconfirmed)
    not_durable        yes     WAITAOF not confirmed within its timeout (fsync_publish)
    state_rolled_back  yes     Redis restarted from an older AOF (StateRolledBack, StepGap, ...)
    ray_unavailable    yes     Ray cluster errors: lost objects, dead workers/nodes, timeouts
    source_unreadable  yes     I/O errors reading a source (EIO, timeouts, connection resets)
    source_missing     no      a source that does not exist (SourceNotFound, FileNotFoundError)
    source_forbidden   no      a source this process may not read (PermissionError)
    config             no      the job's config or registration is wrong (UserError, pydantic)
    plan_conflict      no      the plan made differs from the published one (StepConflict)
    internal           no      anything else: a bug, deterministic by default

Pure: no I/O; Ray's exception classes are matched by name so this module never imports Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from pipeline.errors import (
    CheckpointConflict,
    DurabilityTimeout,
    StateError,
    StateUnavailable,
    StepConflict,
    StepGap,
    UserError,
)
from pipeline.preprocess.sources import SourceNotFound


class LeaseUnconfirmed(StateUnavailable):
    """The producer could not renew its lease before its local deadline (the state is
    unreachable): it publishes nothing until it can."""


class StateRolledBack(StateError):
    """The state's plan is shorter than what this producer published: it lost recent writes
    (Redis restarted from an AOF fsynced every second). Production resumes from the state's
    checkpoint, which was written atomically with the steps it covers."""


class Cause(str, Enum):  # noqa: UP042 (str mixin: stored in the job state as text)
    STATE_UNAVAILABLE = "state_unavailable"
    NOT_DURABLE = "not_durable"
    STATE_ROLLED_BACK = "state_rolled_back"
    RAY_UNAVAILABLE = "ray_unavailable"
    SOURCE_UNREADABLE = "source_unreadable"
    SOURCE_MISSING = "source_missing"
    SOURCE_FORBIDDEN = "source_forbidden"
    CONFIG = "config"
    PLAN_CONFLICT = "plan_conflict"
    INTERNAL = "internal"

    @property
    def transient(self) -> bool:
        return self in _TRANSIENT

    @property
    def advice(self) -> str:
        """What an operator does about a permanent failure of this cause."""
        return _ADVICE[self]


_TRANSIENT = frozenset({Cause.STATE_UNAVAILABLE, Cause.NOT_DURABLE, Cause.STATE_ROLLED_BACK,
                        Cause.RAY_UNAVAILABLE, Cause.SOURCE_UNREADABLE})
_RESTART = ("then restart the serve replicas (a replica that starts retries a failed job's "
            "producer once)")
_ADVICE = {
    Cause.SOURCE_MISSING: f"Restore the missing source, {_RESTART}; to read other files, use a "
                          "new job_id (a changed config under the same job_id is refused)",
    Cause.SOURCE_FORBIDDEN: f"Let the producer read the source, {_RESTART}",
    Cause.CONFIG: "Fix the job's config under a new job_id (a changed config under the same "
                  "job_id is refused)",
    Cause.PLAN_CONFLICT: "The data or the preprocessing changed under this job_id, so the plan "
                         "cannot continue as published: start the run again under a new job_id",
    Cause.INTERNAL: f"This is a bug: report it with the serve logs; {_RESTART}",
    # A transient cause becomes permanent only after the producer's retry bound.
    **{c: f"It did not heal within the producer's retry bound: fix it, {_RESTART}"
       for c in _TRANSIENT},
}

# Ray's errors of the cluster (not of user code): retried. Matched by class name in Ray's modules.
RAY_TRANSIENT = frozenset({
    "RaySystemError", "GetTimeoutError", "ObjectLostError", "OwnerDiedError",
    "ObjectFetchTimedOutError", "ObjectReconstructionFailedError", "ObjectFreedError",
    "ObjectStoreFullError", "OutOfMemoryError", "OutOfDiskError", "WorkerCrashedError",
    "NodeDiedError", "LocalRayletDiedError", "RayActorError", "ActorDiedError",
    "ActorUnavailableError", "ActorUnschedulableError", "TaskUnschedulableError",
    "TaskCancelledError", "RayChannelError", "RayChannelTimeoutError", "RpcError",
    "PlasmaObjectNotAvailable"})


def _ray_error(names: frozenset[str]) -> Callable[[BaseException], bool]:
    def match(exc: BaseException) -> bool:
        return any(c.__module__.startswith("ray.") and c.__name__ in names
                   for c in type(exc).__mro__)
    return match


def _named(module: str, name: str) -> Callable[[BaseException], bool]:
    def match(exc: BaseException) -> bool:
        return any(c.__module__.startswith(module) and c.__name__ == name
                   for c in type(exc).__mro__)
    return match


def _kind(*types: type[BaseException]) -> Callable[[BaseException], bool]:
    return lambda exc: isinstance(exc, types)


# First match wins: specific classes before their bases (FileNotFoundError before OSError;
# DurabilityTimeout before StateUnavailable). A Ray task error is a subclass of the error it
# wraps, so a FileNotFoundError raised in a read task is `source_missing` too.
RULES: tuple[tuple[Callable[[BaseException], bool], Cause], ...] = (
    (_kind(DurabilityTimeout), Cause.NOT_DURABLE),
    (_kind(StateUnavailable), Cause.STATE_UNAVAILABLE),
    (_kind(StateRolledBack, StepGap, CheckpointConflict), Cause.STATE_ROLLED_BACK),
    (_kind(StepConflict), Cause.PLAN_CONFLICT),
    (_kind(SourceNotFound), Cause.SOURCE_MISSING),
    (_kind(UserError), Cause.CONFIG),
    (_named("pydantic", "ValidationError"), Cause.CONFIG),
    (_kind(FileNotFoundError, NotADirectoryError, IsADirectoryError), Cause.SOURCE_MISSING),
    (_kind(PermissionError), Cause.SOURCE_FORBIDDEN),
    (_ray_error(RAY_TRANSIENT), Cause.RAY_UNAVAILABLE),
    (_kind(OSError), Cause.SOURCE_UNREADABLE),  # EIO, TimeoutError, ConnectionError, ...
)


def classify(exc: BaseException) -> Cause:
    """The cause of `exc` by `RULES`; an unmatched wrapper (a Ray task error around a plain
    exception, `raise ... from exc`) is classified by what it wraps; else `internal`."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        for match, cause in RULES:
            if match(cur):
                return cause
        inner = getattr(cur, "cause", None)
        cur = inner if isinstance(inner, BaseException) else cur.__cause__
    return Cause.INTERNAL


def describe(exc: BaseException) -> str:
    """One line naming the exception (the detail a failure record carries)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


@dataclass(frozen=True)
class Backoff:
    """Bounded exponential backoff: `first`, doubling, at most `cap` seconds per wait; a streak
    of transient failures longer than `give_up_seconds` becomes permanent."""

    first: float = 0.5
    cap: float = 30.0
    give_up_seconds: float = 600.0

    def delay(self, attempt: int) -> float:
        """The wait before retry number `attempt` (1 = the first retry)."""
        return min(self.cap, self.first * 2 ** max(0, min(attempt - 1, 30)))
