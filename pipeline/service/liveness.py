"""What a job's other rank streams do once a rank has been gone too long (Guarantee 4): the
job's `rank_failure_policy` (`pipeline.modes.RankFailurePolicy`), one small class per policy
behind `LivenessPolicy`.

A rank is gone once its lease lapsed, or it never claimed one (counted from the world's first
claim: `JobState.timed_out_ranks`); after `rank_timeout_seconds` the policy decides:
- `fail` (default): the other ranks' streams end with the returned message (`RankTimedOut`),
  naming the rank, how long it has been gone and the policy; GetJob's `error` says the same;
- `wait`: they keep waiting (the producer's back-pressure holds them within `max_ahead` steps)
  until it comes back; logged once per rank;
- `shrink`: a reconfiguration onto the live ranks (`scaling.shrink`; one replica makes it, the
  others find it made); where it cannot be made, as `fail`.
Only the rank streams act on the policy (`rank_failure`); a status read (GetJob) asks what it
would report (`reported_failure`), which changes nothing: under `shrink` that is the refusal the
streams last met, if any.
No gRPC. Reads (and under shrink writes) the job's state through the replica's runtime: the
calls block, so an event loop runs them in an I/O thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from pipeline.modes import RankFailurePolicy
from pipeline.service import scaling
from pipeline.service.job_runtime import JobRuntime

log = logging.getLogger(__name__)


class LivenessPolicy(Protocol):
    name: RankFailurePolicy
    timeout_seconds: float

    def failure(self, rt: JobRuntime, gone: dict[int, float]) -> str | None:
        """Ranks `gone` (rank -> seconds) have been gone longer than the timeout: the error
        that ends the job's other streams, or None (they go on)."""

    def reported(self, rt: JobRuntime, gone: dict[int, float]) -> str | None:
        """What a status read reports for them: `failure`'s answer without acting on it."""


def _message(rt: JobRuntime, gone: dict[int, float], policy: LivenessPolicy,
             why: str = "") -> str:
    who = ", ".join(f"rank {r} has been gone for {t:.1f}s" for r, t in gone.items())
    return (f"job {rt.job.job_id!r}: {who} (lease lapsed or never taken, longer than "
            f"rank_timeout_seconds={policy.timeout_seconds:g}); "
            f"rank_failure_policy={policy.name}{why}: the other ranks' streams are aborted "
            "instead of waiting for it. Restart the job's trainer ranks from their checkpoints "
            "(or serve with rank_failure_policy=wait)")


class Fail:
    name = RankFailurePolicy.FAIL

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds

    def failure(self, rt: JobRuntime, gone: dict[int, float]) -> str | None:
        return _message(rt, gone, self)

    reported = failure


class Wait:
    name = RankFailurePolicy.WAIT

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        self._logged: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def failure(self, rt: JobRuntime, gone: dict[int, float]) -> str | None:
        for r, t in gone.items():
            with self._lock:
                new = (rt.job.job_id, r) not in self._logged
                self._logged.add((rt.job.job_id, r))
            if new:
                log.warning("job %s: rank %d gone for %.1fs; rank_failure_policy=wait: the "
                            "other ranks keep waiting", rt.job.job_id, r, t,
                            extra={"job": rt.job.job_id, "rank": r})
        return None

    def reported(self, rt: JobRuntime, gone: dict[int, float]) -> str | None:
        return None


class Shrink:
    name = RankFailurePolicy.SHRINK

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        self._refused: dict[str, str] = {}  # job -> what its streams last ended with

    def failure(self, rt: JobRuntime, gone: dict[int, float]) -> str | None:
        why = scaling.shrink(rt, self.timeout_seconds)
        message = None if why is None else _message(rt, gone, self, f" ({why})")
        if message is None:
            self._refused.pop(rt.job.job_id, None)
        else:
            self._refused[rt.job.job_id] = message
        return message

    def reported(self, rt: JobRuntime, gone: dict[int, float]) -> str | None:
        return self._refused.get(rt.job.job_id)  # (a read never reconfigures the job)


POLICIES: dict[RankFailurePolicy, type[Fail | Wait | Shrink]] = {
    p.name: p for p in (Fail, Wait, Shrink)}


def policy_named(name: RankFailurePolicy | str, timeout_seconds: float) -> LivenessPolicy:
    if name not in POLICIES:
        raise ValueError(f"rank_failure_policy must be one of "
                         f"{[p.value for p in RankFailurePolicy]}, got {name!r}")
    return POLICIES[name](timeout_seconds)


def rank_failure(rt: JobRuntime, policy: LivenessPolicy, rank: int | None = None
                 ) -> str | None:
    """The policy's error for the streams of ranks other than `rank` (None: they go on); the
    policy acts (`shrink` reconfigures the job)."""
    gone = {r: t for r, t in rt.dead_ranks(policy.timeout_seconds).items() if r != rank}
    return policy.failure(rt, gone) if gone else None


def reported_failure(rt: JobRuntime, policy: LivenessPolicy) -> str | None:
    """What a status read reports of the gone ranks: no side effect on the job."""
    gone = rt.dead_ranks(policy.timeout_seconds)
    return policy.reported(rt, gone) if gone else None
