"""Coordinator errors beyond the protocol's StepConflict / RankHeld (pipeline/service/job_state.py).

Each one is a refusal that leaves Redis unchanged: the Lua scripts check everything before the
first write, because a script that errors half-way does not roll back.
"""

from __future__ import annotations

from pipeline.errors import UserError


class JobMismatch(UserError):
    """The job id exists in Redis with a different config hash, world size or mode."""


class SchemaMismatch(UserError):
    """Redis holds coordinator state of another schema version than this build speaks."""


class StepGap(ValueError):
    """A step was published past `published_through + 1`: ranks would wait forever for the gap."""


class CheckpointConflict(ValueError):
    """A checkpoint that goes backwards or claims steps that are not published."""


class AckAheadOfPlan(ValueError):
    """A rank acknowledged a step that is not published (a client or server bug)."""


class UnknownJob(UserError):
    """No such job in this Redis."""


class DurabilityUnavailable(UserError):
    """fsync_publish was asked for but this Redis cannot confirm fsync (no WAITAOF or no AOF)."""
