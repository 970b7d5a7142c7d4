"""The job registry: which jobs exist, with what config, and where each one stands.

A job id is bound to its config hash, world size and mode the first time it registers. A
restart with the same three resumes; anything else is refused with a message that says what
differs, because silently serving a stale plan to a different config (or world size) would
break coverage and alignment. A `mode: refill` job registers too (`register_refill_job`: no
world size; its state is its `refill:*` keys), so every job of a Redis is listed, summarized,
expired and deleted the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from pipeline.config import (
    BatchingConfig,
    ComputeBalancingConfig,
    JobConfig,
    OrganizationConfig,
    TrainingJobConfig,
)
from pipeline.coordinator import keys, refill_scripts, scripts
from pipeline.errors import JobMismatch, SchemaMismatch
from pipeline.modes import JobMode


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    config_hash: str
    world_size: int
    mode: JobMode
    seed: int
    state: str  # "planning" | "done"
    epoch: int  # highest epoch with a published step or END
    published_through: int
    trimmed_through: int  # steps <= this are dropped (their digests stay, for write-once)
    checkpoint_next_step: int
    created_at: float  # unix seconds, Redis clock


# Who may call a job is no part of its plan: changing it never refuses a resume.
_NOT_HASHED = {"token_env", "allow_unauthenticated"}

# Options added after stored jobs were hashed, with the default those jobs ran under: at that
# default an option is left out of the hash, so the stored job's hash still matches.
_ADDED_LATER: dict[tuple[str, str], object] = {
    ("preprocess", "task_output_mb"): 64,
    ("batching", "compute_balancing"): ComputeBalancingConfig().model_dump(mode="json"),
    ("batching", "pad_to_multiple"): None,
    ("batching", "global_token_budget"): None,
}


# The source options that decide the order (pipeline/order/), added after stored jobs were
# hashed. Those jobs read their files in order with no mixture: a config that asks exactly
# that hashes as before, without them; any other order is part of the hash (defaults too: a
# later build that changed a default must not resume a job in another order).
_ORDER_OPTIONS = ("mixture", "mix_by", "epoch_samples", "schedule", "shuffle", "read_unit_rows",
                  "shuffle_block_rows", "shuffle_block_mb")


def _in_file_order(source: dict) -> bool:
    return (source.get("shuffle") is False and source.get("mixture") is None
            and source.get("epoch_samples") is None and not source.get("schedule")
            and source.get("mix_by", "samples") == "samples")


def config_hash(job: JobConfig) -> str:
    """What a job's plan depends on, hashed: everything in its config but the auth token's env
    var name. Same hash = the stored plan is valid for this config.

    Hashed in the shape of the one job model of earlier builds (the other kind's options at
    their defaults, as that model held them), so a job registered by an earlier build resumes.
    """
    if job.mode is JobMode.REFILL:
        earlier = {"world_size": 1, "elastic": False, "max_world_size": None,
                   "batching": BatchingConfig().model_dump(mode="json"),
                   "organization": OrganizationConfig().model_dump(mode="json")}
    else:
        earlier = {"refill": None}
    data = {**earlier, **job.model_dump(mode="json", exclude=_NOT_HASHED)}
    for (section, name), default in _ADDED_LATER.items():
        if data.get(section, {}).get(name) == default:
            del data[section][name]
    source = data.get("source", {})
    if job.mode is JobMode.REFILL or _in_file_order(source):  # (refill: requests, no order)
        for name in _ORDER_OPTIONS:
            source.pop(name, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def in_file_order(job: TrainingJobConfig) -> TrainingJobConfig:
    """The job reading its files in order, as builds before `source.shuffle` did."""
    return job.model_copy(update={"source": job.source.model_copy(update={"shuffle": False})})


def earlier_hash(job: TrainingJobConfig) -> str | None:
    """The hash a build before order existed registered this config with (it read the files in
    order), or None when that build could not have run it (a mixture, epoch_samples)."""
    src = job.source
    if src.mixture is not None or src.epoch_samples is not None:
        return None
    return config_hash(in_file_order(job))


def config_record(job: JobConfig) -> str:
    """The job's config as the registry keeps it beside its hash (meta `config`): what a
    refused resume is compared with, field by field."""
    return json.dumps(job.model_dump(mode="json", exclude=_NOT_HASHED), sort_keys=True)


def register_job(client: redis.Redis, job_id: str, *, config_hash: str, world_size: int,
                 mode: JobMode, seed: int = 0, config: str | None = None) -> bool:
    """Create the job, or verify a resume matches it. True if created, False if resumed.
    `config`: its `config_record`, kept to name what differs when a later config is refused."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    k = keys.JobKeys(job_id)
    mine = {"config_hash": config_hash, "world_size": world_size, "mode": mode}
    with _refusals(client, job_id, mine, config):
        created = scripts.register(
            client, [keys.SCHEMA_VERSION_KEY, keys.JOBS_KEY, k.meta, k.acked],
            [keys.SCHEMA_VERSION, job_id, config_hash, world_size, mode, seed])
    return bool(created)


