"""`MemoryJobState`: the `JobState` contract kept in this process (one server, nothing survives
a restart). Thread-safe with one lock; it holds metadata only (steps name samples, never hold
payloads). The reference implementation the contract tests run against beside Redis.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from pipeline.errors import (
    AckAheadOfPlan,
    AckNotDelivered,
    CheckpointConflict,
    Fenced,
    GroupRefused,
    PlanningComplete,
    RankHeld,
    RanksLive,
    ScaleInProgress,
    StepConflict,
    StepGap,
    WorldChanged,
)
from pipeline.jobstate.groups import Group, Seat, group_refused
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
    group_holder,
    grouped,
)
from pipeline.jobstate.worlds import (
    Grant,
    PlanHead,
    ScaleRequest,
    ScaleResult,
    World,
    WorldTimings,
    choose_boundary,
)
from pipeline.modes import JobMode
from pipeline.planner.types import EpochEnd, Step


class MemoryJobState(JobState):
    def __init__(self, job_id: str, world_size: int, mode: JobMode | str = JobMode.JOIN, *,
                 clock: Callable[[], float] = time.time) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.job_id, self.mode = job_id, JobMode(mode)
        self._worlds = [World(0, world_size, 0)]
        self._grants: dict[int, int] = {}  # current world: rank -> highest step it may be sent
        self._adopting = False  # the producer has not published for the current world yet
        self._draining: dict[int, str] = {}  # ranks of the ended world -> their lease holder
        self._lease_ranks = world_size
        self._timings: dict[int, WorldTimings] = {}
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: dict[int, Step] = {}
        self._through = -1
        self._ends: dict[int, EpochEnd] = {}
        self._done = False
        self._checkpoint: PlannerCheckpoint | None = None
        self._producer: ProducerLease | None = None
        self._producer_restart: tuple[str, int] | None = None  # (actor id, process) restarted
        self._generation = 0
        self._error: ProducerFailure | None = None  # permanent
        self._trouble: ProducerFailure | None = None  # transient (cleared by a publication)
        self._leases: dict[int, RankLease] = {}
        # A rank's group (groups.py): current while the rank's lease names it (group_holder);
        # a record left behind by a scale or a plain client's takeover is stale and ignored.
        self._groups: dict[int, Group] = {}
        # rank, or (rank, seat) of a group -> its claims so far (the latest's number)
        self._claims: dict[int | tuple[int, int], int] = {}
        self._heartbeats: dict[int, float] = {}
        self._lapsed: set[int] = set()
        self._claimed: set[int] = set()  # ranks that ever held a lease
        self._first_claim: float | None = None
        self._acked = [-1] * world_size
        self._counts: Counter = Counter()
        self._quarantine: dict[str, QuarantineEntry] = {}  # insertion-ordered, one per id
        self._compute: deque[RankCompute] = deque(maxlen=COMPUTE_REPORTS_KEPT)
        self._compute_total = 0
        self._compute_fit: ComputeFitStatus | None = None
        self._mix: MixRequest | None = None
        self._sources: SourceStatus | None = None

    @property
    def world_size(self) -> int:
        return self._worlds[-1].world_size

    # --- the plan ---
    def _check_fence(self, fence: int) -> None:
        p = self._producer
        if p is None or p.generation != fence or p.expires_at <= self._clock():
            raise Fenced(f"job {self.job_id!r}: producer generation {fence} is not the live "
                         f"lease holder (current: {p.generation if p else None})")

    def _check_batches(self, step: Step) -> None:
        ranks = [(b.rank, b.micro) for b in step.batches]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"job {self.job_id!r}: step {step.step}: a rank appears twice in "
                             f"batches (rank, micro-batch): {ranks}")
        for r, _ in ranks:
            self._check_rank(r)

    def publish(self, publication: Publication, *, fence: int) -> int:
        with self._lock:
            self._check_fence(fence)
            cp = publication.checkpoint
            world = self._worlds[-1]
            if cp.world != world.generation:
                raise WorldChanged(f"job {self.job_id!r}: publication planned for world "
                                   f"{cp.world}, the current world is {world.generation} "
                                   f"({world.world_size} ranks from step {world.first_step})")
            publication.check_stamps()
            for step in publication.steps:
                self._check_batches(step)
            old = self._checkpoint
            if old is not None and cp.position < old.position:
                raise CheckpointConflict(f"job {self.job_id!r}: checkpoint at {cp.position} "
                                         f"goes backwards from {old.position}")
            retry = old is not None and cp.position == old.position
            expect = self._through + 1
            new: list[Step] = []
            for step in publication.steps:
                have = self._steps.get(step.step) or next(
                    (s for s in new if s.step == step.step), None)
                if have is not None:
                    if have != step:
                        raise StepConflict(f"job {self.job_id!r}: step {step.step} is already "
                                           "published with different content")
                elif step.step == expect:
                    new.append(step)
                    expect += 1
                else:
                    raise StepGap(f"job {self.job_id!r}: cannot publish step {step.step}, the "
                                  f"next step to publish is {expect}")
            if new and self._done:
                raise StepConflict(f"job {self.job_id!r} is marked done: no new steps")
            ends: dict[int, EpochEnd] = {}
            for end in publication.ends:
                have_end = self._ends.get(end.epoch) or ends.get(end.epoch)
                if have_end is not None and have_end != end:
                    raise StepConflict(f"job {self.job_id!r}: epoch {end.epoch} already has a "
                                       "different END record")
                ends[end.epoch] = end
            if old is not None and cp.next_step < old.next_step:
                raise CheckpointConflict(f"job {self.job_id!r}: checkpoint next_step "
                                         f"{cp.next_step} goes backwards from {old.next_step}")
            if cp.next_step > expect:
                raise CheckpointConflict(f"job {self.job_id!r}: checkpoint next_step "
                                         f"{cp.next_step} claims unpublished steps (next is "
                                         f"{expect})")
            for step in new:
                self._steps[step.step] = step
                self._counts["samples_planned"] += step.info.step_samples
                self._counts["tokens_planned"] += step.info.step_tokens
            self._through = expect - 1
            for end in publication.ends:
                self._ends.setdefault(end.epoch, end)
            self._checkpoint = cp
            if self._adopting:
                self._adopting = False
                self._timings[world.generation] = replace(
                    self._timings[world.generation], adopted_at=self._clock())
            self._done = self._done or publication.done
            self._trouble = None
            if not retry:
                self._counts["samples_in"] += publication.samples_in
                for q in publication.quarantined:
                    if q.sample_id not in self._quarantine:
                        self._quarantine[q.sample_id] = q
                        self._counts[f"q:{q.reason}"] += 1
            return len(new)

    def reveal(self, *, fence: int) -> int:
        with self._lock:  # visible at once: nothing is held
            p = self._producer
            if p is None or p.generation != fence:
                raise Fenced(f"job {self.job_id!r}: producer generation {fence} is not the "
                             f"current one ({p.generation if p else None})")
            return self._through

    def get_step(self, step: int) -> Step | None:
        with self._lock:
            return self._steps.get(step)

    def get_step_for(self, step: int, ranks: Sequence[int]) -> Step | None:
        with self._lock:
            s = self._steps.get(step)
        if s is None:
            return None
        want = set(ranks)
        return replace(s, batches=tuple(b for b in s.batches if b.rank in want))

    def published_through(self) -> int:
        with self._lock:
            return self._through

    def trimmed_through(self) -> int:
        return -1  # nothing is trimmed in memory

    def epoch_ends(self) -> list[EpochEnd]:
        with self._lock:
            return [self._ends[e] for e in sorted(self._ends)]

    def is_done(self) -> bool:
        with self._lock:
            return self._done

    def load_checkpoint(self) -> PlannerCheckpoint | None:
        with self._lock:
            return self._checkpoint

    # --- the producer lease ---
    def claim_producer(self, holder: str, lease_seconds: float) -> int | None:
        if not holder:
            raise ValueError("holder must be non-empty")
        now = self._clock()
        with self._lock:
            p = self._producer
            if p is not None and p.holder != holder and p.expires_at > now:
                return None
            self._generation += 1
            self._producer = ProducerLease(self._generation, holder, now + lease_seconds,
                                           lease_seconds > 0)
            return self._generation

    def renew_producer(self, generation: int, lease_seconds: float) -> None:
        now = self._clock()
        with self._lock:
            p = self._producer
            if p is None or p.generation != generation:
                raise Fenced(f"job {self.job_id!r}: producer generation {generation} was "
                             f"replaced by {p.generation if p else None}")
            self._producer = ProducerLease(generation, p.holder, now + lease_seconds,
                                           lease_seconds > 0)

    def release_producer(self, generation: int) -> None:
        with self._lock:
            p = self._producer
            if p is not None and p.generation == generation:
                self._producer = ProducerLease(generation, p.holder, 0.0, False)

    def producer_lease(self) -> ProducerLease | None:
        now = self._clock()
        with self._lock:
            p = self._producer
        return None if p is None else replace(p, live=p.expires_at > now)

    def claim_producer_restart(self, actor_id: str, process: int) -> bool:
        with self._lock:
            last = self._producer_restart
            if last is not None and last[0] == actor_id and process <= last[1]:
                return False
            self._producer_restart = (actor_id, process)
            return True

    def set_error(self, message: str, *, fence: int, cause: str = "internal",
                  transient: bool = False) -> None:
        now = self._clock()
        with self._lock:
            self._check_fence(fence)
            if not transient:
                self._error = ProducerFailure(message, cause, True, now)
                self._trouble = None
                return
            t = self._trouble
            self._trouble = ProducerFailure(message, cause, False, t.since if t else now,
                                            t.attempts + 1 if t else 1)

    def error(self) -> str | None:
        with self._lock:
            return self._error.message if self._error else None

    def producer_failure(self) -> ProducerFailure | None:
        with self._lock:
            return self._error or self._trouble

    def clear_error(self) -> ProducerFailure | None:
        with self._lock:
            cleared, self._error = self._error, None
            return cleared

    # --- ranks ---
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"job {self.job_id!r}: rank {rank} outside 0..{self.world_size - 1}")

    def _check_lease_rank(self, rank: int) -> None:
        if not 0 <= rank < self._lease_ranks:
            raise ValueError(f"job {self.job_id!r}: rank {rank} outside 0..{self._lease_ranks - 1}"
                             " (the current world and the one it replaced)")

    def _take(self, rank: int, client_id: str, lease_seconds: float, now: float) -> RankLease:
        cur = self._leases.get(rank)
        if cur is not None and cur.client_id != client_id:
            self._lapsed.add(rank)
            self._counts["lease_lapses"] += 1
        lease = RankLease(rank, client_id, now + lease_seconds)
        self._leases[rank] = lease
        self._claimed.add(rank)
        if self._first_claim is None:
            self._first_claim = now
        self._heartbeats[rank] = now
        return lease

    def claim_rank(self, rank: int, client_id: str, lease_seconds: float, *,
                   member: Member | None = None) -> RankLease:
        if not client_id:
            raise ValueError("client_id must be non-empty")
        if grouped(member):
            now = self._clock()
            ack = RankAck(rank, client_id, member=member)
            with self._lock:
                self._member_ack(ack, lease_seconds, now, self._check_ack(ack, now))
                seat = self._groups[rank].seats[member.index]
                key = (rank, member.index)
                self._claims[key] = claim = self._claims.get(key, 0) + 1  # per seat
                return RankLease(rank, client_id, seat.expires_at, claim)
        self._check_lease_rank(rank)
        now = self._clock()
        with self._lock:
            self._check_holder(rank, client_id, now)
            lease = self._take(rank, client_id, lease_seconds, now)
            self._claims[rank] = claim = self._claims.get(rank, 0) + 1
            return replace(lease, claim=claim)

    def _check_holder(self, rank: int, client_id: str, now: float) -> None:
        cur = self._leases.get(rank)
        if cur is not None and cur.client_id != client_id and cur.expires_at > now:
            group = self._group(rank)
            if group is not None and not self._drains(rank):
                raise self._group_refused(rank, group, now, client_id, 1)
            raise self._held(rank, cur, now)

    def release_rank(self, rank: int, client_id: str, claim: int | None = None, *,
                     member: Member | None = None) -> None:
        self._check_lease_rank(rank)
        with self._lock:
            if grouped(member):
                if claim in (None, self._claims.get((rank, member.index))):
                    self._release_seat(rank, client_id, member, self._clock())
                return
            cur = self._leases.get(rank)
            if (cur is not None and cur.client_id == client_id
                    and claim in (None, self._claims.get(rank))):
                del self._leases[rank]
                self._heartbeats.pop(rank, None)

    # --- groups (groups.py; the Lua scripts member_ack_many and member_release follow this) ---
    def _group(self, rank: int) -> Group | None:
        """The rank's current group: the one its lease names."""
        group, lease = self._groups.get(rank), self._leases.get(rank)
        if group is None or lease is None or lease.client_id != group_holder(group.size):
            return None
        return group

    def _drains(self, rank: int) -> bool:
        """The rank's lease is held by a rank of the world a reconfiguration ended (it drains
        to its last step): the new world's clients wait for it, whatever their group size."""
        cur = self._leases.get(rank)
        return cur is not None and self._draining.get(rank) == cur.client_id

    def _held(self, rank: int, cur: RankLease, now: float) -> RankHeld:
        return RankHeld(f"job {self.job_id!r}: rank {rank} is held by client {cur.client_id!r} "
                        f"for {cur.expires_at - now:.1f}s more")

    def _group_refused(self, rank: int, group: Group, now: float, client_id: str,
                       size: int) -> GroupRefused:
        live = group.live_seat(now)
        who = (f"member {live[0]} (client {live[1].client_id!r})" if live is not None
               else "its members")
        return GroupRefused(group_refused(self.job_id, rank, group.size, who, client_id, size))

    def _check_member(self, a: RankAck, now: float) -> tuple[bool, bool, bool]:
        """Everything a member's ack or claim is refused for (under the lock, before any
        change); else (form a new group, the seat is taken over from a lapsed client, the
        client holds the seat live)."""
        m = a.member
        cur = self._leases.get(a.rank)
        group = self._group(a.rank)
        if cur is not None and group is None:  # a client holds the rank alone
            if cur.expires_at > now:
                if self._drains(a.rank):
                    raise self._held(a.rank, cur, now)
                raise GroupRefused(group_refused(
                    self.job_id, a.rank, 1, f"client {cur.client_id!r}", a.client_id,
                    m.group_size))
            return True, False, False
        if group is None:
            return True, False, False
        if group.size != m.group_size:
            if group.live_seat(now) is not None:
                if self._drains(a.rank):
                    raise self._held(a.rank, cur, now)
                raise self._group_refused(a.rank, group, now, a.client_id, m.group_size)
            return True, False, False
        seat = group.seats[m.index]
        if seat.held and seat.client_id != a.client_id:
            if seat.expires_at > now:
                raise RankHeld(f"job {self.job_id!r}: member {m.index} of rank {a.rank}'s group "
                               f"is held by client {seat.client_id!r} for "
                               f"{seat.expires_at - now:.1f}s more")
            return False, True, False
        return False, False, seat.client_id == a.client_id and seat.expires_at > now

    def _member_ack(self, a: RankAck, lease_seconds: float, now: float,
                    verdict: tuple[bool, bool, bool]) -> None:
        form, took_over, held = verdict
        r, m = a.rank, a.member
        if form:
            if r in self._leases:  # an earlier holder's lease lapsed: taken over
                self._lapse(r)
            cursor = self._acked[r] if r < len(self._acked) else -1
            self._groups[r] = Group.formed(m.group_size, cursor, now, lease_seconds)
            self._claimed.add(r)
            if self._first_claim is None:
                self._first_claim = now
        group = self._groups[r]
        seat = group.seats[m.index]
        if form or a.renew or not held:
            if took_over:
                self._lapse(r)
            group.seats[m.index] = seat = Seat(a.client_id, now + lease_seconds, now, seat.acked)
        seat.heartbeat_at = now
        if a.step >= 0:
            seat.acked = max(seat.acked, a.step)
            self._acked[r] = max(self._acked[r], group.cursor())
        self._group_lease(r, group, now)

    def _lapse(self, rank: int) -> None:
        self._lapsed.add(rank)
        self._counts["lease_lapses"] += 1

    def _group_lease(self, rank: int, group: Group, now: float) -> bool:
        """Set the rank's lease to its group's; False when the group ended (every seat
        released: the rank has no lease)."""
        exp = group.lease_expiry()
        if exp is None:
            del self._groups[rank]
            self._leases.pop(rank, None)
            self._heartbeats.pop(rank, None)
            return False
        self._leases[rank] = RankLease(rank, group_holder(group.size), exp)
        self._heartbeats[rank] = now
        return True

    def _release_seat(self, rank: int, client_id: str, member: Member, now: float) -> bool:
        """Release the member's seat if `client_id` holds it; True when the group ended."""
        group = self._group(rank)
        if group is None or group.size != member.group_size:
            return False
        seat = group.seats[member.index]
        if seat.client_id != client_id:
            return False
        seat.client_id = ""
        return not self._group_lease(rank, group, now)

    def group_health(self) -> list[GroupHealth]:
        now = self._clock()
        with self._lock:
            return [g.health(r, now) for r in range(self.world_size)
                    if (g := self._group(r)) is not None]

    def _check_published(self, step: int) -> None:
        if step > self._through:
            raise AckAheadOfPlan(f"job {self.job_id!r}: ack of step {step} but only steps "
                                 f"through {self._through} are published")

    def ack(self, rank: int, step: int) -> None:
        self._check_rank(rank)
        if step < 0:
            return
        with self._lock:
            self._check_published(step)
            self._acked[rank] = max(self._acked[rank], step)

    def record_compute(self, reports: Sequence[RankCompute]) -> list[None]:
        with self._lock:
            self._compute.extend(reports)
            self._compute_total += len(reports)
        return [None] * len(reports)

    def compute_reports(self, after: int = 0) -> tuple[int, list[RankCompute]]:
        with self._lock:
            new = max(0, min(len(self._compute), self._compute_total - after))
            return self._compute_total, list(self._compute)[len(self._compute) - new:]

    def set_compute_fit(self, status: ComputeFitStatus) -> None:
        self._compute_fit = status

    def compute_fit(self) -> ComputeFitStatus | None:
        return self._compute_fit

    # --- mixtures ---
    def request_mix(self, weights: Mapping[str, float]) -> MixRequest:
        with self._lock:
            seq = self._mix.seq + 1 if self._mix is not None else 1
            self._mix = MixRequest(seq, dict(weights), self._clock())
            return self._mix

    def mix_request(self) -> MixRequest | None:
        return self._mix

    def set_source_status(self, status: SourceStatus) -> None:
        self._sources = status

    def source_status(self) -> SourceStatus | None:
        return self._sources

    def ack_many(self, acks: Sequence[RankAck], lease_seconds: float) -> list[Exception | None]:
        now = self._clock()
        out: list[Exception | None] = []
        with self._lock:
            for a in acks:
                try:
                    verdict = self._check_ack(a, now)
                except (AckAheadOfPlan, AckNotDelivered, RankHeld, GroupRefused,
                        ValueError) as exc:
                    out.append(exc)
                    continue
                if verdict is not None:
                    self._member_ack(a, lease_seconds, now, verdict)
                    out.append(None)
                    continue
                cur = self._leases.get(a.rank)
                held = cur is not None and cur.client_id == a.client_id and cur.expires_at > now
                if a.renew or not held:
                    self._take(a.rank, a.client_id, lease_seconds, now)
                if a.step >= 0:
                    self._acked[a.rank] = max(self._acked[a.rank], a.step)
                out.append(None)
        return out

    def _check_ack(self, a: RankAck, now: float) -> tuple[bool, bool, bool] | None:
        """Everything `ack_many` refuses an ack for (under the lock, before any change); for a
        member's, `_check_member`'s verdict."""
        if not a.client_id:
            raise ValueError("client_id must be non-empty")
        if a.step >= 0:
            self._check_rank(a.rank)
        else:
            self._check_lease_rank(a.rank)
        verdict = None
        if grouped(a.member):
            verdict = self._check_member(a, now)
        else:
            self._check_holder(a.rank, a.client_id, now)
        self._check_published(a.step)
        granted = self._grants.get(a.rank, self._worlds[-1].first_step - 1)
        if a.step > granted:
            raise AckNotDelivered(f"job {self.job_id!r}: ack of step {a.step} by rank {a.rank}, "
                                  f"which may have been sent steps through {granted} only")
        return verdict

    def acked(self, rank: int) -> int:
        self._check_rank(rank)
        with self._lock:
            return self._acked[rank]

    def acked_all(self) -> list[int]:
        with self._lock:
            return list(self._acked)

    def lapsed_ranks(self) -> list[int]:
        now = self._clock()
        with self._lock:
            live = {r for r, lease in self._leases.items() if lease.expires_at <= now}
            return sorted(r for r in self._lapsed | live if r < self.world_size)

    def timed_out_ranks(self, timeout_seconds: float) -> dict[int, float]:
        now = self._clock()
        limit = max(0.0, timeout_seconds)
        with self._lock:
            out = {r: now - lease.expires_at for r, lease in self._leases.items()
                   if r < self.world_size and now - lease.expires_at > limit}
            if self._first_claim is not None and now - self._first_claim > limit:
                out.update({r: now - self._first_claim for r in range(self.world_size)
                            if r not in self._claimed})
            return dict(sorted(out.items()))

    def rank_health(self) -> list[RankHealth]:
        now = self._clock()
        with self._lock:
            out = []
            for r in range(self.world_size):
                lease = self._leases.get(r)
                hb = self._heartbeats.get(r)
                out.append(RankHealth(
                    rank=r, acked=self._acked[r],
                    client_id=lease.client_id if lease else None,
                    lease_expires_at=lease.expires_at if lease else None,
                    heartbeat_age=now - hb if hb is not None and lease else None,
                    lapsed_for=max(0.0, now - lease.expires_at) if lease else 0.0))
            return out

    # --- worlds ---
    def head(self) -> PlanHead:
        with self._lock:
            w = self._worlds[-1]
            return PlanHead(self._through, w.generation, w.world_size, w.first_step)

    def worlds(self) -> list[World]:
        with self._lock:
            return list(self._worlds)

    def grant(self, requests: Sequence[tuple[int, int, int]]) -> list[Grant | Exception]:
        now = self._clock()
        out: list[Grant | Exception] = []
        with self._lock:
            cur = self._worlds[-1]
            for gen, rank, through in requests:
                world = self._worlds[gen] if 0 <= gen < len(self._worlds) else None
                if world is None or not 0 <= rank < world.world_size:
                    out.append(ValueError(f"job {self.job_id!r}: no rank {rank} in world {gen}"))
                elif world is not cur:
                    out.append(Grant(world.last_steps[rank], ended=True,
                                     next_world_size=self._worlds[gen + 1].world_size))
                else:
                    g = max(self._grants.get(rank, cur.first_step - 1),
                            min(through, self._through))
                    self._grants[rank] = g
                    t = self._timings.get(gen)
                    if t is not None and g >= cur.first_step and rank not in t.first_batch_at:
                        t.first_batch_at[rank] = now
                    out.append(Grant(g))
        return out

    def scale(self, request: ScaleRequest) -> ScaleResult:
        n = request.world_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {n!r}")
        now = self._clock()
        with self._lock:
            cur = self._worlds[-1]
            if request.expect_generation not in (None, cur.generation) or n == cur.world_size:
                return ScaleResult(False, cur)
            if self._adopting:
                raise ScaleInProgress(f"job {self.job_id!r}: the switch to world {cur.generation}"
                                      f" ({cur.world_size} ranks) is not planned yet")
            draining = sorted(r for r, cid in self._draining.items()
                              if (lease := self._leases.get(r)) is not None
                              and lease.client_id == cid and lease.expires_at > now)
            if draining:
                raise ScaleInProgress(f"job {self.job_id!r}: ranks {draining} of the previous "
                                      "world are still draining to their last step")
            w = cur.world_size
            live = [(lease := self._leases.get(r)) is not None and lease.expires_at > now
                    for r in range(w)]
            if request.require_gone and any(live):
                raise RanksLive(f"job {self.job_id!r}: ranks {[r for r in range(w) if live[r]]}"
                                f" of the current world ({w} ranks) hold live leases")
            grants = [self._grants.get(r, cur.first_step - 1) for r in range(w)]

            def boundary(ends: list[EpochEnd]) -> tuple[tuple[int, ...], int, int]:
                last = choose_boundary(
                    first_step=cur.first_step, published_through=self._through,
                    last_end_step=max((e.last_step for e in ends), default=-1), grants=grants,
                    acked=self._acked, live=live, position=request.position)
                return (last, *self._returned(last))

            # A fully planned job: its last epoch reopens (its END voided) when no live rank may
            # have that END; else only the gone ranks' batches could move, and they cannot.
            ends = list(self._ends.values())
            final = self._final_end(w)
            holders = [] if final is None else [
                r for r in range(w) if live[r] and (final.final_step[r] is None
                                                    or grants[r] >= final.final_step[r])]
            reopen = None
            if final is not None and not holders:
                last, samples, tokens = boundary([e for e in ends if e is not final])
                reopen = final if samples else None
            if reopen is None:
                last, samples, tokens = boundary(ends)
                if self._done and samples:
                    raise PlanningComplete(
                        f"job {self.job_id!r} is fully planned and its final END may have "
                        f"reached ranks {holders} (they were sent their last batch): the "
                        "unconsumed batches of the gone ranks cannot move onto a new world")
            self._counts["samples_planned"] -= samples
            self._counts["tokens_planned"] -= tokens
            ended = replace(cur, last_steps=last, published_through=self._through,
                            live_ranks=tuple(r for r in range(w) if live[r]),
                            returned_samples=samples, returned_tokens=tokens)
            new = World(cur.generation + 1, n, self._through + 1, request.reason, now)
            self._worlds[-1:] = [ended, new]
            if reopen is not None:
                del self._ends[reopen.epoch]
                self._done = False
            self._adopting = not self._done  # else nothing is left to plan: adopted at once
            self._draining = {r: self._leases[r].client_id for r in ended.live_ranks}
            for r in range(w):  # the gone ranks' leases are not the new world's (same ids)
                if not live[r]:
                    self._leases.pop(r, None)
                    self._heartbeats.pop(r, None)
            self._lapsed.clear()
            self._claimed.clear()  # the new world's ranks time out from its first claim
            self._first_claim = None
            self._acked = [self._through] * n
            self._grants = {}
            self._lease_ranks = max(n, w)
            self._timings[new.generation] = WorldTimings(
                new.generation, now, adopted_at=None if self._adopting else now)
            return ScaleResult(True, new, ended)

    def _returned(self, last: Sequence[int]) -> tuple[int, int]:
        """Samples and tokens of the batches after each rank's last step (fillers excluded)."""
        samples = tokens = 0
        for r, lr in enumerate(last):
            for k in range(lr + 1, self._through + 1):
                for b in self._steps[k].micros_for(r):
                    if not b.filler:
                        samples, tokens = samples + len(b.samples), tokens + b.num_tokens
        return samples, tokens

    def _final_end(self, w: int) -> EpochEnd | None:
        """A fully planned job's last END, if it is the current world's (w ranks)."""
        if not self._done or not self._ends:
            return None
        final = self._ends[max(self._ends)]
        return final if len(final.final_step) == w else None

    def rank_left(self, generation: int, rank: int, client_id: str, *,
                  member: Member | None = None) -> None:
        now = self._clock()
        with self._lock:
            holder = client_id
            if grouped(member):
                holder = group_holder(member.group_size)
                if not self._release_seat(rank, client_id, member, now):
                    holder = None  # members still drain (or the seat was not its)
            else:
                cur = self._leases.get(rank)
                if cur is not None and cur.client_id == client_id:
                    del self._leases[rank]
                    self._heartbeats.pop(rank, None)
            if (generation == self._worlds[-1].generation - 1
                    and self._draining.get(rank) == holder):
                del self._draining[rank]
            t = self._timings.get(generation + 1)
            if t is not None:
                t.left_at.setdefault(rank, now)

    def world_timings(self, generation: int) -> WorldTimings | None:
        with self._lock:
            t = self._timings.get(generation)
            return None if t is None else replace(t, first_batch_at=dict(t.first_batch_at),
                                                  left_at=dict(t.left_at))

    # --- counts ---
    def counters(self) -> JobCounters:
        with self._lock:
            c = self._counts
            reasons = {k[2:]: n for k, n in sorted(c.items()) if k.startswith("q:")}
            return JobCounters(samples_in=c["samples_in"], samples_planned=c["samples_planned"],
                               tokens_planned=c["tokens_planned"],
                               quarantined=sum(reasons.values()),
                               quarantined_by_reason=reasons, lease_lapses=c["lease_lapses"])

    def quarantine(self, limit: int = 1000) -> list[QuarantineEntry]:
        with self._lock:
            return list(self._quarantine.values())[:max(0, limit)]
