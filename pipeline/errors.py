"""The project's one error hierarchy.

    OdbError
    ├── UserError            wrong input, config or request: the CLI prints one line, exit 2
    │   ├── JobMismatch, SchemaMismatch, UnknownJob, DurabilityUnavailable
    │   ├── BadRequest       a request field out of its range (a rank, a credit count, ...)
    │   ├── PositionUnavailable  a resume position the plan cannot serve
    │   ├── WrongJobMode     a call made for another kind of job (refill vs training)
    │   ├── MixRefused       a mixture change the job cannot take (no mixture, fully planned)
    │   ├── Unauthenticated  a call without the job's bearer token (or a wrong one)
    │   └── WireMismatch     a client that decodes another wire version
    ├── StateError           a refusal of a job's shared state (it is left unchanged)
    │   ├── StepConflict     a step or END published twice with different content
    │   ├── StepGap          a step published past `published_through + 1`
    │   ├── CheckpointConflict  a checkpoint that goes backwards or claims unpublished steps
    │   ├── AckAheadOfPlan   a rank acknowledged a step that is not published
    │   ├── AckNotDelivered  a rank acknowledged a step it was never sent
    │   ├── RankHeld         another live client holds the rank's lease
    │   ├── Fenced           a producer whose lease generation is no longer current
    │   ├── WorldChanged     a publication for a world that a reconfiguration ended
    │   ├── ScaleRefused     a reconfiguration the state cannot make now
    │   │   ├── ScaleInProgress   the previous one is not complete yet
    │   │   ├── PlanningComplete  fully planned, and a live rank may hold the final END
    │   │   ├── JobFinished       every rank acknowledged its last step: the world stays
    │   │   └── RanksLive         (implicit switch) ranks of the current world still hold leases
    │   └── StateUnavailable the state could not be reached (Redis down after retries)
    │       └── DurabilityTimeout  a write not confirmed on disk in time (fsync_publish)
    └── StreamStopped        why a replica ends a rank's stream (the job goes on elsewhere)
        ├── RankTimedOut     a peer rank has been gone too long (rank_failure_policy fail)
        ├── ProducerFailed   the job's producer failed for good (a bug)
        │   ├── ProducerMisconfigured  on what an operator must fix (a source, the config)
        │   └── ProducerUnavailable    on a cause that heals, past the producer's retries
        └── ReplicaUnavailable  this replica cannot serve it now: reconnect (maybe elsewhere)

Every refusal leaves the state as it was (the Redis scripts check before their first write), so a
caller may retry or give up without repairing anything. Only the gRPC adapter
(`pipeline/service/data_server.py`) knows which status code each of these is.
"""

from __future__ import annotations


class OdbError(Exception):
    """Base of every error this project raises on purpose."""


class UserError(OdbError):
    """Wrong input, config or request: the message names the field/file and the bad value."""


class JobMismatch(UserError):
    """The job id exists in the state with a different config hash or mode."""

    def __init__(self, message: str, *, job_id: str = "") -> None:
        super().__init__(message)
        self.job_id = job_id


class SchemaMismatch(UserError):
    """Redis holds coordinator state of another schema version than this build speaks."""


class UnknownJob(UserError):
    """No such job in this state."""

    @classmethod
    def named(cls, job_id: str) -> UnknownJob:
        """What a caller of the service is told: how to list the jobs, never the list (the
        caller is not known yet, Guarantee 9)."""
        return cls(f"unknown job {job_id!r}: check the job id (`odb-pipeline status` where the "
                   "service runs lists its jobs)")


class DurabilityUnavailable(UserError):
    """fsync_publish was asked for but this Redis cannot confirm fsync (no WAITAOF or no AOF)."""


class BadRequest(UserError):
    """A request field out of its range (a rank outside the world, a negative or too large
    credit count, a too long client id, ...): nothing was changed."""


class MixRefused(UserError):
    """A mixture change the job cannot take: it has no mixture (one source), or it is fully
    planned (no step would be planned with it). Nothing was changed."""