def register_refill_job(client: redis.Redis, job_id: str, *, config_hash: str,
                        seed: int = 0, config: str | None = None) -> bool:
    """Create a `mode: refill` job, or verify a resume matches it. True if created."""
    mine = {"config_hash": config_hash, "mode": JobMode.REFILL}
    with _refusals(client, job_id, mine, config):
        created = refill_scripts.register_job(
            client, [keys.SCHEMA_VERSION_KEY, keys.JOBS_KEY, keys.JobKeys(job_id).meta],
            [keys.SCHEMA_VERSION, job_id, config_hash, seed])
    return bool(created)


def _differences(stored: dict, mine: dict, path: str = "") -> list[str]:
    """`field (stored value in Redis, this value here)` for every leaf that differs."""
    out = []
    for key in sorted(set(stored) | set(mine)):
        a, b = stored.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{path}{key}.")
        elif a != b:
            out.append(f"{path}{key} ({json.dumps(a)} in Redis, {json.dumps(b)} here)")
    return out


def _config_differences(client: redis.Redis, job_id: str, config: str | None) -> str:
    stored = client.hget(keys.JobKeys(job_id).meta, "config")
    if stored is None or config is None:
        return ("another config (which fields differ is unknown: the job was registered by an "
                "earlier build)")
    diffs = _differences(json.loads(stored), json.loads(config))
    shown = diffs[:8] + ([f"{len(diffs) - 8} more"] if len(diffs) > 8 else [])
    return "another config: " + ", ".join(shown or ["fields this build does not hash"])


@contextmanager
def _refusals(client: redis.Redis, job_id: str, mine: dict[str, object],
              config: str | None) -> Iterator[None]:
    """The registration scripts' refusals as SchemaMismatch / JobMismatch; a registration
    that went through keeps `config` (the first one's stays)."""
    try:
        yield
        if config is not None:
            client.hsetnx(keys.JobKeys(job_id).meta, "config", config)
    except redis.ResponseError as exc:
        msg = str(exc)
        if msg.startswith("ODB_SCHEMA"):
            raise SchemaMismatch(
                f"Redis holds coordinator schema v{msg.split()[1]}, this build speaks "
                f"v{keys.SCHEMA_VERSION}: migrate it or use another Redis/db") from None
        if msg.startswith("ODB_JOB"):
            _, field, stored = msg.split(maxsplit=2)
            if field == "config_hash":
                raise JobMismatch(
                    f"job {job_id!r} exists in Redis with "
                    f"{_config_differences(client, job_id, config)}: refused (its plan was "
                    "made for the config in Redis)", job_id=job_id) from None
            hint = ("a resume must use the world size the job started with"
                    if field == "world_size" else "a job keeps its mode")
            raise JobMismatch(
                f"job {job_id!r} exists in Redis with {field}={stored}, this server has "
                f"{field}={mine[field]}: refused ({hint})", job_id=job_id) from None
        raise


