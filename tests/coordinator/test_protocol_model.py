"""A model check of the coordinator protocol (issue #13): hypothesis interleaves, against a real
redis-server, what the processes of a job do to its shared state, and checks after every step
what the contract promises.

What runs: the real planner inside the real `Producer` (producer.py), two producer identities
competing for the job's lease, each start a new instance (the old one may linger as a zombie and
wake up later), over a small deterministic sample list of 2-3 epochs in join or quota mode;
ranks reading their batches step by step (`get_step_for`), acknowledging, reconnecting to any
step the contract lets them replay; rank leases taken, lapsing, taken over; Redis killed (-9)
and restarted from its AOF (`appendfsync always`) while everything is paused, or under a
producer's publish (Redis gone before the call; the reply lost after the script ran; or the
call resent by the client after the restart, so the script runs twice).

Checked after every rule:
- every published step is write-once and equals the step the planner makes without any restart
  (so restarts, zombies and lost replies changed nothing), steps are contiguous, nothing
  published is ever lost, and only steps every rank is done with are trimmed, exactly as the
  trimming rule says;
- every sample of an epoch with an END is planned exactly once (join), or once across the
  epoch and what it carries over (quota);
- each rank sees exactly the batches the plan gives it, learns its last step of an epoch in
  band, and the number of steps it got in an epoch is what the END says (quota: the same for
  all); a rank may replay its current (and previous) epoch and sees the same bytes;
- a replica reads a rank's step only after raising its delivery grant, and records the rank's
  acks as its client's (ACK_MANY): an ack renews that client's lease; an ack by a client whose
  rank another client holds changes nothing; an ack of a published step beyond the grant (never
  delivered) is refused and the cursor never skips it;
- acks are monotonic; the checkpoint never goes backwards and never claims unpublished steps;
  counters are exact (input samples once each whatever the restarts, planned samples and
  tokens, each quarantined record once); lapses are reported and counted;
- a producer whose generation is no longer current never lands a publication (fencing), and its
  attempt ends it as FENCED; the producer never fails (no error reaches the ranks).

Not covered: Redis losing acknowledged writes (`appendfsync everysec` without `fsync_publish`;
the contract then relies on WAITAOF, see test_faults), several Redis nodes, the renewer thread's
timing (the lease here lapses by an explicit rule, as if the holder were partitioned), payload
staging (ArrayFeed-like: nothing to stage), reconfiguration of the world size.

Speed and determinism: by default 50 examples of up to 30 rules, derandomized (the same
sequences on every run; ~1-2 min). To hunt for bugs, run it randomized and longer:
    ODB_MODEL_EXAMPLES=500 ODB_MODEL_STEPS=50 ODB_MODEL_RANDOM=1 \
        pytest tests/coordinator/test_protocol_model.py
A failure prints the rules as Python; paste them into a `test_regression_*` function below.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from pipeline.config import TrainingJobConfig
from pipeline.coordinator import RedisJobState
from pipeline.errors import AckAheadOfPlan, AckNotDelivered, Fenced, RankHeld
from pipeline.jobstate import QuarantineEntry, RankAck
from pipeline.modes import JobMode
from pipeline.planner.types import MeasuredSample
from pipeline.producer.producer import Outcome

from .model_parts import (
    ModelRedis,
    ProducerInstance,
    PublishLog,
    ReferencePlan,
    quarantine_entry,
    reference_plan,
)
from .retention import expected_trimmed

IDENTITIES = ("producer-a", "producer-b")
CLIENTS = ("client-0", "client-1")


def event(what: str) -> None:
    """Counted in hypothesis' statistics; a no-op when a scenario below drives the model."""
    with contextlib.suppress(InvalidArgument):
        hypothesis_event(what)


