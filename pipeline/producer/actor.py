"""The producer of a Ray-preprocessed job as a named, detached Ray actor.

One actor per job, named `producer:<job_id>` in the `odb` namespace. Whichever replica finds the
job unplanned with no live producer lease creates it (`ensure_producer`); Ray's name registry
makes concurrent creations resolve to one actor, and the Redis lease generation (the fencing
token) makes a stale incarnation unable to publish anyway. The actor is restarted by Ray if its
process dies (`max_restarts=-1`); the new incarnation has the same actor id, so it takes the
lease over at once and resumes from the checkpoint. When the job is planned and every staged
payload released (or the producer was fenced out, or failed for good), the actor's process ends
the actor for good, but only while Ray still has it as the actor's current process: an old
process that outlived its restart (frozen, or cut off from Ray's GCS) ends only itself, never
the successor that runs under the same actor id (`end_process`).

Replicas ask it for payload references (`batch_refs`): in-band, so Ray counts them as borrowed
while a replica reads them. An SDO job's producer reads through `SdoFeed` (its epochs are visits
in traversal order, its SDO state in Redis) and plans with the window `locality` asks for.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import ray

from pipeline.config import TrainingJobConfig
from pipeline.producer.producer import Outcome, Producer, ProducerSettings

NAMESPACE = "odb"
log = logging.getLogger(__name__)


def actor_name(job_id: str) -> str:
    return f"producer:{job_id}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=16)
class ProducerActor:
    """Runs `Producer` over a `RayFeed` in a thread; methods answer replicas meanwhile."""

    def __init__(self, job_json: str, redis_url: str, settings: dict[str, Any],
                 fsync_publish: bool = False) -> None:
        from pipeline.coordinator import RedisJobState
        from pipeline.producer.ray_feed import RayFeed

        logging.basicConfig(level=logging.INFO)
        job = TrainingJobConfig.model_validate_json(job_json)
        self.job_id = job.job_id
        self.state = RedisJobState.connect(redis_url, job, fsync_publish=fsync_publish)
        self.feed: Any
        if job.organization.kind == "sdo":
            self.feed, planned_as = self._sdo(job)
        else:
            self.feed, planned_as = RayFeed(job), job
        context = ray.get_runtime_context()
        self.process = ProcessId(os.getpid(), context.get_node_id())
        holder = f"actor:{context.get_actor_id()}"
        self.producer = Producer(planned_as, self.state, self.feed, holder=holder,
                                 settings=ProducerSettings(**settings))
        self.thread = threading.Thread(target=self._run, name=f"producer-{job.job_id}",
                                       daemon=True)
        self.thread.start()

    def _sdo(self, job: TrainingJobConfig) -> tuple[Any, TrainingJobConfig]:
        """An SDO job: its visits feed (SDO state in the job's Redis, fenced by this producer's
        lease generation) and the job as planned (the window `locality` asks for)."""
        from pipeline.coordinator.redis_ledger_store import RedisLedgerStore
        from pipeline.producer.ray_feed import RayFeed
        from pipeline.producer.sdo_feed import SdoFeed, planning_job, reading_job

        store = RedisLedgerStore(self.state.client)
        return (SdoFeed(job, RayFeed(reading_job(job)), store,
                        fence=lambda: self.producer.generation), planning_job(job))

    def _run(self) -> None:
        outcome = self.producer.run()
        self.feed.close()
        self.state.close()
        if outcome is not Outcome.STOPPED:
            # Planned (or fenced out, or failed and reported): never restart this actor.
            end_process(ray.get_runtime_context().current_actor, self.process)

    def batch_refs(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
        """(step, rank) -> the object holding that batch's payload rows (None: not staged by
        this producer). The refs are nested in a dict, so they travel as references."""
        return self.feed.refs(keys)

    def info(self) -> dict[str, Any]:
        p = self.producer
        return {"job_id": self.job_id, "pid": os.getpid(), "node": self.process.node,
                "generation": p.generation, "holder": p.holder,
                "outcome": p.outcome.value if p.outcome else None, "held": self.feed.held()}

    def stop(self) -> None:
        self.producer.stop()


def find_producer(job_id: str) -> Any | None:
    """The job's producer actor handle, None if there is none (or it is gone for good)."""
    try:
        return ray.get_actor(actor_name(job_id), namespace=NAMESPACE)
    except ValueError:
        return None