def _int(v: bytes | None, default: int = 0) -> int:
    return int(v) if v is not None else default


def read_job(client: redis.Redis, job_id: str) -> JobRecord | None:
    m = client.hgetall(keys.JobKeys(job_id).meta)
    if not m:
        return None
    g = {k.decode(): v for k, v in m.items()}
    return JobRecord(
        job_id=job_id,
        config_hash=g["config_hash"].decode(),
        world_size=_int(g["world_size"]),
        mode=JobMode(g["mode"].decode()),
        seed=_int(g.get("seed")),
        state=g["state"].decode(),
        epoch=_int(g.get("epoch")),
        published_through=_int(g.get("published_through"), -1),
        trimmed_through=_int(g.get("trimmed_through"), -1),
        checkpoint_next_step=_int(g.get("ckpt_next_step")),
        created_at=_int(g.get("created_ms")) / 1000.0,
    )


def list_jobs(client: redis.Redis) -> list[str]:
    """Registered jobs whose state still exists (a job given a TTL drops out once it expires)."""
    ids = sorted(j.decode() for j in client.smembers(keys.JOBS_KEY))
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.exists(keys.JobKeys(job_id).meta)
    return [j for j, alive in zip(ids, pipe.execute(), strict=True) if alive]


def _job_keys(client: redis.Redis, job_id: str) -> list[str]:
    k = keys.JobKeys(job_id)
    rec = read_job(client, job_id)
    if rec is not None and rec.mode is JobMode.REFILL:  # + each consumer's held and lost sets
        consumers = [key.decode() for key in client.scan_iter(match=f"{k.base}refill:*:*",
                                                              count=1000)]
        return [k.meta, *k.refill_keys(), *consumers]
    steps = []
    if rec is not None:
        steps = [k.step(n) for n in range(rec.trimmed_through + 1, rec.published_through + 1)]
    return k.fixed() + k.organization_keys() + steps


def live_holders(client: redis.Redis, job_id: str) -> list[str]:
    """Who holds a live lease of the job now (Redis clock): its producer, its ranks (a training
    job) or its consumers (a refill job). Deleting a job under them would pull its state from
    under a running service."""
    k = keys.JobKeys(job_id)
    sec, usec = client.time()
    now_ms = sec * 1000 + usec // 1000
    rec = read_job(client, job_id)
    if rec is not None and rec.mode is JobMode.REFILL:
        meta, leases, what = k.refill_meta, k.refill_consumers, "consumer"
        producer = client.hmget(meta, "producer", "producer_exp")
    else:
        leases, what = k.lease_exp, "rank"
        producer = client.hmget(k.meta, "producer_holder", "producer_exp")
    holder, exp = producer
    out = [f"producer {holder.decode()}"] if holder and exp and int(exp) > now_ms else []
    live = client.zrangebyscore(leases, f"({now_ms}", "+inf")
    return out + [f"{what} {m.decode()}" for m in live]


def delete_job(client: redis.Redis, job_id: str) -> None:
    """Remove every key of the job (operator action; a running server would re-create it)."""
    ks = _job_keys(client, job_id)
    pipe = client.pipeline(transaction=True)
    for i in range(0, len(ks), 1000):
        pipe.unlink(*ks[i:i + 1000])
    pipe.srem(keys.JOBS_KEY, job_id)
    pipe.execute()


def expire_job(client: redis.Redis, job_id: str, seconds: int) -> None:
    """Give a finished job a TTL: its state is transient once every rank is done with it."""
    ks = _job_keys(client, job_id)
    pipe = client.pipeline(transaction=True)
    for key in ks:
        pipe.expire(key, seconds)
    pipe.execute()
