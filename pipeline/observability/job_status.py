"""One job's status as one typed value: what every output shows (GetJob, `/status.json`, the
status page, Prometheus, `odb-pipeline status` text and JSON), each rendering this value.

Plain frozen dataclasses; the field names are a contract (the JSON keys of `/status.json` and
`status --json`, `status_json.py`). A field is None where the source that built the value does
not know it (GetJob carries no emission totals, Redis alone no replica's connections): the
status client merges the answers of several sources field by field (`pipeline.status.merge`).
Built on a replica by `status_view` (from the job's state and the replica's own facts), in the
client from Redis by the same builders; nothing here reads anything.

Per-record details (quarantine record ids and details, client ids) live only in this value and
the authenticated pages and JSON that render it, never in metric labels (`metrics.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.modes import JobMode


@dataclass(frozen=True)
class RankOnReplica:
    """A rank's stream as one replica sees it."""

    connected: bool
    delivered_step: int  # last step this replica sent the rank, -1 none
    samples_fetched: int | None = None  # payloads this replica fetched for it


@dataclass(frozen=True)
class MemberStatus:
    """One seat of a rank's model-parallel group (`RankStatus.members`): its client, its own
    position and its lag behind the group's most advanced member; `replica` as for a rank."""

    member: int
    client_id: str | None = None  # None: nobody took the seat yet, or its member released it
    acked_step: int = -1
    lag_steps: int = 0  # steps behind the group's most advanced member
    lapsed_for_s: float | None = None  # > 0: a lost member
    heartbeat_age_s: float | None = None
    released: bool = False
    replica: RankOnReplica | None = None


@dataclass(frozen=True)
class RankStatus:
    """One rank: its job-wide position (the job's state) and what the answering replica sees
    of its stream (`connected`, `delivered_step`, `samples_fetched`: None elsewhere)."""

    rank: int
    acked_step: int  # -1 = nothing acknowledged
    client_id: str | None = None  # the lease holder ("" none)
    lag_steps: int | None = None  # published steps of the rank after its ack
    seconds_since_progress: float | None = None
    stalled: bool | None = None  # waiting steps and no ack progress for 30 s
    lapsed: bool | None = None
    lapsed_for_s: float | None = None
    heartbeat_age_s: float | None = None
    # Consumed (acknowledged), summed from the plan: the same on every replica. With global
    # steps a batch is a micro-batch (a rank has several per step).
    batches_emitted: int | None = None
    samples_emitted: int | None = None
    tokens_emitted: int | None = None
    padded_tokens: int | None = None
    batch_cost: int | None = None
    replica: RankOnReplica | None = None
    members: tuple[MemberStatus, ...] | None = None  # a rank served to a group: every seat


@dataclass(frozen=True)
class WorldStatus:
    """One world of the job's world-size history, with the timings of the switch into it
    (docs/elastic.md): from its request to the plan adopted, every old rank drained, the first
    batch at every new rank."""

    generation: int
    world_size: int
    first_step: int
    last_step: int | None  # the last step any of its ranks runs (None while current)
    rank_last_steps: tuple[int, ...] = ()
    reason: str = "initial"
    requested_at: float = 0.0
    returned_samples: int = 0
    adopted_s: float | None = None
    drained_s: float | None = None
    first_batch_s: float | None = None
    first_batch_s_by_rank: Mapping[int, float] | None = None
    live_ranks: tuple[int, ...] | None = None  # ranks that drained to its last step (ended)
    left_ranks: tuple[int, ...] | None = None  # ranks of the world before that left into it


@dataclass(frozen=True)
class EpochEndStatus:
    epoch: int
    steps: int
    final_step: tuple[int, ...]  # per rank, -1: no step in the epoch
    carried_over: int


@dataclass(frozen=True)
class ProducerStatus:
    generation: int  # the fencing token
    holder: str
    live: bool


