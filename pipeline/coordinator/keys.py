"""The key schema (docs/redis-schema.md), in one place, with its version.

Every key of a job carries the job id in a hash tag (`{job}`), so a job's keys share one Redis
Cluster slot and its multi-key Lua scripts would stay legal there (REGISTER aside, which also
touches the two global keys; the supported deployment is one Redis). The `v1` in the prefix is
the schema version: a future incompatible layout gets `odb:v2:` keys and a migration that reads
`v1`; `odb:schema_version` says which one a Redis holds, checked when a job registers.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 1
ROOT = "odb"
PREFIX = f"{ROOT}:v{SCHEMA_VERSION}"
SCHEMA_VERSION_KEY = f"{ROOT}:schema_version"  # string "1"
JOBS_KEY = f"{PREFIX}:jobs"  # set of job ids (the registry index)


@dataclass(frozen=True)
class JobKeys:
    """The keys of one job. Step keys are derived from `base` inside Lua (`<base>step:<n>`)."""

    job_id: str

    @property
    def base(self) -> str:
        return f"{PREFIX}:{{{self.job_id}}}:"

    @property
    def meta(self) -> str:  # hash: config, progress scalars, the producer lease, epoch starts
        return self.base + "meta"

    def step(self, n: int) -> str:  # hash: "h" -> header, "<rank>" -> that rank's batch
        return f"{self.base}step:{n}"

    @property
    def digests(self) -> str:  # hash: step -> sha1 of the encoded step (kept after trimming)
        return self.base + "digests"

    @property
    def ends(self) -> str:  # hash: epoch -> encoded EpochEnd
        return self.base + "ends"

    @property
    def checkpoint(self) -> str:  # string: encoded PlannerCheckpoint
        return self.base + "ckpt"

    @property
    def acked(self) -> str:  # zset: rank -> last acknowledged step (-1 = none)
        return self.base + "acked"

    @property
    def lease_exp(self) -> str:  # zset: rank -> lease expiry (ms, Redis clock)
        return self.base + "lease_exp"

    @property
    def lease(self) -> str:  # hash: rank -> "<last heartbeat ms>:<client_id>"
        return self.base + "lease"

    @property
    def lease_claim(self) -> str:  # hash: rank -> its claims (Opens) so far: the latest's number
        return self.base + "lease_claim"

    @property
    def lapsed(self) -> str:  # set: ranks whose lease lapsed and was then taken over
        return self.base + "lapsed"

    @property
    def claimed(self) -> str:  # set: ranks that ever held a lease (a never-connected rank is not)
        return self.base + "claimed"

    # --- model-parallel groups (lua/lib/group.lua): written by MEMBER_ACK_MANY, MEMBER_RELEASE ---
    @property
    def groups(self) -> str:  # hash: rank -> "<group size>:<absent_until ms>"
        return self.base + "groups"

    @property
    def members(self) -> str:  # hash: "<rank>:<member>" -> "<last sign ms>:<client_id>"
        return self.base + "members"  # ('' client: released; no field: never taken)

    @property
    def member_exp(self) -> str:  # hash: "<rank>:<member>" -> its lease expiry (ms)
        return self.base + "member_exp"

    @property
    def member_acked(self) -> str:  # hash: "<rank>:<member>" -> its last acknowledged step
        return self.base + "member_acked"

    @property
    def counters(self) -> str:  # hash: counter name -> integer
        return self.base + "counters"

    @property
    def quarantine_ids(self) -> str:  # set: sample ids ever quarantined (each counted once)
        return self.base + "qids"

    @property
    def quarantine(self) -> str:  # list: the first records quarantined, bounded
        return self.base + "quarantine"

    @property
    def sdo(self) -> str:  # hash (SDO jobs): organization, ledger, summary, next_epoch
        return self.base + "sdo"

    @property
    def sdo_visits(self) -> str:  # hash (SDO jobs): epoch -> that epoch's visits (write-once)
        return self.base + "sdo_visits"

    # --- worlds (reconfiguration, docs/elastic.md): written by SCALE, GRANT, LEFT, PUBLISH ---
    @property
    def worlds(self) -> str:  # hash: generation -> world record (JSON, with its boundary)
        return self.base + "worlds"

    @property
    def grants(self) -> str:  # zset: rank of the current world -> highest step it may be sent
        return self.base + "grants"

    @property
    def draining(self) -> str:  # hash: rank of the ended world still draining -> its client
        return self.base + "draining"

    @property
    def world_times(self) -> str:  # hash: "<g>:requested|adopted", "<g>:first|left:<r>" -> ms
        return self.base + "world_times"

    @property
    def pending_ends(self) -> str:  # hash: epoch -> encoded EpochEnd held until revealed
        return self.base + "pending_ends"

    @property
    def fsyncs(self) -> str:  # string: a counter a durable call writes before its WAITAOF
        return self.base + "fsyncs"

    @property
    def compute(self) -> str:  # list: the newest compute reports "<world>,<step>,<rank>,<s>"
        return self.base + "compute"

    @property
    def compute_total(self) -> str:  # string: compute reports ever recorded
        return self.base + "compute_total"

    @property
    def compute_fit(self) -> str:  # string: the compute fit's status (JSON, the producer's)
        return self.base + "compute_fit"

    @property
    def mix(self) -> str:  # hash: the latest mixture change asked for: seq, weights (JSON), ms
        return self.base + "mix"

    @property
    def sources(self) -> str:  # string: each mixture source's part of the plan (JSON, producer's)
        return self.base + "sources"

    def fixed(self) -> list[str]:
        """Every job's keys except the per-step ones (those are found from meta's step range)
        and the SDO ones (`organization_keys`)."""
        return [self.meta, self.digests, self.ends, self.checkpoint, self.acked,
                self.lease_exp, self.lease, self.lease_claim, self.lapsed, self.claimed,
                self.counters,
                self.quarantine_ids, self.quarantine, self.worlds, self.grants, self.draining,
                self.world_times, self.pending_ends, self.fsyncs, self.compute,
                self.compute_total, self.compute_fit, self.groups, self.members,
                self.member_exp, self.member_acked, self.mix, self.sources]

    # --- refill jobs (docs/refill.md): written by the scripts coordinator/lua/refill_*.lua ---
    @property
    def refill_meta(self) -> str:  # hash: producer lease, source position (epoch, cursor),
        return self.base + "refill:meta"  # exhausted flag

    @property
    def refill_info(self) -> str:  # hash: request id -> "cost,seq,over,prompt,generation"
        return self.base + "refill:info"

    @property
    def refill_payload(self) -> str:  # hash: request id -> prompt input_ids, raw int32 LE
        return self.base + "refill:req"

    @property
    def refill_pixels(self) -> str:  # hash: request id -> its prompt's images (refill_state)
        return self.base + "refill:pixels"

    @property
    def refill_waiting(self) -> str:  # zset: admissible request id -> seq (arrival order)
        return self.base + "refill:wait"

    @property
    def refill_owner(self) -> str:  # hash: leased request id -> consumer id
        return self.base + "refill:owner"

    def refill_held(self, consumer: str) -> str:  # set: ids leased to one consumer (in Lua too)
        return f"{self.base}refill:held:{consumer}"

    def refill_lost(self, consumer: str) -> str:  # set: ids taken from it at its lease's lapse,
        return f"{self.base}refill:lost:{consumer}"  # reported `revoked` by its next ask (Lua)

    @property
    def refill_consumers(self) -> str:  # zset: consumer id -> lease expiry (ms, Redis clock)
        return self.base + "refill:consumers"

    @property
    def refill_calls(self) -> str:  # hash: consumer id -> its last ask's reply, JSON (retries)
        return self.base + "refill:calls"

    @property
    def refill_done(self) -> str:  # hash: completed request id -> the consumer that did it
        return self.base + "refill:done"

    @property
    def refill_counters(self) -> str:  # hash: enqueued, admitted, readmitted, lease_lapses,
        # quarantined, reason:<reason>, e<epoch>:enqueued|completed|quarantined
        return self.base + "refill:counters"

    @property
    def refill_quarantine(self) -> str:  # list: the first records set aside, bounded (JSON)
        return self.base + "refill:quarantine"

    def refill_keys(self) -> list[str]:
        """The keys only a refill job has (but the per-consumer held and lost sets)."""
        return [self.refill_meta, self.refill_info, self.refill_payload, self.refill_pixels,
                self.refill_waiting, self.refill_owner, self.refill_consumers, self.refill_calls,
                self.refill_done, self.refill_counters, self.refill_quarantine]

    def organization_keys(self) -> list[str]:
        """The keys only an SDO job has (its producer writes them: `RedisLedgerStore`)."""
        return [self.sdo, self.sdo_visits]
