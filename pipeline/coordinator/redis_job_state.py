"""`RedisJobState`: the `JobState` contract kept in Redis (keys: docs/redis-schema.md).

Cost per rank per step is O(1) round trips: one HMGET fetches the rank's batch (plus the step
header), one EVALSHA acknowledges and renews the lease together; a replica serving many ranks
does both for all of them in one round trip each (`get_step_for`, `ack_many`). A publication is
one EVALSHA whatever its size and carries the planner checkpoint, the counters and the
quarantine records, so a plan, the input position that produced it and what it counted are never
out of step; the producer's fencing token is checked inside the same script.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import NoScriptError

from pipeline.coordinator import keys, registry, scripts, step_codec
from pipeline.coordinator.connection import open_client, unavailable_as_error
from pipeline.coordinator.redis_groups import RedisGroups
from pipeline.errors import (
    AckAheadOfPlan,
    AckNotDelivered,
    CheckpointConflict,
    DurabilityTimeout,
    DurabilityUnavailable,
    Fenced,
    PlanningComplete,
    RankHeld,
    RanksLive,
    ScaleInProgress,
    StepConflict,
    StepGap,
    UnknownJob,
    WorldChanged,
)
from pipeline.jobstate.interface import (
    COMPUTE_REPORTS_KEPT,
    ComputeFitStatus,
    GroupHealth,
    JobCounters,
    JobState,
    Member,
    MixRequest,
    PlannerCheckpoint,
    ProducerFailure,
    ProducerLease,
    Publication,
    QuarantineEntry,
    RankAck,
    RankCompute,
    RankHealth,
    RankLease,
    SourceStatus,
    grouped,
)
from pipeline.jobstate.worlds import (
    Grant,
    PlanHead,
    ScaleReason,
    ScaleRequest,
    ScaleResult,
    World,
    WorldTimings,
    stamp_of_end,
    stamp_of_step,
)
from pipeline.modes import JobMode
from pipeline.planner.types import EpochEnd, Step, StepInfo

if TYPE_CHECKING:
    from pipeline.config import TrainingJobConfig

QUARANTINE_LIST_CAP = 10_000  # records listed per job; the counts stay exact past it


def pool_size_for(world_size: int) -> int:
    """Redis connections one process may use concurrently for a job of `world_size` ranks: a
    replica's I/O and handler threads, the producer, status calls, and room for embedders that
    drive streams from threads (a bound, not a pool allocated up front)."""
    return max(64, 2 * world_size + 16)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisJobState(JobState):
    """One job's state in Redis. Constructing it registers the job (or verifies the resume).

    `client_or_url`: a redis-py client or a URL (`redis://user:pass@host:port/db`, `rediss://`
    for TLS). `fsync_publish`: nothing a replica or producer acts on is answered before Redis
    fsynced it (WAITAOF), even with `appendfsync everysec`: a publication is held invisible
    until it is on disk (then revealed), and claims, grants, world switches and a drained
    rank's exit answer once durable; so nothing a rank received can be lost by a Redis crash
    (docs/redis-schema.md, "Durability"). Raises JobMismatch, SchemaMismatch,
    DurabilityUnavailable, StateUnavailable.
    """

    def __init__(self, client_or_url: redis.Redis | str, job_id: str, *, config_hash: str,
                 world_size: int, mode: JobMode | str = JobMode.JOIN, seed: int = 0,
                 config: str | None = None, retries: int = 5,
                 socket_timeout: float = 5.0, fsync_publish: bool = False,
                 max_connections: int | None = None, pool_timeout: float = 30.0,
                 earlier_hash: str | None = None) -> None:
        self.client, self._where = open_client(client_or_url, retries=retries,
                                               socket_timeout=socket_timeout,
                                               max_connections=max_connections,
                                               pool_timeout=pool_timeout)
        self.job_id = job_id
        self.mode = JobMode(mode)
        self.keys = keys.JobKeys(job_id)
        self.fsync_publish = fsync_publish
        # WAITAOF gives up before the socket does (a stalled disk is DurabilityTimeout).
        self._waitaof_ms = max(100, min(5000, int(socket_timeout * 800)))
        with unavailable_as_error(self._where):
            if fsync_publish:
                self._waitaof()  # fail at start, not at the first publish
            # A job an earlier build registered reading its files in order keeps that order
            # (its plan was made with it): `earlier_hash` is its config's hash as that build
            # had it (registry.earlier_hash); `registered_in_file_order` tells the caller.
            self.registered_in_file_order = False
            stored = registry.read_job(self.client, job_id)
            if (earlier_hash is not None and stored is not None
                    and stored.config_hash == earlier_hash != config_hash):
                config_hash, self.registered_in_file_order = earlier_hash, True
            self.created = registry.register_job(
                self.client, job_id, config_hash=config_hash, world_size=world_size,
                mode=self.mode, seed=seed, config=config)

    @functools.cached_property
    def _groups(self) -> RedisGroups:
        """The job's model-parallel groups (members' seats: redis_groups.py)."""
        return RedisGroups(self)

    def _waitaof(self) -> None:
        timeout_ms = self._waitaof_ms
        try:
            local, _ = self.client.execute_command("WAITAOF", 1, 0, timeout_ms)
        except redis.ResponseError as exc:
            raise DurabilityUnavailable(
                f"fsync_publish needs WAITAOF (Redis >= 7.2 or Valkey) with appendonly yes at "
                f"{self._where}: {exc}") from None
        if int(local) < 1:
            raise DurabilityUnavailable(
                f"WAITAOF: the publish was not fsynced within {timeout_ms} ms at {self._where}")

    @classmethod
    def connect(cls, client_or_url: redis.Redis | str, job: TrainingJobConfig, *, retries: int = 5,
                socket_timeout: float = 5.0, fsync_publish: bool = False,
                max_connections: int | None = None, pool_timeout: float = 30.0
                ) -> RedisJobState:
        """The state of a configured job (hash, world size, mode and seed from its config).
        Given a URL, the client's blocking pool is sized for the job (`pool_size_for`)."""
        if max_connections is None:
            max_connections = pool_size_for(job.world_size_cap())
        return cls(client_or_url, job.job_id, config_hash=registry.config_hash(job),
                   world_size=job.world_size, mode=job.mode, seed=job.seed,
                   config=registry.config_record(job), retries=retries,
                   socket_timeout=socket_timeout, fsync_publish=fsync_publish,
                   max_connections=max_connections, pool_timeout=pool_timeout,
                   earlier_hash=registry.earlier_hash(job))

    @classmethod
    def attach(cls, client_or_url: redis.Redis | str, job_id: str, *, retries: int = 5,
               socket_timeout: float = 5.0) -> RedisJobState:
        """An existing job, without registering or changing it (operators, tools)."""
        self = cls.__new__(cls)
        self.client, self._where = open_client(client_or_url, retries=retries,
                                               socket_timeout=socket_timeout)
        with unavailable_as_error(self._where):
            rec = registry.read_job(self.client, job_id)
        if rec is None:
            raise UnknownJob(f"job {job_id!r} is not registered in Redis")
        self.job_id, self.mode = job_id, rec.mode
        self.keys = keys.JobKeys(job_id)
        self.fsync_publish = False
        self.created = False
        return self

    # ----------------------------------------------------------------- helpers
    def _run(self, script: scripts.Script, keys_: Sequence[str], args: Sequence[Any],
             rank: int | None = None) -> Any:
        with unavailable_as_error(self._where):
            try:
                return script(self.client, keys_, args)
            except redis.ResponseError as exc:
                self._raise_mapped(str(exc), rank)
                raise

    def _error_for(self, msg: str, rank: int | None = None) -> Exception | None:
        code, *rest = msg.split()
        job = self.job_id
        if code == "ODB_CONFLICT":
            return StepConflict(f"job {job!r}: step {rest[0]} is already published with "
                                f"different content (steps are write-once)")
        if code == "ODB_END_CONFLICT":
            return StepConflict(f"job {job!r}: epoch {rest[0]} already has a different END "
                                f"record")
        if code == "ODB_GAP":
            return StepGap(f"job {job!r}: cannot publish step {rest[0]}, the next step to "
                           f"publish is {rest[1]} (steps are contiguous)")
        if code == "ODB_DONE":
            return StepConflict(f"job {job!r} is marked done: no new steps")
        if code == "ODB_CKPT":
            what, got, bound = rest
            why = ("goes backwards from" if what == "backwards"
                   else "claims steps that are not published; next unpublished step is")
            return CheckpointConflict(f"job {job!r}: checkpoint {got} {why} {bound}")
        if code == "ODB_FENCED":
            return Fenced(f"job {job!r}: producer generation {rest[0]} may not write "
                          f"(current: {rest[1]}): another producer took over")
        if code == "ODB_HELD":
            exp_ms, now_ms, holder = int(rest[0]), int(rest[1]), " ".join(rest[2:])
            which = "a rank" if rank is None else f"rank {rank}"
            return RankHeld(f"job {job!r}: {which} is held by client {holder!r} for "
                            f"{(exp_ms - now_ms) / 1000:.1f}s more (lease expires at "
                            f"{exp_ms / 1000:.3f} unix s)")
        if code == "ODB_AHEAD":
            return AckAheadOfPlan(f"job {job!r}: ack of step {rest[0]} but only steps "
                                  f"through {rest[1]} are published")
        if code == "ODB_UNSENT":
            return AckNotDelivered(f"job {job!r}: ack of step {rest[0]} by rank {rank}, which "
                                   f"may have been sent steps through {rest[1]} only")
        if code == "ODB_NOJOB":
            return UnknownJob(f"job {job!r} is not registered in Redis (deleted?)")
        if code == "ODB_WORLD":
            return WorldChanged(f"job {job!r}: publication planned for world {rest[0]}, the "
                                f"current world is {rest[1]} (a reconfiguration ended it)")
        if code == "ODB_RANK":
            return ValueError(f"job {job!r}: rank {rest[0]} outside 0..{int(rest[1]) - 1}")
        if code == "ODB_PLANNED":
            holders = [int(r) for r in rest[1].split(",")] if len(rest) > 1 else []
            return PlanningComplete(f"job {job!r} is fully planned and its final END may have "
                                    f"reached ranks {holders} (they were sent their last batch):"
                                    " the unconsumed batches of the gone ranks cannot move onto "
                                    "a new world")
        if code == "ODB_SCALING":
            if rest[0] == "adopting":
                return ScaleInProgress(f"job {job!r}: the switch to world {rest[1]} "
                                       f"({rest[2]} ranks) is not planned yet")
            return ScaleInProgress(f"job {job!r}: ranks [{rest[1]}] of the previous world are "
                                   "still draining to their last step")
        if code == "ODB_LIVE":
            return RanksLive(f"job {job!r}: ranks [{rest[1]}] of the current world ({rest[0]} "
                             "ranks) hold live leases")
        return None

    def _raise_mapped(self, msg: str, rank: int | None = None) -> None:
        exc = self._error_for(msg, rank)
        if exc is not None:
            raise exc from None

    def _check_rank(self, rank: int, bound: int) -> None:
        if not 0 <= rank < bound:
            raise ValueError(f"job {self.job_id!r}: rank {rank} outside 0..{bound - 1}")

    @property
    def world_size(self) -> int:
        """The current world's size (read from Redis: another replica may have reconfigured)."""
        (v,) = self._meta("world_size")
        if v is None:
            raise UnknownJob(f"job {self.job_id!r} is not registered in Redis (deleted?)")
        return int(v)

    def _lease_ranks(self) -> int:
        ws, lr = self._meta("world_size", "lease_ranks")
        if ws is None:
            raise UnknownJob(f"job {self.job_id!r} is not registered in Redis (deleted?)")
        return int(lr or ws)

    def _meta(self, *fields: str) -> list[bytes | None]:
        with unavailable_as_error(self._where):
            return self.client.hmget(self.keys.meta, list(fields))

    # ------------------------------------------------------------ the plan
    def publish(self, publication: Publication, *, fence: int) -> int:
        publication.check_stamps()
        cp = publication.checkpoint
        args: list[Any] = [self.keys.base, fence, cp.epoch, cp.samples_consumed, cp.next_step,
                           step_codec.encode_checkpoint(cp), "1" if publication.done else "0",
                           publication.samples_in, QUARANTINE_LIST_CAP,
                           len(publication.steps), cp.world,
                           "1" if self.fsync_publish else "0"]  # held until durable
        for step in publication.steps:
            header, blobs = step_codec.encode_step(step)  # ranks are checked in the script
            args += [step.epoch, step.step, header, step.info.step_samples,
                     step.info.step_tokens, len(blobs)]
            for rank, blob in blobs:
                args += [rank, blob]
        args.append(len(publication.ends))
        for end in publication.ends:
            args += [end.epoch, step_codec.encode_epoch_end(end)]
        args.append(len(publication.quarantined))
        for q in publication.quarantined:
            args += [q.sample_id, q.reason, step_codec.encode_quarantine(q)]
        k = self.keys
        ks = [k.meta, k.digests, k.ends, k.checkpoint, k.counters, k.quarantine_ids,
              k.quarantine, k.world_times, k.pending_ends]
        if not self.fsync_publish:
            new, _ = self._run(scripts.publish, ks, args)
            return int(new)
        new, _ = self._durably(scripts.publish, ks, args)
        self._run(scripts.reveal, [k.meta, k.ends, k.pending_ends], [fence])
        return int(new)

    def reveal(self, *, fence: int) -> int:
        if self.fsync_publish:
            self._fsync()
        k = self.keys
        return int(self._run(scripts.reveal, [k.meta, k.ends, k.pending_ends], [fence]))

    # --------------------------------------------------------- durability
    def _durably(self, script: scripts.Script | None, keys_: Sequence[str] = (),
                 args: Sequence[Any] = (), rank: int | None = None) -> Any:
        """`script`'s reply (None: no script) once Redis fsynced everything up to it
        (fsync_publish). On one connection: [EVALSHA, a write] in one round trip, then WAITAOF in
        a second. The write (a counter) makes WAITAOF cover whatever the script read even when
        it wrote nothing (WAITAOF waits for the connection's own last write). WAITAOF goes on
        its own: pipelined behind the writes it would wait for the server's next timer tick
        (100 ms at the default `hz 10`), on its own it finds them fsynced (~0.1 ms here).
        DurabilityTimeout if not confirmed: the script's effect may be applied, but nobody may
        act on it yet."""
        cmds: list[tuple] = [("INCR", self.keys.fsyncs)]
        if script is not None:
            cmds.insert(0, ("EVALSHA", script.sha, len(keys_), *keys_, *args))
        for attempt in (0, 1):
            with unavailable_as_error(self._where):
                replies = self._on_one_connection(cmds)
            res, waited = replies[0], replies[-1]
            if isinstance(res, NoScriptError) and attempt == 0:
                with unavailable_as_error(self._where):
                    self.client.script_load(script.source)
                continue
            if script is not None and isinstance(res, Exception):
                self._raise_mapped(str(res), rank)
                raise res
            self._check_fsynced(waited)
            return res if script is not None else None
        raise AssertionError("unreachable")

    def _on_one_connection(self, cmds: Sequence[tuple]) -> list[Any]:
        """The replies of `cmds` (one round trip) and of a WAITAOF sent after them (a second),
        all on one pooled connection; error replies are returned, not raised. A connection
        that fails is dropped and the exchange tried once more on a fresh one."""
        pool = self.client.connection_pool
        for attempt in (0, 1):
            conn = pool.get_connection()
            try:
                conn.send_packed_command(conn.pack_commands(cmds))
                replies = [self._reply(conn) for _ in cmds]
                conn.send_command("WAITAOF", 1, 0, self._waitaof_ms)
                return [*replies, self._reply(conn)]
            except (redis.ConnectionError, redis.TimeoutError):
                conn.disconnect()
                if attempt:
                    raise
            finally:
                pool.release(conn)
        raise AssertionError("unreachable")

    @staticmethod
    def _reply(conn: Any) -> Any:
        try:
            return conn.read_response()
        except redis.ResponseError as exc:
            return exc

    def _fsync(self) -> None:
        """Wait until Redis fsynced every write made so far (by any client)."""
        self._durably(None)

    def _check_fsynced(self, waited: Any) -> None:
        if isinstance(waited, Exception) or int(waited[0]) < 1:
            raise DurabilityTimeout(
                f"job {self.job_id!r}: Redis at {self._where} did not confirm within "
                f"{self._waitaof_ms} ms that the write is on disk (WAITAOF: {waited})")

    def _call(self, script: scripts.Script, keys_: Sequence[str], args: Sequence[Any],
              rank: int | None = None) -> Any:
        """A call whose answer is acted on outside Redis (a grant, a world switch, the
        producer lease): with fsync_publish it is answered only once durable (`_durably`)."""
        if self.fsync_publish:
            return self._durably(script, keys_, args, rank)
        return self._run(script, keys_, args, rank)

    def get_step(self, step: int) -> Step | None:
        with unavailable_as_error(self._where):
            raw = self.client.hgetall(self.keys.step(step))
        if not raw:
            return None
        header = raw.pop(b"h")
        return self._stamped([step_codec.decode_step(header, {int(r): v
                                                              for r, v in raw.items()})])[0]

    def get_step_for(self, step: int, ranks: Sequence[int]) -> Step | None:
        return self.get_steps_for([(step, ranks)])[0]

    def get_steps_for(self, wanted: Sequence[tuple[int, Sequence[int]]]) -> list[Step | None]:
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=False)
            for step, ranks in wanted:
                pipe.hmget(self.keys.step(step), ["h", *ranks])
            raws = pipe.execute()
        return self._stamped([self._step_part(raw, ranks)
                              for raw, (_, ranks) in zip(raws, wanted, strict=True)])

    @staticmethod
    def _step_part(raw: list[bytes | None], ranks: Sequence[int]) -> Step | None:
        if raw[0] is None:
            return None
        h = step_codec.decode_header(raw[0])
        wanted = {r: blob for r, blob in zip(ranks, raw[1:], strict=True) if blob is not None}
        return Step(epoch=h["e"], step=h["n"], info=StepInfo(*h["i"]),
                    batches=tuple(b for r in h["r"] if r in wanted
                                  for b in step_codec.decode_rank(wanted[r], r)),
                    world=step_codec.header_world(h), compute=step_codec.header_compute(h))

    def _stamped(self, steps: list[Step | None]) -> list[Step | None]:
        """Steps a build before stamping published get their world derived (one more read)."""
        if all(s is None or s.world.stamped for s in steps):
            return steps
        worlds = self.worlds()
        return [s if s is None or s.world.stamped
                else replace(s, world=stamp_of_step(worlds, s.step)) for s in steps]

    def published_through(self) -> int:
        (v,) = self._meta("published_through")
        if v is None:
            raise UnknownJob(f"job {self.job_id!r} is not registered in Redis (deleted?)")
        return int(v)

    def trimmed_through(self) -> int:
        (v,) = self._meta("trimmed_through")
        return int(v or -1)

    def epoch_ends(self) -> list[EpochEnd]:
        with unavailable_as_error(self._where):
            raw = self.client.hgetall(self.keys.ends)
        ends = sorted((step_codec.decode_epoch_end(v) for v in raw.values()),
                      key=lambda e: e.epoch)
        if all(e.world.stamped for e in ends):
            return ends
        worlds = self.worlds()  # ENDs a build before stamping published: derive their world
        return [e if e.world.stamped else replace(e, world=stamp_of_end(worlds, e))
                for e in ends]

    def is_done(self) -> bool:
        return self._meta("state")[0] == b"done"

    def load_checkpoint(self) -> PlannerCheckpoint | None:
        with unavailable_as_error(self._where):
            raw = self.client.get(self.keys.checkpoint)
        return step_codec.decode_checkpoint(raw) if raw else None

    # ------------------------------------------------------ the producer lease
    def claim_producer(self, holder: str, lease_seconds: float) -> int | None:
        if not holder:
            raise ValueError("holder must be non-empty")
        res = self._call(scripts.producer_claim, [self.keys.meta], [holder, _ms(lease_seconds)])
        return None if isinstance(res, list) else int(res)

    def renew_producer(self, generation: int, lease_seconds: float) -> None:
        self._run(scripts.producer_renew, [self.keys.meta], [generation, _ms(lease_seconds)])

    def release_producer(self, generation: int) -> None:
        with contextlib.suppress(Fenced):  # another producer holds it: nothing of ours to release
            self._run(scripts.producer_renew, [self.keys.meta], [generation, 0])

    def claim_producer_restart(self, actor_id: str, process: int) -> bool:
        return self._run(scripts.producer_restart, [self.keys.meta], [actor_id, process]) == 1

    def producer_lease(self) -> ProducerLease | None:
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)  # the lease and Redis's clock at once
            pipe.hmget(self.keys.meta, ["producer_gen", "producer_holder", "producer_exp"])
            pipe.time()
            (gen, holder, exp), (sec, usec) = pipe.execute()
        if not gen or int(gen) == 0:
            return None
        exp_ms, now_ms = int(exp or 0), int(sec) * 1000 + int(usec) // 1000
        return ProducerLease(int(gen), (holder or b"").decode(), exp_ms / 1000.0,
                             exp_ms > now_ms)

    def set_error(self, message: str, *, fence: int, cause: str = "internal",
                  transient: bool = False) -> None:
        self._run(scripts.set_error, [self.keys.meta],
                  [fence, message, cause, "1" if transient else "0"])

    def error(self) -> str | None:
        (v,) = self._meta("error")
        return v.decode() if v else None

    _FAILURE = ("error", "error_cause", "error_ms", "trouble", "trouble_cause", "trouble_ms",
                "trouble_attempts")

    @staticmethod
    def _failure(raw: list[bytes | None]) -> ProducerFailure | None:
        """(error, error_cause, error_ms, trouble, ...) as read: the permanent failure if any,
        else the transient one."""
        msg, cause, ms, t_msg, t_cause, t_ms, t_n = raw
        if msg:
            return ProducerFailure(msg.decode(), (cause or b"internal").decode(), True,
                                   int(ms or 0) / 1000.0)
        if t_msg:
            return ProducerFailure(t_msg.decode(), (t_cause or b"internal").decode(), False,
                                   int(t_ms or 0) / 1000.0, int(t_n or 1))
        return None

    def producer_failure(self) -> ProducerFailure | None:
        return self._failure(self._meta(*self._FAILURE))

    def clear_error(self) -> ProducerFailure | None:
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(self.keys.meta, list(self._FAILURE))
            pipe.hdel(self.keys.meta, "error", "error_cause", "error_ms")
            raw, _ = pipe.execute()
        cleared = self._failure(raw)
        return cleared if cleared is not None and cleared.permanent else None

    # --------------------------------------------------- ranks: leases, cursors
    def _ack_keys(self) -> list[str]:
        k = self.keys
        return [k.meta, k.acked, k.lease_exp, k.lease, k.lapsed, k.counters, k.claimed]

    def _ack(self, rank: int, client_id: str, lease_seconds: float, step: int) -> list:
        # The script checks the rank (current world for cursors, + draining ranks for leases).
        return self._run(scripts.ack, [*self._ack_keys(), self.keys.lease_claim],
                         [self.keys.base, rank, client_id, _ms(lease_seconds), step], rank=rank)

    def claim_rank(self, rank: int, client_id: str, lease_seconds: float, *,
                   member: Member | None = None) -> RankLease:
        if not client_id:
            raise ValueError("client_id must be non-empty")
        if grouped(member):
            (res,) = self._groups.acks([RankAck(rank, client_id, member=member)],
                                       _ms(lease_seconds), claims=True)
            if isinstance(res, Exception):
                raise res
            exp, claim = res
            return RankLease(rank, client_id, exp / 1000.0, claim)
        try:
            exp, _, claim = self._ack(rank, client_id, lease_seconds, -1)
        except RankHeld as exc:
            raise self._groups.plain_refusal(exc, rank, client_id) from None
        return RankLease(rank, client_id, exp / 1000.0, int(claim))

    def ack(self, rank: int, step: int) -> None:
        if step < 0:
            self._check_rank(rank, self.world_size)
            return
        self._ack(rank, "", 0, step)

    def ack_many(self, acks: Sequence[RankAck], lease_seconds: float) -> list[Exception | None]:
        out: list[Exception | None] = [None] * len(acks)
        todo, members = [], []
        args: list[Any] = [self.keys.base, _ms(lease_seconds)]
        for i, a in enumerate(acks):
            if not a.client_id:
                out[i] = ValueError("client_id must be non-empty")
            elif grouped(a.member):  # a seat of a group: the members' script
                members.append(i)
            else:
                todo.append(i)  # the script checks the rank, the lease, the plan and the grant
                args += [a.rank, a.client_id, a.step, "1" if a.renew else "0"]
        if members:
            got = self._groups.acks([acks[i] for i in members], _ms(lease_seconds))
            for i, res in zip(members, got, strict=True):
                out[i] = res if isinstance(res, Exception) else None
        if not todo:
            return out
        try:
            replies = self._run(scripts.ack_many, [*self._ack_keys(), self.keys.grants], args)
        except UnknownJob as exc:  # the job is gone: every ack gets the error
            replies = [exc] * len(todo)
        for i, res in zip(todo, replies, strict=True):
            if isinstance(res, Exception):
                out[i] = res
            elif res:
                msg = res.decode() if isinstance(res, bytes) else str(res)
                out[i] = self._error_for(msg, acks[i].rank) or RuntimeError(msg)
                if isinstance(out[i], RankHeld):
                    out[i] = self._groups.plain_refusal(out[i], acks[i].rank, acks[i].client_id)
        return out

    def record_compute(self, reports: Sequence[RankCompute]) -> list[None]:
        if reports:
            with unavailable_as_error(self._where):
                pipe = self.client.pipeline(transaction=True)
                pipe.rpush(self.keys.compute, *(f"{r.world},{r.step},{r.rank},{r.seconds!r}"
                                                for r in reports))
                pipe.ltrim(self.keys.compute, -COMPUTE_REPORTS_KEPT, -1)
                pipe.incrby(self.keys.compute_total, len(reports))
                pipe.execute()
        return [None] * len(reports)

    def compute_reports(self, after: int = 0) -> tuple[int, list[RankCompute]]:
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            pipe.get(self.keys.compute_total)
            pipe.lrange(self.keys.compute, 0, -1)
            total, raw = pipe.execute()
        total = int(total or 0)
        new = max(0, min(len(raw), total - after))
        out = []
        for item in raw[len(raw) - new:]:
            world, step, rank, seconds = item.decode().split(",")
            out.append(RankCompute(int(world), int(step), int(rank), float(seconds)))
        return total, out

    def set_compute_fit(self, status: ComputeFitStatus) -> None:
        with unavailable_as_error(self._where):
            self.client.set(self.keys.compute_fit, status.to_json())

    def compute_fit(self) -> ComputeFitStatus | None:
        with unavailable_as_error(self._where):
            raw = self.client.get(self.keys.compute_fit)
        return None if raw is None else ComputeFitStatus.from_json(raw)

    # ------------------------------------------------------------ mixtures
    def request_mix(self, weights: Mapping[str, float]) -> MixRequest:
        key = self.keys.mix
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            pipe.hincrby(key, "seq", 1)
            pipe.hset(key, mapping={"weights": json.dumps(dict(weights)),
                                    "ms": int(time.time() * 1000)})
            seq, _ = pipe.execute()
        return MixRequest(int(seq), dict(weights), time.time())

    def mix_request(self) -> MixRequest | None:
        with unavailable_as_error(self._where):
            got = self.client.hgetall(self.keys.mix)
        if not got:
            return None
        return MixRequest(int(got[b"seq"]), json.loads(got[b"weights"]),
                          int(got[b"ms"]) / 1000.0)

    def set_source_status(self, status: SourceStatus) -> None:
        with unavailable_as_error(self._where):
            self.client.set(self.keys.sources, status.to_json())

    def source_status(self) -> SourceStatus | None:
        with unavailable_as_error(self._where):
            raw = self.client.get(self.keys.sources)
        return None if raw is None else SourceStatus.from_json(raw)

    def release_rank(self, rank: int, client_id: str, claim: int | None = None, *,
                     member: Member | None = None) -> None:
        self._check_rank(rank, self._lease_ranks())
        if grouped(member):
            self._groups.release(rank, client_id, member, claim=claim)
            return
        self._run(scripts.release, [self.keys.lease, self.keys.lease_exp, self.keys.lease_claim],
                  [rank, client_id, "" if claim is None else claim])

    def group_health(self) -> list[GroupHealth]:
        return self._groups.health()

    def acked(self, rank: int) -> int:
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            pipe.hget(self.keys.meta, "world_size")
            pipe.zscore(self.keys.acked, rank)
            ws, v = pipe.execute()
        if ws is None:
            raise UnknownJob(f"job {self.job_id!r} is not registered in Redis (deleted?)")
        self._check_rank(rank, int(ws))
        return -1 if v is None else int(v)

    def acked_all(self) -> list[int]:
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            pipe.hget(self.keys.meta, "world_size")
            pipe.zrange(self.keys.acked, 0, -1, withscores=True)
            ws, rows = pipe.execute()
        if ws is None:
            raise UnknownJob(f"job {self.job_id!r} is not registered in Redis (deleted?)")
        out = [-1] * int(ws)
        for member, score in rows:
            r = int(member)
            if r < len(out):
                out[r] = int(score)
        return out

    def lease(self, rank: int) -> RankLease | None:
        """The rank's current lease record (live or lapsed), None if never claimed/released."""
        self._check_rank(rank, self._lease_ranks())
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            pipe.hget(self.keys.lease, rank)
            pipe.zscore(self.keys.lease_exp, rank)
            pipe.hget(self.keys.lease_claim, rank)
            raw, exp, claim = pipe.execute()
        if raw is None or exp is None:
            return None
        return RankLease(rank, raw.decode().partition(":")[2], float(exp) / 1000.0,
                         int(claim or 0))

    # ------------------------------------------------------------- failures
    def _lapsed(self, older_than_seconds: float, absent: bool = False
                ) -> tuple[dict[int, float], set[int], dict[int, float]]:
        """(lapsed now -> seconds, taken over after a lapse, never claimed -> seconds since the
        job's first claim; only with `absent`)."""
        k = self.keys
        offset_ms = round(older_than_seconds * 1000) if older_than_seconds > 0 else 0
        now, rows, history, ws, claimed, first = self._run(
            scripts.lapsed, [k.lease_exp, k.lapsed, k.meta, k.claimed],
            [offset_ms, "1" if absent else "0"])
        w = int(ws or 0)
        live = {int(rows[i]): (int(now) - int(float(rows[i + 1]))) / 1000.0
                for i in range(0, len(rows), 2) if int(rows[i]) < w}
        never: dict[int, float] = {}
        if absent and first:
            waited = (int(now) - int(first)) / 1000.0
            seen = {int(r) for r in claimed}
            never = {r: waited for r in range(w) if r not in seen}
        return live, {int(r) for r in history if int(r) < w}, never

    def lapsed_ranks(self) -> list[int]:
        live, history, _ = self._lapsed(0)
        return sorted(set(live) | history)

    def timed_out_ranks(self, timeout_seconds: float) -> dict[int, float]:
        live, _, never = self._lapsed(timeout_seconds, absent=True)
        limit = max(0.0, timeout_seconds)
        return dict(sorted({**live, **{r: t for r, t in never.items() if t > limit}}.items()))

    def rank_health(self) -> list[RankHealth]:
        k = self.keys
        now_ms, acked, exps, leases, ws = self._run(
            scripts.health, [k.acked, k.lease_exp, k.lease, k.meta], [])
        acked_by = {int(acked[i]): int(float(acked[i + 1])) for i in range(0, len(acked), 2)}
        exp_by = {int(exps[i]): int(float(exps[i + 1])) for i in range(0, len(exps), 2)}
        lease_by: dict[int, tuple[int, str]] = {}
        for i in range(0, len(leases), 2):
            hb, _, cid = leases[i + 1].decode().partition(":")
            lease_by[int(leases[i])] = (int(hb), cid)
        out = []
        for r in range(int(ws or 0)):
            exp = exp_by.get(r)
            hb_cid = lease_by.get(r)
            out.append(RankHealth(
                rank=r,
                acked=acked_by.get(r, -1),
                client_id=hb_cid[1] if hb_cid else None,
                lease_expires_at=exp / 1000.0 if exp is not None else None,
                heartbeat_age=(now_ms - hb_cid[0]) / 1000.0 if hb_cid else None,
                lapsed_for=max(0.0, (now_ms - exp) / 1000.0) if exp is not None else 0.0,
            ))
        return out

    # ------------------------------------------------------------- worlds
    def head(self) -> PlanHead:
        pt, gen, ws, first = self._meta("published_through", "world_gen", "world_size",
                                        "world_first")
        if pt is None:
            raise UnknownJob(f"job {self.job_id!r} is not registered in Redis (deleted?)")
        return PlanHead(int(pt), int(gen or 0), int(ws), int(first or 0))

    def worlds(self) -> list[World]:
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(self.keys.worlds)
            pipe.hmget(self.keys.meta, ["world_size", "world_size0", "created_ms"])
            raw, (ws, ws0, created) = pipe.execute()
        if ws is None:
            raise UnknownJob(f"job {self.job_id!r} is not registered in Redis (deleted?)")
        out = {int(g): step_codec.decode_world(v) for g, v in raw.items()}
        if 0 not in out:  # a job never reconfigured has no records
            out[0] = World(0, int(ws0 or ws), 0, ScaleReason.INITIAL, int(created or 0) / 1000)
        return [out[g] for g in sorted(out)]

    def grant(self, requests: Sequence[tuple[int, int, int]]) -> list[Grant | Exception]:
        if not requests:
            return []
        args: list[Any] = [len(requests)]
        for gen, rank, through in requests:
            args += [gen, rank, through]
        k = self.keys
        rows = self._call(scripts.grant, [k.meta, k.grants, k.worlds, k.world_times], args)
        out: list[Grant | Exception] = []
        for (gen, rank, _), (through, kind, extra) in zip(requests, rows, strict=True):
            if kind == -1:
                out.append(ValueError(f"job {self.job_id!r}: rank {rank} outside world {gen} "
                                      f"(0..{int(extra) - 1})"))
            elif kind == -2:
                out.append(ValueError(f"job {self.job_id!r}: no world {gen} (current: {extra})"))
            else:
                out.append(Grant(int(through), ended=kind == 1, next_world_size=int(extra)))
        return out

    def scale(self, request: ScaleRequest) -> ScaleResult:
        n = request.world_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {n!r}")
        k = self.keys
        res = self._call(scripts.scale,
                         [k.meta, k.acked, k.lease_exp, k.lease, k.grants, k.draining, k.worlds,
                          k.world_times, k.ends, k.counters, k.lapsed, k.claimed,
                          k.pending_ends],
                         [k.base, n, ScaleReason(request.reason).value,
                          -1 if request.position is None else request.position,
                          "1" if request.require_gone else "0",
                          -1 if request.expect_generation is None else request.expect_generation])
        if int(res[0]) == 0:
            return ScaleResult(False, self.worlds()[-1])
        return ScaleResult(True, step_codec.decode_world(res[2]),
                           step_codec.decode_world(res[1]))

    def rank_left(self, generation: int, rank: int, client_id: str, *,
                  member: Member | None = None) -> None:
        if grouped(member):
            self._groups.release(rank, client_id, member, generation)
            return
        k = self.keys
        self._call(scripts.left, [k.lease, k.lease_exp, k.draining, k.world_times, k.meta],
                   [generation, rank, client_id])

    def world_timings(self, generation: int) -> WorldTimings | None:
        if generation < 1:
            return None
        with unavailable_as_error(self._where):
            raw = self.client.hgetall(self.keys.world_times)
        prefix = f"{generation}:"
        t = {key.decode()[len(prefix):]: int(v) / 1000.0 for key, v in raw.items()
             if key.decode().startswith(prefix)}
        if "requested" not in t:
            return None
        per = {"first": {}, "left": {}}
        for name, at in t.items():
            kind, _, rank = name.partition(":")
            if kind in per and rank:
                per[kind][int(rank)] = at
        return WorldTimings(generation, t["requested"], t.get("adopted"), per["first"],
                            per["left"])

    # ------------------------------------------------------------- counts
    def counters(self) -> JobCounters:
        with unavailable_as_error(self._where):
            raw = self.client.hgetall(self.keys.counters)
        c = {k.decode(): int(v) for k, v in raw.items()}
        reasons = {k.split(":", 1)[1]: n for k, n in sorted(c.items())
                   if k.startswith("quarantined:")}
        return JobCounters(samples_in=c.get("samples_in", 0),
                           samples_planned=c.get("samples_planned", 0),
                           tokens_planned=c.get("tokens_planned", 0),
                           quarantined=sum(reasons.values()), quarantined_by_reason=reasons,
                           lease_lapses=c.get("lease_lapses", 0))

    def quarantine(self, limit: int = 1000) -> list[QuarantineEntry]:
        if limit <= 0:
            return []
        with unavailable_as_error(self._where):
            raw = self.client.lrange(self.keys.quarantine, 0, limit - 1)
        return [step_codec.decode_quarantine(r) for r in raw]

    def ping(self) -> None:
        with unavailable_as_error(self._where):
            self.client.ping()

    def close(self) -> None:
        self.client.close()