@dataclass(frozen=True)
class ProducerTrouble:
    """A transient producer failure being retried (streams wait; the next publication clears
    it). A permanent one is the job's `error`."""

    message: str
    cause: str  # a label of pipeline.producer.failures.Cause
    attempts: int
    since: float  # unix s: the streak's first failure


@dataclass(frozen=True)
class Planned:
    samples: int  # in published steps (fillers excluded)
    tokens: int


@dataclass(frozen=True)
class QuarantineRecord:
    sample_id: str
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class QuarantineStatus:
    total: int  # exact; records are the first ones only
    by_reason: Mapping[str, int] | None = None
    records: tuple[QuarantineRecord, ...] | None = None  # asked for explicitly


@dataclass(frozen=True)
class Totals:
    """Every rank's consumption (acknowledged batches, micro-batches of global steps each
    counted), summed from the plan."""

    batches_emitted: int
    samples_emitted: int
    tokens_emitted: int
    padded_tokens: int
    batch_cost: int


@dataclass(frozen=True)
class Throughput:
    basis: str  # "uptime": since the answering view started; "interval": between two answers
    window_s: float
    samples_per_s: float
    tokens_per_s: float
    batches_per_s: float
    steps_per_s: float | None = None  # interval only


@dataclass(frozen=True)
class RefillEpoch:
    epoch: int
    enqueued: int
    completed: int
    quarantined: int


@dataclass(frozen=True)
class RefillRates:
    basis: str  # as Throughput's
    window_s: float
    admissions_per_s: float
    completions_per_s: float


@dataclass(frozen=True)
class RefillStatus:
    """A `mode: refill` job's requests (docs/refill.md)."""

    enqueued: int  # made from the source so far (every epoch)
    waiting: int
    in_flight: int  # admitted, not finished
    completed: int  # each request once (per epoch)
    readmitted: int  # leases given back (consumer gone or reopened without them)
    admitted: int  # admissions (a re-admitted request counts again)
    quarantined: int
    consumers: int  # with a live lease
    exhausted: bool  # every source row of every epoch read
    lease_lapses: int = 0  # consumers whose lease lapsed while they held requests
    epoch: int = 0  # the epoch the producer reads
    epochs: int | None = None
    by_epoch: tuple[RefillEpoch, ...] = ()
    rates: RefillRates | None = None


@dataclass(frozen=True)
class ReplicaStatus:
    """The replica whose view this is (connections and deliveries are its own)."""

    id: str
    uptime_s: float | None = None


@dataclass(frozen=True)
class CoordinatorStatus:
    """What only the coordinator's registry records (Redis): retention and the raw state."""

    state: str  # the registry's "planning" | "done" ("serving" for a refill job)
    published_through: int
    trimmed_through: int
    retained_steps: int  # steps still readable (the epochs ranks may replay)
    min_acked: int
    epoch_ends: int
    lease_lapses: int
    created_at: float


@dataclass(frozen=True)
class ComputeStatus:
    """Ranks balanced by measured compute (docs/compute-balancing.md): the fit and the
    imbalance the trainers measure. `gate_open` False: the ranks are balanced by tokens."""

    gate_open: bool
    coefficients: Mapping[str, float] | None = None  # the model in force: seconds per unit
    error: float | None = None  # its held-out relative error
    reports: int = 0  # the reports it was fitted on
    last_error: float | None = None  # the latest fit's, passed or not
    accepted: int = 0
    rejected: int = 0  # nonsense reports (not finite, under a microsecond, over an hour)
    warmup: int = 0  # reports of a world's first steps, left out
    stale: int = 0  # reports of an ended world, ignored
    drifts: int = 0  # refits because the model in force stopped predicting (trainer changed)
    fit_failures: int = 0  # fits that could not be computed (the model in force stayed)
    # Per step, max/mean of the ranks' measured compute (1.0: balanced), over the newest steps
    # whose ranks all reported.
    imbalance_last: float | None = None
    imbalance_p50: float | None = None
    imbalance_p90: float | None = None
    imbalance_steps: int = 0
    # The newest fully reported step: each rank's measured seconds, and those predicted by the
    # model the step was balanced by (None: balanced by tokens).
    last_step: int | None = None
    rank_measured_s: Mapping[int, float] | None = None
    rank_predicted_s: Mapping[int, float] | None = None