class PositionUnavailable(UserError):
    """A resume position the plan cannot serve: never published, trimmed (an epoch every rank
    finished), or inside a world a reconfiguration ended (its steps cannot be re-planned)."""


class WrongJobMode(UserError):
    """A call made for another kind of job: a refill job's id on Stream or Scale."""


class Unauthenticated(UserError):
    """A call without the job's bearer token, or with a wrong one."""


class WireMismatch(UserError):
    """The client decodes another wire version than this server writes."""


class StateError(OdbError):
    """A job state refused a change; nothing was written."""


class StepConflict(StateError):
    """A step number (or an epoch's END) was published twice with different content."""


class StepGap(StateError):
    """A step was published past `published_through + 1`: ranks would wait for the gap."""


class CheckpointConflict(StateError):
    """A checkpoint that goes backwards or claims steps that are not published."""


class AckAheadOfPlan(StateError):
    """A rank acknowledged a step that is not published (a client or server bug)."""


class AckNotDelivered(StateError):
    """A rank acknowledged a published step beyond what it may have been sent (its delivery
    grant): a cursor never skips steps the rank did not get."""


class RankHeld(StateError):
    """Another live client holds this rank's lease."""


class GroupRefused(StateError):
    """A model-parallel group the job cannot serve as asked (`Member`): two clients of one rank
    disagree on its group size, or the job does not say how its sequences are padded
    (`batching.pad_to_multiple`: its message starts with `GROUP_REFUSED_PREFIX`, which the
    client does not retry)."""


class Fenced(StateError):
    """A producer tried to act with a lease generation that is no longer the job's current one
    (another producer took over): it must stop, it can never publish again."""


class WorldChanged(StateError):
    """A producer published a checkpoint for a world that is no longer the job's current one (a
    reconfiguration ended it): it must re-plan from the state's checkpoint for the new world."""


class ScaleRefused(StateError):
    """A reconfiguration that cannot be made now (nothing was changed)."""


class ScaleInProgress(ScaleRefused):
    """The previous reconfiguration is not complete: its producer has not published the new
    world's plan yet, or ranks of the old world are still draining to their last step."""


class PlanningComplete(ScaleRefused):
    """Every epoch of the job is planned and a live rank may already hold the job's final END
    (it was sent its last batch): batches of gone ranks cannot move onto a new world."""


class JobFinished(ScaleRefused):
    """The job has finished (every rank of its world acknowledged its last step): its world is
    what it ran, and nothing is left to move onto another one."""


class RanksLive(ScaleRefused):
    """An implicit (Open-triggered) reconfiguration while ranks of the current world still hold
    live leases: it happens once they ended or their leases lapsed."""


class StateUnavailable(StateError):
    """The job state could not be reached after bounded retries (e.g. Redis restarting)."""


class DurabilityTimeout(StateUnavailable):
    """With fsync_publish, Redis did not confirm within its timeout that a write reached its
    disk (WAITAOF): the write may be applied but is not vouched for; retry it."""


class StreamStopped(OdbError):
    """Why a replica ends a rank's stream although the rank did nothing wrong."""


class RankTimedOut(StreamStopped):
    """A peer rank has been gone longer than `rank_timeout_seconds` under the `fail` policy:
    the job's other streams end instead of waiting for it."""


class ProducerFailed(StreamStopped):
    """The job's producer failed for good (`JobState.error`), on a bug."""


class ProducerMisconfigured(ProducerFailed):
    """The job's producer failed for good on what an operator must fix (a missing or
    forbidden source, the job's config, a plan that differs from the published one)."""


class ProducerUnavailable(ProducerFailed):
    """The job's producer failed for good on a cause that heals (the state, Ray, a source
    unreadable for a while), once its retries ran out."""


class ReplicaUnavailable(StreamStopped):
    """This replica cannot serve the stream now (it stops, or cannot reach the job's state or
    payloads within their bounds): the client reconnects, to another replica if it has one."""
