"""`JobState`: the seam between a job's producer, the serving replicas and where the job's shared
state lives. The docstrings below are the contract; every implementation passes the same
contract tests (tests/jobstate/).

Owns the plain values that cross the seam (leases, checkpoints, publications, counters,
quarantine entries). Knows nothing of gRPC, Ray or Redis: `MemoryJobState` (jobstate/memory.py)
keeps the state in one process, `RedisJobState` (pipeline/coordinator/) in Redis, where any
replica and a restarted producer find it.

Who writes what:
- the job's one producer: `publish` (steps, END records, checkpoint, counters, quarantine — one
  atomic change, fenced by its lease generation and by the world it planned for),
  `claim_producer`/`renew_producer`, `set_error`;
- replicas serving ranks: rank leases and cursors on their clients' evidence (`claim_rank` at
  an Open, `ack_many` for their acks and heartbeats, `release_rank`), delivery grants (`grant`)
  and a drained rank's exit (`rank_left`); `ack` moves a cursor alone (tools);
- a reconfiguration (`scale`: an operator's request, an elastic Open, the shrink policy) ends
  the current world at a boundary and starts the next (worlds.py, docs/elastic.md);
- everybody reads.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.errors import RankHeld
from pipeline.jobstate.worlds import Grant, PlanHead, ScaleRequest, ScaleResult, World, WorldTimings
from pipeline.modes import JobMode
from pipeline.planner.types import EpochEnd, Step
from trainer_client.wire_format import MAX_GROUP_SIZE as WIRE_MAX_GROUP_SIZE


@dataclass(frozen=True)
class RankLease:
    rank: int
    client_id: str
    expires_at: float  # unix seconds (the state's clock)
    claim: int = 0  # which claim of the rank (an Open) this is: they are counted per rank


# The most clients one rank's group may have (tensor x context x pipeline parallel members):
# every sign of life of a member reads its group's seats (O(group_size)). The wire's bound.
MAX_GROUP_SIZE = WIRE_MAX_GROUP_SIZE


@dataclass(frozen=True)
class Member:
    """A client's seat in its rank's model-parallel group (docs/trainer-client.md): member
    `index` of the `group_size` clients (the tensor/context/pipeline-parallel ranks of one
    data-parallel rank) that all receive the rank's batches.

    The group holds the rank's one lease: it is live while every seat is (a member's lease is
    renewed on its own evidence, like a rank's; a seat nobody took yet counts as live for
    `lease_seconds` from the group's first claim, a seat whose member released stops counting),
    so a lost member is a lost rank to the failure policy. The rank's cursor is the group's:
    it moves to the lowest of the members' acks (acks count once), so payloads are released
    only when every member has them, and a member that resumes alone gets the group's position.
    A group of one is a rank's plain lease (`None` in the calls below). Two clients disagreeing
    on a rank's group size while one holds a live seat: `GroupRefused`, naming both."""

    index: int
    group_size: int

    def __post_init__(self) -> None:
        if not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size must be in [1, {MAX_GROUP_SIZE}], got "
                             f"{self.group_size}")
        if not 0 <= self.index < self.group_size:
            raise ValueError(f"group_rank must be in [0, group_size={self.group_size}), got "
                             f"{self.index}")


def grouped(member: Member | None) -> bool:
    """True for a seat of a group of two or more (a group of one is the rank's plain lease)."""
    return member is not None and member.group_size > 1


# The holder a grouped rank's lease names (`RankHealth.client_id`); no client id has this form
# (`world_open` refuses client ids with the prefix).
GROUP_HOLDER_PREFIX = "group:"


def group_holder(group_size: int) -> str:
    return f"{GROUP_HOLDER_PREFIX}{group_size}"


