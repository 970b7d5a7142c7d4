"""`RedisJobState`: the `JobState` protocol kept in Redis (keys: docs/redis-schema.md).

Cost per rank per step is O(1) round trips: one HMGET fetches the rank's batch (plus the step
header), one EVALSHA acknowledges and renews the lease together. A server replica serving many
ranks can do both for all of them in one round trip each (`get_step_for`, `ack_heartbeat_many`).
Publishing is one EVALSHA per call whatever the number of steps, and carries the planner
checkpoint, so a plan and the input position that produced it are never out of step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import NoScriptError

from pipeline.coordinator import keys, registry, scripts, step_codec
from pipeline.coordinator.connection import open_client, unavailable_as_error
from pipeline.coordinator.errors import (
    AckAheadOfPlan,
    CheckpointConflict,
    DurabilityUnavailable,
    StepGap,
    UnknownJob,
)
from pipeline.planner.types import EpochEnd, Step, StepInfo
from pipeline.service.job_state import PlannerCheckpoint, RankHeld, RankLease, StepConflict

if TYPE_CHECKING:
    from pipeline.config import JobConfig


@dataclass(frozen=True)
class RankHealth:
    """One rank as the failure policy sees it (times in unix seconds, Redis clock)."""

    rank: int
    acked: int  # last acknowledged step, -1 if none
    client_id: str | None  # lease holder (None: never claimed or released)
    lease_expires_at: float | None
    heartbeat_age: float | None  # seconds since the holder's last claim/heartbeat/ack
    lapsed_for: float  # seconds since the lease expired; 0.0 while live or without a lease

    @property
    def lapsed(self) -> bool:
        return self.lapsed_for > 0.0


def pool_size_for(world_size: int) -> int:
    """Redis connections one server process may use concurrently for a job of `world_size`
    ranks (an ack reader and a sender per rank stream, the producer, status calls)."""
    return max(64, 2 * world_size + 16)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisJobState:
    """One job's shared state. Constructing it registers the job (or verifies the resume).

    `client_or_url`: a redis-py client (e.g. from `pipeline.redis_client.connect`) or a URL
    (`redis://user:pass@host:port/db`, `rediss://` for TLS). `history_steps`: how many steps
    every rank has acknowledged stay readable for operators before they are trimmed.
    `fsync_publish`: each publish waits until Redis fsynced it (WAITAOF), so a step a rank can
    see survives a Redis crash even with `appendfsync everysec` (see docs/redis-schema.md).
    Raises JobMismatch (config hash / world size / mode differ from the stored job),
    SchemaMismatch, DurabilityUnavailable, RedisUnavailable.
    """

    def __init__(self, client_or_url: redis.Redis | str, job_id: str, *, config_hash: str,
                 world_size: int, mode: str = "join", seed: int = 0, history_steps: int = 64,
                 retries: int = 5, socket_timeout: float = 5.0,
                 fsync_publish: bool = False, max_connections: int | None = None,
                 pool_timeout: float = 30.0) -> None:
        self.client, self._where = open_client(client_or_url, retries=retries,
                                               socket_timeout=socket_timeout,
                                               max_connections=max_connections,
                                               pool_timeout=pool_timeout)
        self.job_id = job_id
        self.world_size = world_size
        self.mode = str(getattr(mode, "value", mode))
        self.keys = keys.JobKeys(job_id)
        self.fsync_publish = fsync_publish
        with unavailable_as_error(self._where):
            if fsync_publish:
                self._waitaof()  # fail at start, not at the first publish
            self.created = registry.register_job(
                self.client, job_id, config_hash=config_hash, world_size=world_size,
                mode=self.mode, seed=seed, history_steps=history_steps)

    def _waitaof(self, timeout_ms: int = 5000) -> None:
        """Block until this connection's writes are fsynced to the local AOF (WAITAOF, Redis
        >= 7.2 / Valkey). Makes a publish durable before any rank can see the step, with
        `appendfsync everysec` instead of fsyncing every ack (`always`)."""
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
    def connect(cls, client_or_url: redis.Redis | str, job: JobConfig, *,
                history_steps: int = 64, retries: int = 5, socket_timeout: float = 5.0,
                fsync_publish: bool = False, max_connections: int | None = None,
                pool_timeout: float = 30.0) -> RedisJobState:
        """The state of a configured job: hash, world size, mode and seed from its JobConfig.

        Given a URL, the client's pool is sized for the job: a server runs one ack reader and
        one sender per rank stream plus the producer, so `max_connections` defaults to
        `pool_size_for(world_size)`; it is a BlockingConnectionPool, so a burst past it waits
        up to `pool_timeout` seconds for a free connection instead of failing with "Too many
        connections". A client passed in keeps its own pool."""
        if max_connections is None:
            max_connections = pool_size_for(job.world_size)
        return cls(client_or_url, job.job_id, config_hash=registry.config_hash(job),
                   world_size=job.world_size, mode=job.mode, seed=job.seed,
                   history_steps=history_steps, retries=retries, socket_timeout=socket_timeout,
                   fsync_publish=fsync_publish, max_connections=max_connections,
                   pool_timeout=pool_timeout)

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
        self.job_id, self.world_size, self.mode = job_id, rec.world_size, rec.mode
        self.keys = keys.JobKeys(job_id)
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

    def _raise_mapped(self, msg: str, rank: int | None = None) -> None:
        code, *rest = msg.split()
        job = self.job_id
        if code == "ODB_CONFLICT":
            raise StepConflict(f"job {job!r}: step {rest[0]} is already published with "
                               f"different content (steps are write-once)") from None
        if code == "ODB_END_CONFLICT":
            raise StepConflict(f"job {job!r}: epoch {rest[0]} already has a different END "
                               f"record") from None
        if code == "ODB_GAP":
            raise StepGap(f"job {job!r}: cannot publish step {rest[0]}, the next step to "
                          f"publish is {rest[1]} (steps are contiguous)") from None
        if code == "ODB_DONE":
            raise StepConflict(f"job {job!r} is marked done: no new steps") from None
        if code == "ODB_CKPT":
            what, got, bound = rest
            why = ("goes backwards from next_step" if what == "backwards"
                   else "claims steps that are not published; next unpublished step is")
            raise CheckpointConflict(f"job {job!r}: checkpoint next_step={got} {why} {bound}"
                                     ) from None
        if code == "ODB_HELD":
            exp_ms, now_ms, holder = int(rest[0]), int(rest[1]), " ".join(rest[2:])
            which = "a rank" if rank is None else f"rank {rank}"
            raise RankHeld(f"job {job!r}: {which} is held by client {holder!r} for "
                           f"{(exp_ms - now_ms) / 1000:.1f}s more (lease expires at "
                           f"{exp_ms / 1000:.3f} unix s)") from None
        if code == "ODB_AHEAD":
            raise AckAheadOfPlan(f"job {job!r}: ack of step {rest[0]} but only steps "
                                 f"through {rest[1]} are published") from None
        if code == "ODB_NOJOB":
            raise UnknownJob(f"job {job!r} is not registered in Redis (deleted?)") from None

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"job {self.job_id!r}: rank {rank} outside 0..{self.world_size - 1}")

    def _meta(self, field: str) -> bytes | None:
        with unavailable_as_error(self._where):
            return self.client.hget(self.keys.meta, field)

    # ------------------------------------------------------------ the plan
    def publish_steps(self, steps: Iterable[Step], checkpoint: PlannerCheckpoint | None = None,
                      epoch_ends: Iterable[EpochEnd] = ()) -> int:
        """Publish steps (and END records, and the planner checkpoint) in one atomic script.

        Steps must continue the plan contiguously; a step already published with identical
        content is a no-op, with different content StepConflict (checked inside Lua, so racing
        publishers can never create two plans for one step). Nothing is written unless
        everything is valid. Returns how many steps were new.
        """
        args: list[Any] = [self.keys.base, 0]
        count = 0
        for step in steps:
            header, blobs = step_codec.encode_step(step)
            for b in step.batches:
                self._check_rank(b.rank)
            args += [step.epoch, step.step, header, len(blobs)]
            for rank, blob in blobs:
                args += [rank, blob]
            count += 1
        args[1] = count
        ends = list(epoch_ends)
        args.append(len(ends))
        for end in ends:
            args += [end.epoch, step_codec.encode_epoch_end(end)]
        if checkpoint is None:
            args.append(0)
        else:
            args += [1, checkpoint.next_step, step_codec.encode_checkpoint(checkpoint)]
        k = self.keys
        ks = [k.meta, k.digests, k.ends, k.checkpoint]
        if not self.fsync_publish:
            new, _ = self._run(scripts.publish, ks, args)
            return int(new)
        # WAITAOF covers the writes of its own connection: send both in one pipeline (one
        # connection, one round trip).
        for attempt in (0, 1):
            with unavailable_as_error(self._where):
                pipe = self.client.pipeline(transaction=False)
                pipe.evalsha(scripts.publish.sha, len(ks), *ks, *args)
                pipe.execute_command("WAITAOF", 1, 0, 5000)
                res, waited = pipe.execute(raise_on_error=False)
            if isinstance(res, NoScriptError) and attempt == 0:
                with unavailable_as_error(self._where):
                    self.client.script_load(scripts.publish.source)
                continue
            if isinstance(res, Exception):
                self._raise_mapped(str(res))
                raise res
            if isinstance(waited, Exception) or int(waited[0]) < 1:
                raise DurabilityUnavailable(
                    f"job {self.job_id!r}: publish not confirmed fsynced (WAITAOF: {waited})")
            return int(res[0])
        raise AssertionError("unreachable")

    def publish_step(self, step: Step) -> None:
        self.publish_steps([step])

    def get_step(self, step: int) -> Step | None:
        """The whole step, or None if not published or already trimmed."""
        with unavailable_as_error(self._where):
            raw = self.client.hgetall(self.keys.step(step))
        if not raw:
            return None
        header = raw.pop(b"h")
        return step_codec.decode_step(header, {int(r): v for r, v in raw.items()})

    def get_step_for(self, step: int, ranks: Sequence[int]) -> Step | None:
        """The step restricted to `ranks`' batches (info stays the all-rank totals): one HMGET.

        Ranks without a batch at this step are simply absent, as in the full step.
        """
        with unavailable_as_error(self._where):
            raw = self.client.hmget(self.keys.step(step), ["h", *ranks])
        if raw[0] is None:
            return None
        h = step_codec.decode_header(raw[0])
        wanted = {r: blob for r, blob in zip(ranks, raw[1:], strict=True) if blob is not None}
        return Step(epoch=h["e"], step=h["n"], info=StepInfo(*h["i"]),
                     batches=tuple(step_codec.decode_batch(wanted[r], r)
                                   for r in h["r"] if r in wanted))

    def published_through(self) -> int:
        v = self._meta("published_through")
        if v is None:
            raise UnknownJob(f"job {self.job_id!r} is not registered in Redis (deleted?)")
        return int(v)

    def trimmed_through(self) -> int:
        """Steps <= this were acknowledged by every rank and dropped from Redis."""
        return int(self._meta("trimmed_through") or -1)

    def publish_epoch_end(self, end: EpochEnd) -> None:
        self.publish_steps([], epoch_ends=[end])

    def epoch_ends(self) -> list[EpochEnd]:
        with unavailable_as_error(self._where):
            raw = self.client.hgetall(self.keys.ends)
        return sorted((step_codec.decode_epoch_end(v) for v in raw.values()),
                      key=lambda e: e.epoch)

    def carried_over(self, epoch: int) -> tuple:
        """Quota mode: the samples epoch `epoch` carried into the next one (persisted in END)."""
        with unavailable_as_error(self._where):
            raw = self.client.hget(self.keys.ends, epoch)
        return step_codec.decode_epoch_end(raw).carried_over if raw else ()

    def epoch(self) -> int:
        return int(self._meta("epoch") or 0)

    def mark_done(self) -> None:
        with unavailable_as_error(self._where):
            self.client.hset(self.keys.meta, "state", "done")

    def is_done(self) -> bool:
        return self._meta("state") == b"done"

    # ------------------------------------------------------ planner position
    def save_checkpoint(self, checkpoint: PlannerCheckpoint) -> None:
        """CheckpointConflict if it goes backwards or its next_step is not yet published."""
        self.publish_steps([], checkpoint)

    def load_checkpoint(self) -> PlannerCheckpoint | None:
        with unavailable_as_error(self._where):
            raw = self.client.get(self.keys.checkpoint)
        return step_codec.decode_checkpoint(raw) if raw else None

    # --------------------------------------------------- ranks: leases, cursors
    def _ack_keys(self) -> list[str]:
        k = self.keys
        return [k.meta, k.acked, k.lease_exp, k.lease, k.lapsed, k.counters]

    def _ack(self, rank: int, client_id: str, lease_seconds: float, step: int,
             soft: bool = False) -> list:
        self._check_rank(rank)
        return self._run(scripts.ack, self._ack_keys(),
                         [self.keys.base, rank, client_id, _ms(lease_seconds), step,
                          "1" if soft else "0"], rank=rank)

    def claim_rank(self, rank: int, client_id: str, lease_seconds: float) -> RankLease:
        """Take or renew the lease; RankHeld while another client's lease is live. A restarted
        server re-claims with the same client_id at once, or any client after the lapse."""
        if not client_id:
            raise ValueError("client_id must be non-empty")
        exp, _ = self._ack(rank, client_id, lease_seconds, -1)
        return RankLease(rank, client_id, exp / 1000.0)

    def heartbeat(self, rank: int, client_id: str, lease_seconds: float) -> bool:
        """Renew (or retake after a lapse) the lease. Like MemoryJobState, a heartbeat from a
        client that lost the rank to another live client changes nothing and raises nothing;
        returns whether this client holds the lease now."""
        if not client_id:
            raise ValueError("client_id must be non-empty")
        exp, _ = self._ack(rank, client_id, lease_seconds, -1, soft=True)
        return int(exp) != -2

    def ack_heartbeat(self, rank: int, client_id: str, step: int,
                      lease_seconds: float) -> RankLease:
        """ack + heartbeat in one EVALSHA: the per-step call of a serving rank."""
        if not client_id:
            raise ValueError("client_id must be non-empty")
        exp, _ = self._ack(rank, client_id, lease_seconds, step)
        return RankLease(rank, client_id, exp / 1000.0)

    def ack_heartbeat_many(self, acks: Sequence[tuple[int, str, int]],
                           lease_seconds: float) -> None:
        """(rank, client_id, step) for several ranks a replica serves: one pipelined round trip.

        Not atomic across ranks (each rank's ack is); the first error is raised after all ran.
        """
        k = self.keys
        ks = self._ack_keys()
        for rank, _, _ in acks:
            self._check_rank(rank)
        for attempt in (0, 1):
            with unavailable_as_error(self._where):
                pipe = self.client.pipeline(transaction=False)
                for rank, cid, step in acks:
                    pipe.evalsha(scripts.ack.sha, len(ks), *ks, k.base, rank, cid,
                                 _ms(lease_seconds), step, "0")
                results = pipe.execute(raise_on_error=False)
            errors = [r for r in results if isinstance(r, Exception)]
            if attempt == 0 and any(isinstance(e, NoScriptError) for e in errors):
                # Acks are idempotent (cursor max, lease renew): reload and redo all.
                with unavailable_as_error(self._where):
                    self.client.script_load(scripts.ack.source)
                continue
            for (rank, _, _), res in zip(acks, results, strict=True):
                if isinstance(res, Exception):
                    self._raise_mapped(str(res), rank)
                    raise res
            return

    def release_rank(self, rank: int, client_id: str) -> None:
        self._check_rank(rank)
        self._run(scripts.release, [self.keys.lease, self.keys.lease_exp], [rank, client_id])

    def ack(self, rank: int, step: int) -> None:
        """Monotonic cursor (lower values ignored); AckAheadOfPlan past published_through."""
        if step < 0:
            return
        self._ack(rank, "", 0, step)

    def acked(self, rank: int) -> int:
        self._check_rank(rank)
        with unavailable_as_error(self._where):
            v = self.client.zscore(self.keys.acked, rank)
        return -1 if v is None else int(v)

    def acked_all(self) -> list[int]:
        """Every rank's cursor in one round trip (ZRANGE), index = rank."""
        with unavailable_as_error(self._where):
            rows = self.client.zrange(self.keys.acked, 0, -1, withscores=True)
        out = [-1] * self.world_size
        for member, score in rows:
            out[int(member)] = int(score)
        return out

    def lease(self, rank: int) -> RankLease | None:
        """The rank's current lease record (live or lapsed), None if never claimed/released."""
        self._check_rank(rank)
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            pipe.hget(self.keys.lease, rank)
            pipe.zscore(self.keys.lease_exp, rank)
            raw, exp = pipe.execute()
        if raw is None or exp is None:
            return None
        return RankLease(rank, raw.decode().partition(":")[2], float(exp) / 1000.0)

    def min_acked(self) -> int:
        """The slowest rank's cursor: steps after it are still needed by someone."""
        with unavailable_as_error(self._where):
            lo = self.client.zrange(self.keys.acked, 0, 0, withscores=True)
        return int(lo[0][1]) if lo else -1

    # ------------------------------------------------------------- failures
    def _lapsed(self, older_than_seconds: float) -> tuple[dict[int, float], set[int]]:
        offset_ms = round(older_than_seconds * 1000) if older_than_seconds > 0 else 0
        now, rows, history = self._run(scripts.lapsed, [self.keys.lease_exp, self.keys.lapsed],
                                       [offset_ms])
        live = {int(rows[i]): (int(now) - int(float(rows[i + 1]))) / 1000.0
                for i in range(0, len(rows), 2)}
        return live, {int(r) for r in history}

    def lapsed_ranks(self) -> list[int]:
        """Ranks whose lease expired without release: lapsed now, or lapsed and since taken
        over by another client (as MemoryJobState reports them). O(log W + k)."""
        live, history = self._lapsed(0)
        return sorted(set(live) | history)

    def timed_out_ranks(self, rank_timeout_seconds: float) -> dict[int, float]:
        """Ranks whose lease is lapsed *now* for longer than the timeout -> seconds lapsed.
        The server's cheap check (O(log W + k)) before telling waiting ranks that a peer is
        gone (Guarantee 4); a re-claimed rank is no longer listed."""
        return dict(sorted(self._lapsed(rank_timeout_seconds)[0].items()))

    def rank_health(self) -> list[RankHealth]:
        """Every rank's cursor, lease and heartbeat age at one instant (O(W), one EVALSHA)."""
        k = self.keys
        now_ms, acked, exps, leases = self._run(scripts.health, [k.acked, k.lease_exp, k.lease],
                                                [])
        acked_by = {int(acked[i]): int(float(acked[i + 1])) for i in range(0, len(acked), 2)}
        exp_by = {int(exps[i]): int(float(exps[i + 1])) for i in range(0, len(exps), 2)}
        lease_by: dict[int, tuple[int, str]] = {}
        for i in range(0, len(leases), 2):
            hb, _, cid = leases[i + 1].decode().partition(":")
            lease_by[int(leases[i])] = (int(hb), cid)
        out = []
        for r in range(self.world_size):
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

    # ------------------------------------------------------------- counters
    def add_counters(self, samples: int = 0, tokens: int = 0,
                     quarantined: Mapping[str, int] | None = None) -> None:
        """Bump the job's counters atomically (MULTI/EXEC, one round trip). A retry after a lost
        reply may count twice: these are metrics, not the ledger."""
        with unavailable_as_error(self._where):
            pipe = self.client.pipeline(transaction=True)
            if samples:
                pipe.hincrby(self.keys.counters, "samples_emitted", samples)
            if tokens:
                pipe.hincrby(self.keys.counters, "tokens_emitted", tokens)
            for reason, n in (quarantined or {}).items():
                pipe.hincrby(self.keys.counters, f"quarantined:{reason}", n)
            pipe.execute()

    def counters(self) -> dict[str, int]:
        with unavailable_as_error(self._where):
            raw = self.client.hgetall(self.keys.counters)
        return {k.decode(): int(v) for k, v in raw.items()}

    def close(self) -> None:
        self.client.close()