@dataclass
class RankView:
    """What one trainer rank has seen: the model of its client."""

    rank: int
    state: RedisJobState
    next: int = 0  # the next step it asks for
    acked: int = -1
    granted: int = -1  # its delivery grant (raised before each read)
    read: dict[int, object] = field(default_factory=dict)  # step -> its batch (None: absent)
    own: dict[int, set[int]] = field(default_factory=dict)  # epoch -> steps with its batch


@dataclass
class RankLeaseModel:
    holder: str | None = None
    live: bool = False


class ProtocolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.redis: ModelRedis | None = None
        self.instances: list[ProducerInstance] = []
        self.ranks: list[RankView] = []
        self.tmp = tempfile.TemporaryDirectory(prefix="odb-model-")

    # ------------------------------------------------------------------------ setup
    @initialize(
        world_size=st.integers(2, 3), mode=st.sampled_from(["join", "quota"]),
        epochs=st.integers(2, 3), seed=st.integers(0, 3),
        over_budget=st.sampled_from(["alone", "quarantine", "truncate"]),
        window_samples=st.sampled_from([2, 4]),
        rows=st.lists(st.one_of(st.integers(1, 90), st.just(0)), min_size=3, max_size=14),
    )
    def setup(self, world_size, mode, epochs, seed, over_budget, window_samples, rows) -> None:
        # A length of 0 stands for a record the preprocessing quarantined (a feed-level
        # QuarantineEntry); lengths over the budget of 64 meet the over-budget policy.
        self.items = [quarantine_entry(f"s:{i}") if n == 0
                      else MeasuredSample(f"s:{i}", n, 0, n // 2) for i, n in enumerate(rows)]
        self.job = TrainingJobConfig(
            job_id="model", world_size=world_size, mode=mode, seed=seed, epochs=epochs,
            source={"paths": ["model-rows"]},
            batching={"token_budget": 64, "max_window_samples": window_samples, "pool_steps": 1,
                      "over_budget": over_budget})
        self.ref: ReferencePlan = reference_plan(self.items, self.job)
        self.redis = ModelRedis(self.tmp.name)
        self.state = RedisJobState.connect(self.redis.url, self.job)
        self.ranks = [RankView(r, RedisJobState.connect(self.redis.url, self.job))
                      for r in range(world_size)]
        self.log = PublishLog()
        self.checked_landed = 0
        self.seen: dict[int, object] = {}  # every step ever read back (before any trimming)
        self.through = -1
        self.position = (-1, 0)
        self.generation = 0
        self.lease_holder: str | None = None
        self.lease_live = False
        self.current: ProducerInstance | None = None
        self.rank_leases = [RankLeaseModel() for _ in range(world_size)]
        self.claimed: set[int] = set()  # ranks that ever held a lease
        self.first_claim_at: float | None = None
        self.lapsed: set[int] = set()
        self.lapses = 0
        self.trim_expected = -1

    def teardown(self) -> None:
        for inst in self.instances:
            inst.close()
        for view in self.ranks:
            view.state.close()
        if self.redis is not None:
            if hasattr(self, "state"):
                self.state.close()
            self.redis.cleanup()
        self.tmp.cleanup()

    # --------------------------------------------------------------- the producers
    def _alive(self) -> list[ProducerInstance]:
        return [i for i in self.instances if i.alive]

    def _note_outcome(self, inst: ProducerInstance) -> None:
        """After `inst` ran: what its end (if it ended) says about the lease."""
        assert inst.outcome is not Outcome.FAILED, f"the producer failed: {self.state.error()}"
        if inst is self.current and not inst.alive:
            assert inst.outcome is Outcome.DONE, inst.outcome
            self.lease_live = False  # a finished producer gives its lease up

    # Rules never need a precondition: one that does not apply returns (hypothesis wastes
    # draws on disabled rules). Producer progress has three rules out of twelve.
    @rule(who=st.sampled_from(IDENTITIES))
    def start_producer(self, who: str) -> None:
        """A producer process starts (or restarts: the same identity takes over at once, the
        old instance, if still alive, becomes a zombie)."""
        if self.lease_live and self.lease_holder != who:
            assert self.state.claim_producer(who, 600) is None  # refused while the other lives
            event("a claim refused: the other producer's lease is live")
            return
        if any(i.alive and i.identity == who for i in self.instances):
            event("a producer restarted while its old instance lives on")
        for old in self.instances:
            old.state.fault = None  # faults are for the current producer's publishes
        inst = ProducerInstance(who, self.job, self.items, self.redis.url, self.log, self.redis)
        self.instances.append(inst)
        inst.start()
        self.generation += 1
        assert inst.generation == self.generation
        self.current, self.lease_holder, self.lease_live = inst, who, True
        self._note_outcome(inst)

    @rule(pick=st.integers(0, 7), rows=st.integers(1, 12))
    def advance_any(self, pick: int, rows: int) -> None:
        """A producer (the current one or a zombie) reads `rows` more source rows."""
        alive = self._alive()
        if alive:
            self._advance(alive[pick % len(alive)], rows)

    @rule(rows=st.integers(1, 12))
    def advance_current(self, rows: int) -> None:
        if self.current is not None and self.current.alive:
            self._advance(self.current, rows)

    @rule(rows=st.integers(1, 8), fault=st.sampled_from(["down", "reply_lost", "resent"]),
          down=st.sampled_from([0.05, 0.3]))
    def advance_through_a_redis_crash(self, rows: int, fault: str, down: float) -> None:
        """The current producer reads `rows` more rows; Redis crashes at its next publish
        (in this rule or, armed until then, a later one)."""
        if self.current is None or not self.current.alive:
            return
        self.current.state.fault = (fault, down)
        self._advance(self.current, rows)

    def _advance(self, inst: ProducerInstance, rows: int) -> None:
        landed, tried = len(self.log.landed), self.log.attempts.get(inst.generation, 0)
        armed = inst.state.fault
        inst.advance(rows)
        if armed is not None and inst.state.fault is None:
            event(f"Redis crashed under a publish ({armed[0]})")
        self.redis.join()  # back up, if a fault took it down
        landed_now = self.log.landed[landed:]
        if inst is not self.current:
            # A zombie: fencing refuses its first publish and that ends it.
            assert not landed_now, f"stale generation {inst.generation} published"
            attempted = self.log.attempts.get(inst.generation, 0) > tried
            assert attempted == (not inst.alive), (attempted, inst.alive)
            assert inst.alive or inst.outcome is Outcome.FENCED, inst.outcome
            if attempted:
                event("a zombie producer tried to publish: fenced")
            return
        if landed_now and not self.lease_live:
            event("the producer renewed its lapsed lease to publish")
            self.lease_live = True  # an expired lease nobody took is still its own
        self._note_outcome(inst)
        if inst.outcome is Outcome.DONE:
            event("a producer planned the whole job")

    @rule(action=st.sampled_from(["lapse", "renew", "renew_stale"]))
    def producer_lease(self, action: str) -> None:
        """The holder stops renewing (partitioned, paused) and its lease expires; or the current
        generation's renewer fires; or a zombie's does (refused)."""
        if action == "lapse" and self.lease_live:
            # Written on the Redis clock, as the passing of time would.
            secs, micros = self.state.client.time()
            self.state.client.hset(self.state.keys.meta, "producer_exp",
                                   secs * 1000 + micros // 1000 - 1)
            self.lease_live = False
        elif action == "renew" and self.current is not None and self.current.alive:
            self.state.renew_producer(self.generation, 600)
            self.lease_live = True
        elif action == "renew_stale" and self.generation > 1:
            with pytest.raises(Fenced):
                self.state.renew_producer(self.generation - 1, 600)

    @rule(pick=st.integers(0, 7))
    def stop_producer(self, pick: int) -> None:
        """A producer is stopped (graceful: it releases its lease if it still holds it)."""
        alive = self._alive()
        if not alive:
            return
        inst = alive[pick % len(alive)]
        inst.stop()
        assert inst.outcome is not Outcome.FAILED
        if inst is self.current and inst.outcome is not Outcome.FENCED:
            self.lease_live = False  # it released its lease

    # ------------------------------------------------------------------------ ranks
    def _check_read(self, view: RankView, n: int, got) -> None:
        want = self.ref.steps[n]
        assert (got.epoch, got.step, got.info) == (want.epoch, want.step, want.info)
        assert got.batches == tuple(b for b in want.batches if b.rank == view.rank)
        if n in view.read:
            assert view.read[n] == (got.batches[0] if got.batches else None), "replay differs"
        view.read[n] = got.batches[0] if got.batches else None

    def _client_of(self, rank: int) -> str:
        """The client a replica records the rank's acks for: the live lease holder's stream,
        else the rank's reader (which takes the lease with its ack)."""
        m = self.rank_leases[rank]
        return m.holder if m.live and m.holder is not None else f"reader-{rank}"

    def _ack(self, view: RankView, step: int, client: str | None = None) -> None:
        """The rank's ack as a replica records it (ACK_MANY: the client's lease renewed)."""
        client = client or self._client_of(view.rank)
        model = self.rank_leases[view.rank]
        (err,) = view.state.ack_many([RankAck(view.rank, client, step)], 30)
        if model.live and model.holder != client:
            assert isinstance(err, RankHeld), err  # fenced: another client holds the rank
            event("an ack of a client without the lease was refused")
            return
        assert err is None, err
        self._took_lease(view.rank, client)
        view.acked = max(view.acked, step)
        self.trim_expected = expected_trimmed(self._first_steps(), min(
            v.acked for v in self.ranks))

    def _took_lease(self, r: int, client: str) -> None:
        model = self.rank_leases[r]
        if model.holder is not None and model.holder != client:
            self.lapsed.add(r)  # taken over after a lapse: reported, counted
            self.lapses += 1
            event("a lapsed rank was taken over")
        model.holder, model.live = client, True
        self.claimed.add(r)
        if self.first_claim_at is None:
            self.first_claim_at = time.monotonic()

    def _first_steps(self) -> dict[int, int]:
        """Each epoch's first step, for epochs with a published step."""
        out: dict[int, int] = {}
        for n in range(self.through + 1):
            out.setdefault(self.ref.steps[n].epoch, n)
        return out

    @rule(r=st.integers(0, 2), count=st.integers(1, 4), ack=st.booleans())
    def rank_reads(self, r: int, count: int, ack: bool) -> None:
        """A rank asks for its next steps (a replica reads only that rank's batch), and acks
        them as it goes, or not (acks are also a rule of their own)."""
        view = self.ranks[r % len(self.ranks)]
        for _ in range(count):
            self._read_next(view)
        if ack and view.next > 0:
            self._ack(view, view.next - 1)

    @rule(count=st.integers(1, 6), ack=st.booleans())
    def all_ranks_read(self, count: int, ack: bool) -> None:
        """Every rank reads on (the trainers move together, as in a collective)."""
        for r in range(len(self.ranks)):
            self.rank_reads(r, count, ack)

    def _read_next(self, view: RankView) -> None:
        """The rank reads step `view.next` if it is published (the replica raises the rank's
        delivery grant first: never past the published plan)."""
        n = view.next
        (grant,) = view.state.grant([(0, view.rank, n)])
        assert grant.through == max(view.granted, min(n, view.state.published_through()))
        view.granted = grant.through
        got = view.state.get_step_for(n, [view.rank])
        if got is None:
            assert n > view.state.published_through(), f"step {n} gone before it was read"
            return
        self._check_read(view, n, got)
        view.next = n + 1
        if got.batches:
            view.own.setdefault(got.epoch, set()).add(n)
            return
        # Absent: a join-mode rank past its last step of the epoch. It knows in band: the
        # END was published with this step; the replica acks it through the epoch.
        e = got.epoch
        assert self.job.mode is JobMode.JOIN
        ends = {x.epoch: x for x in view.state.epoch_ends()}
        assert e in ends, f"rank {view.rank} absent from step {n}, epoch {e} has no END"
        final = ends[e].final_step[view.rank]
        assert final is None or final < n
        assert n == self.ref.epoch_steps(e)[-1], "a rank is absent only from the last step"
        event("a join rank ended an epoch early")
        self._ack(view, n)

    @rule(r=st.integers(0, 2), how=st.sampled_from(
        ["read", "read", "lower", "ahead", "undelivered", "intruder"]))
    def rank_acks(self, r: int, how: str) -> None:
        """A rank acks what it read; or a late duplicate (lower) ack arrives, which changes
        nothing; or an ack past the plan, which is refused; or an ack of a published step
        beyond the rank's grant (never delivered), refused; or an ack by a client that does not
        hold the rank while another does (its stream must end), refused."""
        view = self.ranks[r % len(self.ranks)]
        if how == "read" and view.next > 0:
            self._ack(view, view.next - 1)
        elif how == "lower" and view.acked >= 1:
            self._ack(view, view.acked - 1)
        elif how == "ahead":
            with pytest.raises(AckAheadOfPlan):
                view.state.ack(view.rank, self.state.published_through() + 1)
        elif how == "undelivered" and view.granted < self.state.published_through():
            (err,) = view.state.ack_many([RankAck(view.rank, self._client_of(view.rank),
                                                  view.granted + 1)], 30)
            assert isinstance(err, AckNotDelivered), err
            event("an ack of an undelivered step was refused")
        elif how == "intruder" and self.rank_leases[view.rank].live and view.next > 0:
            self._ack(view, view.next - 1, client="intruder")

    @rule(r=st.integers(0, 2), where=st.floats(0, 1))
    def rank_reconnects(self, r: int, where: float) -> None:
        """The rank's trainer restarts (new client): from its first unacknowledged step, or any
        earlier step of the epoch its checkpoint names (its acked step's epoch)."""
        view = self.ranks[r % len(self.ranks)]
        view.state.close()
        view.state = RedisJobState.connect(self.redis.url, self.job)
        lo = self.ref.epoch_steps(self.ref.epoch_of(view.acked))[0] if view.acked >= 0 else 0
        view.next = lo + int(where * (view.acked + 1 - lo))
        for n in range(view.next, view.acked + 1):
            got = view.state.get_step_for(n, [view.rank])
            assert got is not None, f"rank {view.rank} cannot replay step {n}: trimmed"
            self._check_read(view, n, got)
            event("a rank replayed a step")

    @rule(r=st.integers(0, 2), client=st.sampled_from(CLIENTS),
          action=st.sampled_from(["claim", "claim_and_die", "release"]))
    def rank_lease(self, r: int, client: str, action: str) -> None:
        """A client claims the rank (its lease live), or claims it and dies (the lease lapses),
        or releases it (only the holder can)."""
        r = r % len(self.ranks)
        model = self.rank_leases[r]
        if action == "release":
            self.state.release_rank(r, client)
            if model.holder == client:
                self.rank_leases[r] = RankLeaseModel()
            return
        if model.live and model.holder != client:
            with pytest.raises(RankHeld):
                self.state.claim_rank(r, client, 30)
            return
        if model.holder is not None and model.holder != client:
            self.lapsed.add(r)  # taken over after a lapse: reported, counted
            self.lapses += 1
            event("a lapsed rank was taken over")
        lapse = action == "claim_and_die"
        self.state.claim_rank(r, client, 0.05 if lapse else 30)
        model.holder, model.live = client, True
        self.claimed.add(r)
        if self.first_claim_at is None:
            self.first_claim_at = time.monotonic()
        if lapse:
            time.sleep(0.08)
            model.live = False

    # ------------------------------------------------------------------------ Redis
    @rule()
    def redis_restarts(self) -> None:
        """kill -9 and restart from the AOF, every producer paused at its gate."""
        self.redis.restart()

    # ------------------------------------------------------------------- invariants
    @invariant()
    def contract_holds(self) -> None:
        if self.redis is None:
            return
        self._the_plan_is_the_reference_write_once_and_contiguous()  # first: reads the plan
        self._every_sample_of_an_ended_epoch_is_planned_exactly_once()
        self._ranks_see_the_step_counts_the_ends_say()
        self._acks_checkpoint_counters_and_trimming()
        self._fencing_and_leases()

    def _the_plan_is_the_reference_write_once_and_contiguous(self) -> None:
        st_ = self.state
        through, trimmed = st_.published_through(), st_.trimmed_through()
        assert through >= self.through, "published steps were lost"
        assert through < len(self.ref.steps)
        self.through = through
        for n in range(trimmed + 1, through + 1):
            got = st_.get_step(n)
            assert got == self.ref.steps[n], f"step {n} differs from the planner's"
            self.seen[n] = got
        assert st_.get_step(through + 1) is None
        assert all(st_.get_step(n) is None for n in range(trimmed + 1))
        assert set(self.seen) == set(range(through + 1)), "a step was trimmed unseen"
        ends = st_.epoch_ends()
        assert ends == self.ref.ends[:len(ends)]
        for end in ends:
            assert through >= self.ref.epoch_steps(end.epoch)[-1] if end.steps else True
        done = st_.is_done()
        if done:
            assert through == len(self.ref.steps) - 1 and len(ends) == self.job.epochs
        assert st_.error() is None

    def _every_sample_of_an_ended_epoch_is_planned_exactly_once(self) -> None:
        valid = [i.sample_id for i in self.items if isinstance(i, MeasuredSample)
                 and i.sample_id not in self.ref.planner_quarantined]
        carried_in: list = []
        for end in self.state.epoch_ends():
            # Fillers (quota's closing step) copy a real sample: not a planning of it.
            ids = [s.sample_id for n in self.ref.epoch_steps(end.epoch)
                   for b in self.seen[n].batches if not b.filler for s in b.samples]
            out = [s.sample_id for s in end.carried_over]
            if self.job.mode is JobMode.JOIN:
                assert not out
            assert Counter(ids) + Counter(out) == Counter(valid) + Counter(carried_in), (
                f"epoch {end.epoch}: samples not planned exactly once")
            carried_in = out

    def _ranks_see_the_step_counts_the_ends_say(self) -> None:
        ends = self.state.epoch_ends()
        for view in self.ranks:
            for end in ends:
                steps = self.ref.epoch_steps(end.epoch)
                final = end.final_step[view.rank]
                want = set(range(steps[0], final + 1)) if final is not None else set()
                got = view.own.get(end.epoch, set())
                assert got <= want, f"rank {view.rank} got steps the END does not give it"
                if view.next > (steps[-1] if steps else -1):
                    assert got == want, f"rank {view.rank}: epoch {end.epoch} step count"
                if self.job.mode is JobMode.QUOTA and final is not None:
                    assert set(end.final_step) == {final}

    def _acks_checkpoint_counters_and_trimming(self) -> None:
        st_ = self.state
        assert st_.acked_all() == [v.acked for v in self.ranks]
        cp = st_.load_checkpoint()
        if cp is not None:
            assert cp.position >= self.position, "the checkpoint went backwards"
            self.position = cp.position
            assert cp.next_step <= self.through + 1
        epoch, rows = self.position if cp is not None else (0, 0)
        consumed = self.items * epoch + self.items[:rows]
        c = st_.counters()
        assert c.samples_in == sum(isinstance(i, MeasuredSample) for i in consumed)
        steps = [self.seen[n] for n in range(self.through + 1)]
        assert c.samples_planned == sum(s.info.step_samples for s in steps)
        assert c.tokens_planned == sum(s.info.step_tokens for s in steps)
        bad = {i.sample_id for i in consumed if isinstance(i, QuarantineEntry)} | {
            i.sample_id for i in consumed if isinstance(i, MeasuredSample)
            and i.sample_id in self.ref.planner_quarantined}
        listed = [q.sample_id for q in st_.quarantine()]
        assert c.quarantined == len(bad) and sorted(listed) == sorted(bad)
        assert st_.trimmed_through() == self.trim_expected

    def _fencing_and_leases(self) -> None:
        for p in self.log.landed[self.checked_landed:]:
            assert p.generation == self.generation, "a stale generation landed a publication"
        self.checked_landed = len(self.log.landed)
        lease = self.state.producer_lease()
        if self.generation == 0:
            assert lease is None
            return
        assert lease.generation == self.generation and lease.holder == self.lease_holder
        assert (lease.expires_at > time.time()) == self.lease_live
        down = {r for r, m in enumerate(self.rank_leases) if m.holder and not m.live}
        assert self.state.lapsed_ranks() == sorted(self.lapsed | down)
        # A rank that never claimed is gone since the job's first claim (ms clock: give the
        # first claim a moment before demanding it).
        never = set(range(len(self.ranks))) - self.claimed if self.claimed else set()
        gone = set(self.state.timed_out_ranks(0))
        if self.first_claim_at is not None and time.monotonic() - self.first_claim_at > 0.05:
            assert gone == down | never
        else:
            assert down <= gone <= down | never
        assert self.state.counters().lease_lapses == self.lapses
        assert [h.client_id for h in self.state.rank_health()] == [
            m.holder for m in self.rank_leases]


def _settings() -> settings:
    random = os.environ.get("ODB_MODEL_RANDOM") == "1"
    return settings(max_examples=int(os.environ.get("ODB_MODEL_EXAMPLES", "50")),
                    stateful_step_count=int(os.environ.get("ODB_MODEL_STEPS", "30")),
                    deadline=None, derandomize=not random, database=None if not random
                    else settings.default.database,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


ProtocolModel.TestCase.settings = _settings()
TestProtocolModel = ProtocolModel.TestCase


# ------------------------------------------------------------------------------ scenarios
# Fixed interleavings run on every CI pass whatever the hypothesis budget (and failing
# examples the model check found belong here, as it prints them).
ROWS = [30, 30, 28, 26, 20, 20, 12, 10, 50, 0, 90, 5, 33, 7]


def _run(setup: dict, *calls: tuple[str, dict]) -> ProtocolModel:
    """Drive the model through `calls`, checking the contract after each; the model is
    returned torn down (its bookkeeping stays readable)."""
    model = ProtocolModel()
    try:
        model.setup(**setup)
        model.contract_holds()
        for name, kwargs in calls:
            getattr(model, name)(**kwargs)
            model.contract_holds()
    finally:
        model.teardown()
    return model


def _finished(model: ProtocolModel) -> None:
    """The job got planned whole and every rank read all of it."""
    assert model.through == len(model.ref.steps) - 1 > 0
    assert len(model.ref.ends) == model.job.epochs
    assert all(v.next == len(model.ref.steps) for v in model.ranks)


def _drain(ranks: int) -> list[tuple[str, dict]]:
    """Every rank reads (acking) as far as the plan goes."""
    return [("rank_reads", {"r": r, "count": 4, "ack": True}) for _ in range(8)
            for r in range(ranks)]


def test_scenario_a_resent_publication_counts_once():
    """The script ran, the connection died, the client resent it after the restart: the second
    run is a retry at the same position (found by the model check with `if not retry` removed
    from PUBLISH)."""
    m = _run(dict(world_size=2, mode="join", epochs=2, seed=0, over_budget="alone",
                  window_samples=2, rows=[1, 0, 0]),
             ("start_producer", {"who": "producer-a"}),
             ("advance_through_a_redis_crash", {"down": 0.05, "fault": "resent", "rows": 3}),
             ("advance_current", {"rows": 12}))
    assert m.redis.restarts == 1 and m.current.outcome is Outcome.DONE


def test_scenario_a_zombie_wakes_after_its_restart_and_is_fenced():
    m = _run(dict(world_size=2, mode="quota", epochs=3, seed=1, over_budget="quarantine",
              window_samples=2, rows=ROWS),
         ("start_producer", {"who": "producer-a"}),
         ("advance_current", {"rows": 9}),
         *_drain(2)[:4],
         ("start_producer", {"who": "producer-a"}),  # restarted; the old one lives on
         ("advance_current", {"rows": 5}),
         ("advance_any", {"pick": 0, "rows": 12}),  # the zombie wakes: fenced, it ends
         ("advance_current", {"rows": 12}),
         ("advance_current", {"rows": 12}),
         ("advance_current", {"rows": 12}),
         *_drain(2))
    assert [i.outcome for i in m.instances] == [Outcome.FENCED, Outcome.DONE]
    assert m.log.attempts[1] >= 2  # it published as the current one, then tried as a zombie
    _finished(m)


def test_scenario_the_other_producer_takes_over_a_lapsed_lease_mid_epoch():
    m = _run(dict(world_size=3, mode="join", epochs=2, seed=2, over_budget="alone",
              window_samples=4, rows=ROWS),
         ("start_producer", {"who": "producer-a"}),
         ("advance_current", {"rows": 11}),
         ("start_producer", {"who": "producer-b"}),  # refused: a's lease is live
         ("producer_lease", {"action": "lapse"}),
         ("start_producer", {"who": "producer-b"}),  # takes over from a's checkpoint
         ("producer_lease", {"action": "renew_stale"}),
         ("advance_current", {"rows": 12}),
         ("advance_any", {"pick": 0, "rows": 3}),  # a wakes up: fenced
         ("advance_current", {"rows": 12}),
         ("advance_current", {"rows": 12}),
         *_drain(3))
    assert [(i.identity, i.outcome) for i in m.instances] == [
        ("producer-a", Outcome.FENCED), ("producer-b", Outcome.DONE)]
    assert m.log.landed[0].generation == 1 and m.log.landed[-1].generation == 2
    _finished(m)


def test_scenario_redis_crashes_while_ranks_replay_and_leases_lapse():
    m = _run(dict(world_size=2, mode="join", epochs=3, seed=3, over_budget="truncate",
              window_samples=2, rows=ROWS),
         ("start_producer", {"who": "producer-b"}),
         ("advance_through_a_redis_crash", {"down": 0.3, "fault": "down", "rows": 8}),
         ("rank_lease", {"r": 0, "client": "client-0", "action": "claim_and_die"}),
         *_drain(2)[:6],
         ("redis_restarts", {}),
         ("rank_reconnects", {"r": 0, "where": 0.0}),
         ("rank_lease", {"r": 0, "client": "client-1", "action": "claim"}),
         ("advance_through_a_redis_crash", {"down": 0.05, "fault": "reply_lost", "rows": 12}),
         ("producer_lease", {"action": "lapse"}),
         ("advance_current", {"rows": 12}),  # renews its lapsed lease to publish
         ("rank_acks", {"r": 1, "how": "ahead"}),
         *_drain(2),
         ("rank_reconnects", {"r": 1, "where": 0.5}),
         ("redis_restarts", {}),
         ("advance_current", {"rows": 12}),
         ("advance_current", {"rows": 12}),
         ("stop_producer", {"pick": 0}),
         *_drain(2))
    assert m.redis.restarts == 4 and m.lapses == 1 and m.lapsed == {0}
    assert any(n in v.read for v in m.ranks for n in range(3))
    _finished(m)