@dataclass(frozen=True)
class RankAck:
    """What a rank's stream reports for its client (`JobState.ack_many`): a sign of life from
    `client_id` (it renews the rank's lease; with `renew` False only if the client does not
    hold it live: a replica renews on an ack every so often, not at every one) and, when
    `step` >= 0, that the rank consumed every step through `step` (-1: nothing new, a
    heartbeat)."""

    rank: int
    client_id: str
    step: int = -1
    renew: bool = True
    member: Member | None = None  # its seat in the rank's group (None: the rank's own lease)


# Compute reports a job keeps (the newest): the fit's window is at most this.
COMPUTE_REPORTS_KEPT = 4096


@dataclass(frozen=True)
class RankCompute:
    """A trainer's measured compute seconds for its batch of `step`, reported by rank `rank` of
    world `world` (compute balancing, docs/compute-balancing.md). Kept as reported: the fit
    rejects and counts nonsense."""

    world: int
    step: int
    rank: int
    seconds: float


@dataclass(frozen=True)
class ComputeFitStatus:
    """What a job's compute fit stands at (the producer writes it, `status` shows it).

    `coefficients` (seconds per unit of each `compute_fit.FEATURES` entry), `error` and
    `reports`: the model in force, empty/0 while the gate is closed (ranks balanced by tokens);
    `last_error`: the latest fit's held-out error, passed or not (-1: none yet); `imbalance`:
    per step, max/mean of the ranks' measured compute, the newest steps whose ranks all
    reported (oldest first: `(step, ratio)`). JSON keys of the rank maps are strings."""

    gate_open: bool = False
    coefficients: tuple[float, ...] = ()
    error: float = 0.0
    reports: int = 0
    last_error: float = -1.0
    accepted: int = 0
    rejected: int = 0
    warmup: int = 0
    stale: int = 0  # reports of an ended world, ignored
    drifts: int = 0
    fit_failures: int = 0  # fits the arithmetic could not carry (the model in force stayed)
    imbalance: tuple[tuple[int, float], ...] = ()
    # The newest fully reported step: each rank's measured seconds and those predicted by the
    # model the step was balanced by (none for a step balanced by tokens).
    last_step: int = -1
    last_measured: Mapping[int, float] = field(default_factory=dict)
    last_predicted: Mapping[int, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__dataclass_fields__})

    @classmethod
    def from_json(cls, data: str | bytes) -> ComputeFitStatus:
        d = json.loads(data)
        d["coefficients"] = tuple(d["coefficients"])
        d["imbalance"] = tuple((int(n), float(r)) for n, r in d["imbalance"])
        for k in ("last_measured", "last_predicted"):
            d[k] = {int(r): float(v) for r, v in d.get(k, {}).items()}
        return cls(**d)


@dataclass(frozen=True)
class MixRequest:
    """A change of a mixture's weights asked for while the job runs (`odb-pipeline mix`): the
    producer applies it at its next step boundary, once (`seq` orders the requests)."""

    seq: int
    weights: Mapping[str, float]
    requested_at: float  # unix seconds


@dataclass(frozen=True)
class SourceShare:
    """One mixture source in the current epoch's plan: what its published steps hold, what its
    share should be, and its records quarantined this epoch."""

    name: str
    samples: int = 0
    loss_tokens: int = 0
    quarantined: int = 0
    target: float = 0.0  # its share of the samples (mix_by samples) or loss tokens in force