def ensure_producer(job: TrainingJobConfig, redis_url: str, settings: ProducerSettings,
                    fsync_publish: bool = False) -> Any:
    """The job's producer actor, created if there is none (a no-op when one exists: Ray's
    named-actor registry gives every concurrent caller the same actor)."""
    return ProducerActor.options(
        name=actor_name(job.job_id), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True,
    ).remote(job.model_dump_json(), redis_url, dataclasses.asdict(settings), fsync_publish)


class ActorProcess(NamedTuple):
    """One process of the actor, as Ray's actor table (the GCS) has it."""

    actor_id: str
    process: int  # how many times Ray had restarted the actor
    state: str  # ALIVE once constructed


def actor_process(handle: Any) -> ActorProcess:
    from ray._private import state as ray_state  # the GCS actor table

    actor_id = handle._actor_id.hex()
    row = ray_state.actors(actor_id=actor_id)
    return ActorProcess(actor_id, int(row.get("NumRestarts", 0)), row.get("State", ""))


class ProcessId(NamedTuple):
    """One process of an actor: its pid on its node."""

    pid: int
    node: str  # Ray's node id (hex)


def is_current_process(handle: Any, process: ProcessId) -> bool:
    """Whether Ray's actor table (the GCS) has `process` as the actor's live process. Blocks
    while the GCS cannot be reached (a process cut off from it longer than Ray's reconnect
    timeout exits on its own)."""
    from ray._private import state as ray_state

    row = ray_state.actors(actor_id=handle._actor_id.hex())
    return (row.get("State") == "ALIVE" and row.get("Pid") == process.pid
            and row.get("Address", {}).get("NodeID") == process.node)


def end_process(handle: Any, process: ProcessId, *,
                exit_process: Callable[[int], Any] = os._exit) -> bool:
    """`process` of the actor is done for good (planned, fenced out, failed). While it is the
    actor's current process, the actor is killed without restart (True). Otherwise Ray has
    restarted the actor meanwhile and a successor runs under the same actor id: killing the
    actor would end the successor, so only this process exits (False)."""
    try:
        current = is_current_process(handle, process)
    except Exception:  # not confirmed: ending this process alone is always safe
        log.warning("could not tell whether this producer process is current", exc_info=True)
        current = False
    if current:
        ray.kill(handle, no_restart=True)
        return True
    log.warning("this producer process (pid %d) is no longer the actor's; it ends alone",
                process.pid)
    exit_process(0)
    return False


def stuck_producer(handle: Any, ping_seconds: float) -> str | None:
    """Why the job's producer actor is stuck (it does not answer, or answers while its
    producer cannot take the lease: frozen, hung, cut off from Redis), or None while it is not
    up yet (its constructor runs, or Ray restarts it) or answers. Asked only when the job's
    lease has been free for a while: a working producer actor takes it within a second."""
    if actor_process(handle).state != "ALIVE":
        return None
    try:
        ray.get(handle.info.remote(), timeout=ping_seconds)
    except ray.exceptions.GetTimeoutError:
        return f"it has not answered for {ping_seconds:.0f}s (frozen or hung)"
    except ray.exceptions.RayError:
        return None  # dying: Ray restarts it or its name frees
    return "it answers, but its producer cannot take the lease (cut off from Redis?)"


def restart_producer(handle: Any) -> None:
    """Kill the actor's process; Ray restarts it (a new process takes the lease over: the
    same holder, a new generation; the old one, were it to wake, is fenced)."""
    ray.kill(handle, no_restart=False)


def stop_producer(job_id: str, timeout: float = 10.0) -> None:
    """Stop and remove the job's producer actor, if any (tests, demo, operators)."""
    handle = find_producer(job_id)
    if handle is None:
        return
    try:
        ray.get(handle.stop.remote(), timeout=timeout)
    except Exception:  # already dying: kill it anyway
        log.debug("producer %s stop call failed", job_id, exc_info=True)
    ray.kill(handle, no_restart=True)