@dataclass(frozen=True)
class SourceShareStatus:
    """One source of a mixture in the current epoch's published steps (docs/data-order.md):
    its share so far against its target, both counted as the job's `mix_by` says."""

    name: str
    samples: int
    loss_tokens: int
    quarantined: int  # its records quarantined this epoch
    share: float
    target: float


@dataclass(frozen=True)
class MixChangeStatus:
    step: int  # the first step planned with it
    by: str  # "mix <n>" | "schedule <i>"
    weights: Mapping[str, float]


@dataclass(frozen=True)
class MixtureStatus:
    epoch: int
    mix_by: str  # samples | loss_tokens
    sources: tuple[SourceShareStatus, ...]
    changes: tuple[MixChangeStatus, ...] = ()


@dataclass(frozen=True)
class JobStatus:
    """One job. `state`: training jobs waiting (nothing published) | waiting for ranks (steps
    published, no rank acked one or holds a lease yet) | running | draining (planning over,
    ranks still consuming) | finished (every rank acked its last step) | failed;
    refill jobs serving | done. `open`: served without a credential."""

    job_id: str
    mode: JobMode
    state: str
    done: bool = False  # training: every epoch planned; refill: every request completed
    error: str | None = None
    open: bool | None = None
    world_size: int | None = None  # the current world (None: a refill job)
    epochs: int | None = None
    published_through: int | None = None
    samples_in: int | None = None
    planned: Planned | None = None
    collate: str | None = None
    token_budget: int | None = None  # per batch (a micro-batch, with global steps)
    global_token_budget: int | None = None  # per step, all ranks (docs/global-steps.md)
    producer: ProducerStatus | None = None
    producer_trouble: ProducerTrouble | None = None
    uptime_s: float | None = None
    ranks: tuple[RankStatus, ...] | None = None
    lapsed_ranks: tuple[int, ...] | None = None
    worlds: tuple[WorldStatus, ...] | None = None
    reconfiguring: bool | None = None
    epoch_ends: tuple[EpochEndStatus, ...] | None = None
    totals: Totals | None = None
    throughput: Throughput | None = None
    quarantine: QuarantineStatus | None = None
    refill: RefillStatus | None = None
    replica: ReplicaStatus | None = None
    coordinator: CoordinatorStatus | None = None
    exposure: Mapping[str, Any] | None = None  # an SDO job's ledger summary (docs/sdo.md)
    compute: ComputeStatus | None = None  # None: not balancing by compute (or no report yet)
    # What the job's largest possible batch means for its trainers, when it is beyond a message
    # or a trainer's default byte window (`service/batch_bound.py`).
    batch_size_notice: str | None = None
    sources: MixtureStatus | None = None  # a mixture job's sources (None: one source)

    @property
    def padding_efficiency(self) -> float | None:
        """Real tokens / (real + pad) tokens of what was consumed."""
        t = self.totals
        if t is None or not t.tokens_emitted + t.padded_tokens:
            return None
        return t.tokens_emitted / (t.tokens_emitted + t.padded_tokens)

    @property
    def budget_utilisation(self) -> float | None:
        """Mean consumed batch cost / token budget."""
        t = self.totals
        if t is None or not t.batches_emitted or not self.token_budget:
            return None
        return t.batch_cost / (t.batches_emitted * self.token_budget)


@dataclass(frozen=True)
class ServiceStatus:
    """A replica's jobs (`/status.json`)."""

    generated_at: float
    service_started_at: float
    replica_id: str
    jobs: tuple[JobStatus, ...]