@dataclass(frozen=True)
class SourceStatus:
    """Each source's part of a mixture job's plan this epoch (the producer writes it after each
    publication, `status` shows it): counted in `mix_by`; `changes` are the epoch's mixture
    changes as (first step, by, weights)."""

    epoch: int
    mix_by: str
    sources: tuple[SourceShare, ...]
    changes: tuple[tuple[int, str, tuple[tuple[str, float], ...]], ...] = ()

    def share(self, i: int) -> float:
        """Source i's share so far, in `mix_by` (0 before anything is planned)."""
        key = "samples" if self.mix_by == "samples" else "loss_tokens"
        total = sum(getattr(s, key) for s in self.sources)
        return getattr(self.sources[i], key) / total if total else 0.0

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "mix_by": self.mix_by,
                           "sources": [s.__dict__ for s in self.sources],
                           "changes": [[n, by, [list(w) for w in ws]]
                                       for n, by, ws in self.changes]})

    @classmethod
    def from_json(cls, data: str | bytes) -> SourceStatus:
        d = json.loads(data)
        return cls(int(d["epoch"]), d["mix_by"], tuple(SourceShare(**s) for s in d["sources"]),
                   tuple((int(n), str(by), tuple((str(a), float(w)) for a, w in ws))
                         for n, by, ws in d["changes"]))


@dataclass(frozen=True)
class RankHealth:
    """One rank as the failure policy and operators see it (times: the state's clock)."""

    rank: int
    acked: int  # last acknowledged step, -1 if none
    client_id: str | None  # lease holder (None: never claimed, or released)
    lease_expires_at: float | None
    heartbeat_age: float | None  # seconds since the holder's last claim/heartbeat/ack
    lapsed_for: float  # seconds since the lease expired; 0.0 while live or without a lease

    @property
    def lapsed(self) -> bool:
        return self.lapsed_for > 0.0


@dataclass(frozen=True)
class MemberHealth:
    """One seat of a rank's group (times: the state's clock). `client_id` None: nobody took
    the seat yet, or its member released it (`released`)."""

    index: int
    client_id: str | None
    lease_expires_at: float | None
    heartbeat_age: float | None  # seconds since the member's last claim/heartbeat/ack
    lapsed_for: float  # seconds since its lease expired; 0.0 while live or without one
    acked: int  # the last step this member acknowledged
    released: bool = False


@dataclass(frozen=True)
class GroupHealth:
    """A rank served to a model-parallel group: its size and every seat."""

    rank: int
    group_size: int
    members: tuple[MemberHealth, ...]


@dataclass(frozen=True)
class ProducerLease:
    """Who may publish the job's plan. `generation` is the fencing token: it grows by one at
    every change of holder, and a publish with an older generation is refused (`Fenced`).
    `live`: not expired when read, judged on the state's clock (as every lease is: a reader's
    own clock may run ahead or behind)."""

    generation: int
    holder: str
    expires_at: float  # unix seconds (the state's clock)
    live: bool


@dataclass(frozen=True)
class ProducerFailure:
    """What the job's producer failed on (`cause`: a label of `pipeline.producer.failures.Cause`).

    Permanent: it does not heal by retrying. Every stream ends with it and no replica re-creates
    the producer until one starts again (`clear_error`: the operator's act). Transient
    ("trouble"): the producer retries with backoff and streams keep waiting; the producer's next
    publication clears it. `since` (state clock) is when it was recorded (a transient streak:
    its first failure), `attempts` how many failures the streak has had."""

    message: str
    cause: str
    permanent: bool
    since: float
    attempts: int = 1


@dataclass(frozen=True)
class PlannerCheckpoint:
    """Where planning continues after a restart: the input position (`epoch`, positions of its
    order already fed), the planner's own state (window, pool, carry: JSON bytes) and the
    order's cursor beyond its position (`order`: the mixture changes in force, JSON bytes;
    empty when the mixture never changed)."""

    epoch: int
    samples_consumed: int  # positions of `epoch`'s order (rows) already fed to the planner
    next_step: int  # the next step number the planner will publish
    state: bytes = b""
    world: int = 0  # the world generation the planner state is for
    order: bytes = b""  # OrderCursor.extras() (pipeline/order/cursor.py)

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.samples_consumed)


@dataclass(frozen=True)
class QuarantineEntry:
    """A record set aside, with a reason from `pipeline.quarantine.Reason` (a bounded label)
    and the human-readable detail."""

    sample_id: str
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Publication:
    """One atomic change of the plan by the producer: new steps, END records, the checkpoint
    that produced them, what the input yielded since the previous publication, and whether
    planning is over. Applied all or nothing; a publication whose checkpoint position equals the
    stored one is a retry and changes nothing (so counters never count twice). Every step and
    END carries the world it was planned for (`check_stamps`)."""

    checkpoint: PlannerCheckpoint
    steps: tuple[Step, ...] = ()
    ends: tuple[EpochEnd, ...] = ()
    samples_in: int = 0  # source rows that became samples since the previous publication
    quarantined: tuple[QuarantineEntry, ...] = ()
    done: bool = False

    def check_stamps(self) -> None:
        """ValueError unless every step and END is stamped with the checkpoint's world (the
        planner stamps what it emits: `WorldStamp`)."""
        for what, n, world in ([("step", s.step, s.world) for s in self.steps]
                               + [("END of epoch", e.epoch, e.world) for e in self.ends]):
            if not world.stamped or world.generation != self.checkpoint.world:
                raise ValueError(f"{what} {n} is stamped for world {world.generation} of "
                                 f"{world.size} ranks, the publication's checkpoint is for "
                                 f"world {self.checkpoint.world}")


@dataclass(frozen=True)
class JobCounters:
    """Job-wide counts, exact whatever the number of replicas (written with the plan)."""

    samples_in: int = 0  # source rows that became samples (every epoch)
    samples_planned: int = 0  # samples in published steps (fillers excluded)
    tokens_planned: int = 0
    quarantined: int = 0  # distinct records ever quarantined
    quarantined_by_reason: Mapping[str, int] = field(default_factory=dict)
    lease_lapses: int = 0


class JobState(ABC):
    """One job's shared state. `job_id` and `mode` are fixed at registration; `world_size` is
    the current world's (the registered one until a reconfiguration, `scale`)."""

    job_id: str
    world_size: int
    mode: JobMode

    # --- the plan (write-once, contiguous steps) ---
    @abstractmethod
    def publish(self, publication: Publication, *, fence: int) -> int:
        """Apply `publication` atomically if `fence` is the current producer generation and its
        lease is live (else `Fenced`). Steps must continue the plan contiguously (`StepGap`); a
        step (or an epoch's END) already published identically is a no-op, differently
        `StepConflict` (also within one publication); neither the checkpoint's input position
        nor its `next_step` may go backwards, nor `next_step` pass the published steps
        (`CheckpointConflict`). The checkpoint's `world` must be the current world generation
        (else `WorldChanged`: a reconfiguration ended the world it planned for); the first
        publication for a new world adopts it (`scale` is refused until then). A batch for a
        rank outside the current world, or two for one rank, or a step or END not stamped with
        the checkpoint's world (`Publication.check_stamps`) is a ValueError. Returns the number
        of new steps. A publication clears the producer's transient failure."""

    @abstractmethod
    def reveal(self, *, fence: int) -> int:
        """Make every publication visible once it is durable: where publications are held
        until confirmed on disk (`fsync_publish`), the current producer calls this when it
        starts or finds the visible plan behind what it published (a crash between a
        publication and its reveal); elsewhere publications are visible at once and this
        changes nothing. `Fenced` for an old generation. Returns `published_through`."""

    @abstractmethod
    def get_step(self, step: int) -> Step | None:
        """The published step, None if not published (or trimmed)."""

    @abstractmethod
    def get_step_for(self, step: int, ranks: Sequence[int]) -> Step | None:
        """The step with only `ranks`' batches (info keeps the all-rank totals); None if not
        published. What a replica reads: never the other ranks' batches."""

    def get_steps_for(self, wanted: Sequence[tuple[int, Sequence[int]]]) -> list[Step | None]:
        """`get_step_for` of each (step, ranks), in order; a remote state reads them all in one
        round trip."""
        return [self.get_step_for(n, ranks) for n, ranks in wanted]

    @abstractmethod
    def published_through(self) -> int:
        """Highest published step number, -1 if none."""

    @abstractmethod
    def trimmed_through(self) -> int:
        """Steps <= this are dropped from the state (every rank is past their epoch)."""

    @abstractmethod
    def epoch_ends(self) -> list[EpochEnd]:
        """Published END records, by epoch."""

    @abstractmethod
    def is_done(self) -> bool:
        """Every epoch is planned: no step will ever be published again."""

    @abstractmethod
    def load_checkpoint(self) -> PlannerCheckpoint | None: ...

    # --- the producer lease (fencing) ---
    @abstractmethod
    def claim_producer(self, holder: str, lease_seconds: float) -> int | None:
        """Become the job's producer: returns the new generation, or None while another holder's
        lease is live. The same holder re-claiming (a restarted actor) takes over at once."""

    @abstractmethod
    def renew_producer(self, generation: int, lease_seconds: float) -> None:
        """Extend the lease of `generation`; `Fenced` if it is no longer current."""

    @abstractmethod
    def release_producer(self, generation: int) -> None:
        """Give the lease up (a no-op unless `generation` is current)."""

    @abstractmethod
    def producer_lease(self) -> ProducerLease | None: ...

    @abstractmethod
    def claim_producer_restart(self, actor_id: str, process: int) -> bool:
        """Take the restart of the producer actor's process `process` (how many times Ray had
        restarted the actor): True for the first claim only, False once that process or a later
        one of the same actor was claimed. Every replica supervises the producer; each stuck
        process is restarted once."""

    @abstractmethod
    def set_error(self, message: str, *, fence: int, cause: str = "internal",
                  transient: bool = False) -> None:
        """Record a producer failure (`ProducerFailure`), fenced like a publish. Permanent (the
        default): every replica reports `message` to the ranks, and a transient record goes.
        `transient`: the producer retries; a repeat of the streak counts an attempt and keeps
        its first time; the next publication clears it."""

    @abstractmethod
    def error(self) -> str | None:
        """The permanent failure's message (what streams end with), None if there is none."""

    @abstractmethod
    def producer_failure(self) -> ProducerFailure | None:
        """The permanent failure if any, else the transient one, else None."""

    @abstractmethod
    def clear_error(self) -> ProducerFailure | None:
        """Forget a permanent failure (a replica starting: the operator's act, so the job's
        producer gets one more try); returns what was cleared. Needs no fence."""

    # --- ranks: leases, cursors ---
    # Cursors, health and lapses are the current world's ranks. Leases also cover the ranks of
    # the world a reconfiguration just ended (they drain to their last step): a rank is valid
    # for a lease below the larger of the two world sizes.
    @abstractmethod
    def claim_rank(self, rank: int, client_id: str, lease_seconds: float, *,
                   member: Member | None = None) -> RankLease:
        """Take or renew the rank's lease (a stream's Open); `RankHeld` if another client's
        lease is live. Each claim of the rank gets the next number (`RankLease.claim`).
        With `member` (a group of two or more, `Member`): take or renew that seat, forming
        the rank's group (its seats' acks start at the rank's cursor) when no live seat holds
        it; `RankHeld` if another client holds the seat live; `GroupRefused` if the rank is
        held live by a client alone or by a group of another size (the message names both).
        The returned lease is the client's own (its seat's, its claims counted per seat)."""

    @abstractmethod
    def release_rank(self, rank: int, client_id: str, claim: int | None = None, *,
                     member: Member | None = None) -> None:
        """Only the holder can release; releasing is not a lapse. With `claim`, only while
        that is still the rank's latest claim: a holder whose stream vanished from one replica
        and that claimed the rank again (on any replica) is alive, and keeps its lease. A
        member releases its seat (`claim`: the seat's latest): the seat stops counting for
        the group's lease; once no seat is held the group ends (the rank's lease goes)."""

    @abstractmethod
    def group_health(self) -> list[GroupHealth]:
        """The current world's ranks served to groups, with every seat, at one instant."""

    def heartbeat(self, rank: int, client_id: str, lease_seconds: float, *,
                  member: Member | None = None) -> bool:
        """Renew (or retake after a lapse); True if `client_id` holds the lease now, False if
        another client's lease is live (nothing changes). One heartbeat of `ack_many`."""
        (error,) = self.ack_many([RankAck(rank, client_id, member=member)], lease_seconds)
        if isinstance(error, RankHeld):
            return False
        if error is not None:
            raise error
        return True

    @abstractmethod
    def ack(self, rank: int, step: int) -> None:
        """Rank consumed everything through `step` (monotonic: lower values, -1 included, are
        ignored), whatever its lease and grant (an operator's or a test's tool: streams use
        `ack_many`); `AckAheadOfPlan` past the published plan; ValueError for a rank outside
        the world, whatever the step."""

    @abstractmethod
    def ack_many(self, acks: Sequence[RankAck], lease_seconds: float) -> list[Exception | None]:
        """Rank streams' acks and heartbeats in one round trip; per ack its error or None (not
        atomic across acks; each is checked before anything of it is written). Each is evidence
        of life from its client: the rank's lease is renewed for `lease_seconds` (taken if
        nobody holds a live one; taking over another client's lapsed lease counts as a lapse)
        unless another client holds a live lease: `RankHeld`, nothing changes (the stream of a
        client whose lease was taken ends). With `step` >= 0 the rank's cursor moves there
        (monotonic), unless the step is past the published plan (`AckAheadOfPlan`) or past the
        rank's delivery grant (`AckNotDelivered`: a cursor never skips a step the rank was not
        sent). ValueError for an empty client id, or a rank outside the current world (for a
        heartbeat: outside the current world and the draining ranks of the one it ended).
        An ack with a `member` is its seat's (`claim_rank` with the member, its refusals
        included); the member's cursor moves and the rank's moves to the lowest of its group's
        seats (a seat nobody took yet holds it where the group began)."""

    @abstractmethod
    def record_compute(self, reports: Sequence[RankCompute]) -> list[None]:
        """Keep rank streams' compute reports, the newest `COMPUTE_REPORTS_KEPT`, in one round
        trip (one None per report: the replica groups its streams' reports)."""

    @abstractmethod
    def compute_reports(self, after: int = 0) -> tuple[int, list[RankCompute]]:
        """(reports ever recorded, the ones recorded after the first `after` that are still
        kept, oldest first)."""

    @abstractmethod
    def set_compute_fit(self, status: ComputeFitStatus) -> None:
        """Record where the job's compute fit stands (the producer, after it refits)."""

    @abstractmethod
    def compute_fit(self) -> ComputeFitStatus | None:
        """Where the job's compute fit stands; None: never recorded (not balancing by compute,
        or no report yet)."""

    # --- mixtures (docs/data-order.md) ---
    @abstractmethod
    def request_mix(self, weights: Mapping[str, float]) -> MixRequest:
        """Ask for a mixture change (weights already checked against the job's mixture): it
        replaces any request not yet applied and gets the next sequence number."""

    @abstractmethod
    def mix_request(self) -> MixRequest | None:
        """The latest mixture change asked for (the producer applies one it has not)."""

    @abstractmethod
    def set_source_status(self, status: SourceStatus) -> None:
        """The producer's view of each source's part of the epoch's plan (status, metrics)."""

    @abstractmethod
    def source_status(self) -> SourceStatus | None: ...

    @abstractmethod
    def acked(self, rank: int) -> int:
        """Last step acknowledged by `rank`, -1 if none."""

    @abstractmethod
    def acked_all(self) -> list[int]:
        """Every rank's cursor (index = rank) in one read."""

    @abstractmethod
    def lapsed_ranks(self) -> list[int]:
        """Ranks whose lease expired without release: lapsed now, or lapsed and since taken
        over by another client (reported, Guarantee 4)."""

    @abstractmethod
    def timed_out_ranks(self, timeout_seconds: float) -> dict[int, float]:
        """Ranks gone for longer than the timeout -> seconds gone: a lease lapsed *now* for
        that long, or a rank that never claimed a lease while the job's first claim (of any
        rank) is that old (Guarantee 4: a rank that never connects is treated as a dead one)."""

    @abstractmethod
    def rank_health(self) -> list[RankHealth]:
        """Every rank's cursor, lease and heartbeat age at one instant."""

    # --- counts and quarantine (written by `publish`) ---
    @abstractmethod
    def counters(self) -> JobCounters: ...

    # --- worlds: reconfiguration (worlds.py, docs/elastic.md) ---
    @abstractmethod
    def head(self) -> PlanHead:
        """`published_through` and the current world, read at one instant."""

    @abstractmethod
    def worlds(self) -> list[World]:
        """Every world of the job by generation (the last is the current one)."""

    @abstractmethod
    def grant(self, requests: Sequence[tuple[int, int, int]]) -> list[Grant | Exception]:
        """Per (generation, rank, through): raise the rank's delivery grant towards `through`
        (never past the published plan; monotonic) while `generation` is the current world and
        answer the grant; for a world that has ended, answer its boundary for the rank
        (`Grant.ended`, the rank's last step, the next world's size). A rank outside that world
        or an unknown generation is a ValueError in its slot. One round trip for all."""

    @abstractmethod
    def scale(self, request: ScaleRequest) -> ScaleResult:
        """End the current world at a boundary and start one of `request.world_size` ranks,
        atomically: each rank's last step is `worlds.choose_boundary` over the grants, cursors
        and live leases at this instant; batches after a rank's last step up to the published
        plan are returned (the counters no longer count them as planned); the new world starts
        at `published_through + 1` with every cursor there and no grants; the leases of the
        ranks that were not live and the lapse history are dropped (the new world's ranks reuse
        the ids). No change for the
        current size, or when `expect_generation` is no longer current. A fully planned job
        (done): when no live rank was granted its last step of the last epoch, that epoch's END
        is no bound, it is voided and the job planned again (its producer re-plans the epoch's
        rest); else a switch that returns nothing is made with nothing to plan (adopted at
        once). Refused, changing nothing: `PlanningComplete` when a done job would return
        batches while a live rank may hold its final END, `ScaleInProgress` while the producer
        has not adopted the previous switch or a rank of the world it ended still drains (holds
        its lease), `RanksLive` with `require_gone` while a current rank holds a live lease;
        ValueError for a size < 1."""

    @abstractmethod
    def rank_left(self, generation: int, rank: int, client_id: str, *,
                  member: Member | None = None) -> None:
        """Rank `rank` of world `generation` (ended) got its END(reconfigure): it no longer
        drains; its lease is released if `client_id` holds it. Recorded for the timings. A
        member releases its seat; the rank stops draining when its last member left."""

    @abstractmethod
    def world_timings(self, generation: int) -> WorldTimings | None:
        """When the switch into world `generation` was requested, adopted, and reached each
        rank (None for generation 0 or an unknown one)."""

    @abstractmethod
    def quarantine(self, limit: int = 1000) -> list[QuarantineEntry]:
        """The first `limit` distinct quarantined records (each listed once however many
        epochs or restarts met it); `counters().quarantined` is the exact total."""

    def ping(self) -> None:  # noqa: B027 (optional hook: an in-process state is always there)
        """One round trip to where the state lives; raises `StateUnavailable` when it cannot
        be made (the replica's readiness follows it: `service/readiness.py`)."""

    def close(self) -> None:  # noqa: B027 (optional hook: in-process states hold nothing)
        """Release connections."""
