"""The DGAP state machine: measured samples in, steps of W rank-balanced batches out.

    planner = StepPlanner(policy, world_size=8, mode=JobMode.JOIN, seed=0)
    for s in samples:
        for ev in planner.feed(s): ...        # Step | Quarantined
    for ev in planner.end_epoch(): ...        # remaining Steps, then EpochEnd
    # the job's last epoch: planner.end_epoch(last_epoch=True)

Flow per sample: over-budget policy -> `BatchFormer` window -> pool of formed batches -> when the
pool holds `pool_steps * W` batches they are grouped by cost into steps (`rank_balancer`).
Latency: at full size an epoch's step needs `lookahead_tokens` worth of samples plus a pool of ~256
batches (default `pool_steps = ceil(256 / W)`). With `policy.ramp_up` (the default) an epoch
starts small: after k steps of the epoch the window is `RAMP_FIRST_BUDGETS * 2**k` budgets and
the pool `2**k` steps (each capped at its configured size), so the first step comes after a few
budgets of samples and the plan reaches full size after a handful of steps. The ramp is a
function of the steps already emitted in the epoch, so restores see the same sizes.

End of epoch:
- the pool's newest batches (a window's worth; over-budget ones excepted) go back into the
  window and all of it is cut longest first (`BatchFormer.flush`: the GMT oracle's cut of what
  is held, the fewest batches).
- join: if the batches left do not divide by W, the biggest are split in two until they do (a
  subset of a valid batch is valid), so every rank normally ends on the same step. Only when
  fewer samples than ranks remain does the last step leave ranks out (absent);
  `EpochEnd.final_step` tells each rank its last step. At most one step after input end is
  partial: bounded termination.
- quota: only full steps of W batches are emitted. The remainder is split the same way to fill
  one more step; what cannot fill it (fewer splittable samples than ranks) is carried: its samples
  are in `EpochEnd.carried_over` and are fed first into the next epoch (on the next
  `feed`/`end_epoch`). After the job's last epoch (`end_epoch(last_epoch=True)`) there is no next
  epoch: the remainder forms one closing step of W batches, the ranks it cannot give a batch get a
  *filler* (a copy of the step's shortest sample, `Batch.filler`: zero loss weight, not
  coverage, not in `StepInfo`), and the last `EpochEnd` carries nothing. Nothing is dropped.

Global steps (`policy.global_token_budget` = G, docs/global-steps.md): the formed batches are
micro-batches. A step takes them in formation order until the next one would pass G (at least
one each), so which samples a step holds depends on the input order, G, the budget and the
former only, never on W: no pool sized by W, and the window's ramp counts global steps. Each
step is then placed on the W ranks (`micro_split.split_step`: balanced by cost, every rank at
least one micro-batch, fillers when it has fewer samples than ranks) and carries
`StepInfo.optimizer_step`, its ordinal among the job's trained steps. Every rank runs every
step, so join and quota plan alike and nothing is carried over. A reconfiguration re-emits the
voided steps whole (`reconfigure(voided=...)`): same samples, same `optimizer_step`, new step
numbers, placed on the new world.

Step numbers are global and monotonic across epochs. Everything is deterministic in (inputs,
input order, seed); the seed only permutes which rank gets which batch of a step.
`snapshot()`/`restore()` capture the full state so a restarted pipeline continues identically:
take a snapshot together with the last published step, restore it, resume the source after
`state.samples_consumed` samples of `state.epoch`; the events that follow are the same as without
the restart (`PlannerState.to_dict`/`from_dict` give a JSON form).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipeline.modes import DGAP_MODES, JobMode, OverBudgetPolicy
from pipeline.planner.batch_former import BatchFormer
from pipeline.planner.compute_fit import ComputeModel, batch_features
from pipeline.planner.micro_split import filler_of, split_step, split_to_fill
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.rank_balancer import group_by_cost, rank_order
from pipeline.planner.source_shares import SourceShares
from pipeline.planner.types import (
    Batch,
    EpochEnd,
    MeasuredSample,
    PendingBatch,
    PlanEvent,
    Quarantined,
    Step,
    StepInfo,
    WorldStamp,
)
from pipeline.quarantine import QuarantineReason

RAMP_FIRST_BUDGETS = 16  # the window of an epoch's first step, in token budgets (see above)
# A mixture's global steps choose their micro-batches out of at least this many formed ones
# (and at least 4 steps' worth): the reservoir the source shares pick from, the same at any
# world size (docs/data-order.md).
SHARE_RESERVOIR = 256


@dataclass(frozen=True, slots=True)
class PlannerState:
    """Everything needed to continue planning after a restart (see `StepPlanner.restore`).

    `samples_consumed` counts the samples fed in the current epoch (carried-over ones excluded):
    the source resumes after that many. `window` and `pool` are the samples/batches fed but not
    yet in a published step; `carried_over` waits for the next epoch.
    """

    epoch: int
    next_step: int
    samples_consumed: int
    epoch_started: bool
    epoch_first_step: int
    last_step: tuple[int | None, ...]
    carried_over: tuple[MeasuredSample, ...] = ()
    window: tuple[MeasuredSample, ...] = ()
    pool: tuple[PendingBatch, ...] = ()
    quarantined: int = 0
    compute_model: ComputeModel | None = None  # the model balancing ranks (None: tokens)
    # Global steps only (None otherwise): the next step's `optimizer_step`, and the first of the
    # current epoch (the window's ramp counts the global steps formed in the epoch).
    optimizer_step: int | None = None
    epoch_first_optimizer_step: int | None = None
    # A mixture's source shares (source_shares.py): its targets and deficits (None: no mixture).
    source_shares: dict | None = None

    def to_dict(self) -> dict:
        """JSON-ready form (sample ids stay int or str), e.g. to keep in Redis."""

        def smp(s: MeasuredSample) -> list:
            # (its mixture source only when it has one: a state without encodes as before)
            out = [s.sample_id, s.num_tokens, s.num_visual_tokens, s.loss_tokens]
            return [*out, s.source] if s.source else out

        d = {
            "epoch": self.epoch,
            "next_step": self.next_step,
            "samples_consumed": self.samples_consumed,
            "epoch_started": self.epoch_started,
            "epoch_first_step": self.epoch_first_step,
            "last_step": list(self.last_step),
            "carried_over": [smp(s) for s in self.carried_over],
            "window": [smp(s) for s in self.window],
            "pool": [
                {
                    "samples": [smp(s) for s in b.samples],
                    "over_budget": b.over_budget,
                    "truncated_to": [list(t) for t in b.truncated_to],
                }
                for b in self.pool
            ],
            "quarantined": self.quarantined,
        }
        if self.compute_model is not None:  # absent when off: such a state encodes as before
            d["compute_model"] = self.compute_model.to_list()
        if self.optimizer_step is not None:  # global steps only
            d["optimizer_step"] = self.optimizer_step
            d["epoch_first_optimizer_step"] = self.epoch_first_optimizer_step
        if self.source_shares is not None:  # a mixture only
            d["source_shares"] = self.source_shares
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PlannerState:
        def smp(x: list) -> MeasuredSample:
            return MeasuredSample(x[0], int(x[1]), int(x[2]), int(x[3]) if len(x) > 3 else 0,
                                  int(x[4]) if len(x) > 4 else 0)

        return cls(
            epoch=int(d["epoch"]),
            next_step=int(d["next_step"]),
            samples_consumed=int(d["samples_consumed"]),
            epoch_started=bool(d["epoch_started"]),
            epoch_first_step=int(d["epoch_first_step"]),
            last_step=tuple(d["last_step"]),
            carried_over=tuple(smp(x) for x in d["carried_over"]),
            window=tuple(smp(x) for x in d["window"]),
            pool=tuple(
                PendingBatch(
                    tuple(smp(x) for x in b["samples"]),
                    bool(b["over_budget"]),
                    tuple((t[0], int(t[1])) for t in b["truncated_to"]),
                )
                for b in d["pool"]
            ),
            quarantined=int(d["quarantined"]),
            compute_model=(ComputeModel.from_list(d["compute_model"])
                           if "compute_model" in d else None),
            optimizer_step=d.get("optimizer_step"),
            epoch_first_optimizer_step=d.get("epoch_first_optimizer_step"),
            source_shares=d.get("source_shares"),
        )


def pool_size(world_size: int, pool_steps: int | None) -> int:
    """The batches pooled for rank balancing at full size: `pool_steps` steps' worth (None: the
    default, ~256 batches)."""
    # Balancing picks W similar-cost batches out of a pool; a bigger pool balances better but
    # delays the first step. ~256 batches: per-step max/mean p50 ~1.002 on tokens and ~1.02 on
    # an attention-heavy compute model (b=1/1024). W=1 needs no pool.
    if pool_steps is None:
        pool_steps = 1 if world_size == 1 else max(2, -(-256 // world_size))
    if pool_steps < 1:
        raise ValueError(f"pool_steps must be >= 1, got {pool_steps}")
    return pool_steps * world_size


class StepPlanner:
    """Online planner for one job. See the module docstring for the protocol."""

    def __init__(
        self,
        policy: BatchingPolicy,
        world_size: int,
        mode: JobMode | str = JobMode.JOIN,
        seed: int = 0,
        pool_steps: int | None = None,
        *,
        generation: int = 0,
        compute_model: ComputeModel | None = None,
    ) -> None:
        """`generation`: the world the plan is for (0: the job's first; see `WorldStamp`).
        `compute_model`: balance ranks by its predicted seconds (None: by the policy's cost)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if mode not in DGAP_MODES:
            raise ValueError(f"mode must be one of {[m.value for m in DGAP_MODES]}, got {mode!r}")
        self.mode = JobMode(mode)
        self.policy = policy
        self.world = WorldStamp(generation, world_size)  # stamped on every Step and EpochEnd
        self.seed = int(seed)
        self._cm = policy.cost_model
        self._sent = self._cm.sent_length  # a length as the collate sends it (pad_to_multiple)
        self._budget = policy.token_budget
        self._max_alone = policy.max_alone_tokens  # n fits alone iff n <= this (padded)
        self._vcap = policy.max_visual_tokens
        self._pool_target = pool_size(world_size, pool_steps)  # at full size
        self._pool_now = self._pool_target  # while ramping up: smaller (see `_ramp`)
        self._former = BatchFormer(policy)
        self._pool: list[PendingBatch] = []
        self.epoch = 0
        self.next_step = 0
        self.samples_consumed = 0
        self._epoch_started = False
        self._epoch_first_step = 0
        self._last_step: list[int | None] = [None] * world_size
        self._carry: tuple[MeasuredSample, ...] = ()
        self.quarantined = 0
        self.compute_model = compute_model
        self._global = policy.global_token_budget  # None: classic steps of W batches
        self.next_optimizer_step = 0  # global steps: the next new step's ordinal
        self._epoch_first_opt = 0
        self._shares: SourceShares | None = None  # a mixture's source shares (set_source_targets)

    # -- public API -------------------------------------------------------------------------

    def feed(self, sample: MeasuredSample) -> list[PlanEvent]:
        """Take the next sample of the current epoch; returns the events it released."""
        events: list[PlanEvent] = []
        if not self._epoch_started:
            self._start_epoch(events)
        self.samples_consumed += 1
        if self._shares is not None:
            self._shares.observe(sample)
        n = sample.num_tokens
        v = sample.num_visual_tokens
        pooled = len(self._pool)
        if 0 < n <= self._max_alone and v >= 0 and (self._vcap is None or v <= self._vcap):
            # Fast path (nearly every sample): in budget, straight into the window.
            cut = self._former.add(sample)
            if cut:
                self._pool.extend(PendingBatch(tuple(b)) for b in cut)
        else:
            self._admit(sample, events)
        if self._global is not None:
            if len(self._pool) != pooled:
                self._release_global(events, final=False)
        elif len(self._pool) >= self._pool_now:
            self._release(events, final=False)
        return events

    def set_compute_model(self, model: ComputeModel | None) -> None:
        """Balance the steps released from now on by `model` (None: by the policy's cost).
        Which samples an epoch holds never depends on it: only their rank and step do."""
        self.compute_model = model

    def set_source_targets(self, counts: Sequence[int], by: str = "samples") -> None:
        """A mixture: keep each source's share of what is emitted at its part of what the
        epoch has left (`counts`: the samples of each source the epoch holds, after a mixture
        change the ones read before it plus the rest's new counts), counted in samples or loss
        tokens (`by`). Which formed unit goes next is chosen by the shares
        (`source_shares.py`): classic, which step of the pool; global, which micro-batches a
        step takes."""
        if self._shares is None or self._shares.sources != len(counts) or (
                self._shares.by != by):
            self._shares = SourceShares(len(counts), by)
        self._shares.set_counts(counts)

    def feed_many(self, samples: Iterable[MeasuredSample]) -> list[PlanEvent]:
        events: list[PlanEvent] = []
        for s in samples:
            events.extend(self.feed(s))
        return events

    def end_epoch(self, last_epoch: bool = False) -> list[PlanEvent]:
        """Input of this epoch is exhausted: emit the remaining steps, then `EpochEnd`.

        `last_epoch`: no epoch follows (quota mode: the remainder closes the job in one step with
        fillers instead of being carried; join mode carries nothing anyway).
        """
        events: list[PlanEvent] = []
        self._start_epoch(events)
        for b in self._former.flush(self._give_back()):
            self._pool.append(PendingBatch(tuple(b)))
        if self._global is not None:  # every rank runs every step: nothing to carry
            self._release_global(events, final=True)
            left = []
        else:
            left = self._release(events, final=True)
        if left and last_epoch:
            self._emit_step(left, events, fillers=self.world_size - len(left))
            left = []
        carried = tuple(s for pb in left for s in pb.samples)
        steps = self.next_step - self._epoch_first_step
        if self.mode is JobMode.QUOTA and self._global is None:
            last = self.next_step - 1 if steps else None
            final = tuple(last for _ in range(self.world_size))
        else:
            final = tuple(self._last_step)
        events.append(EpochEnd(self.epoch, final, steps, carried, self.world))
        self._carry = carried
        self.epoch += 1
        self.samples_consumed = 0
        self._epoch_started = False
        return events

    def reconfigure(self, world_size: int, returned: Sequence[Batch], *, first_step: int,
                    pool_steps: int | None = None, voided: Sequence[Step] = ()
                    ) -> list[PlanEvent]:
        """Move the rest of the current epoch onto the next world (generation + 1) of
        `world_size` ranks (a reconfiguration: see docs/elastic.md); returns the steps the pool
        fills at once, numbered from `first_step`.

        `returned`: the batches of published steps that the old world will never run (voided),
        in (step, rank) order. Each was a valid batch (budget, visual cap, truncation), and the
        budget does not depend on the world, so it goes back into the pool as it was (fillers,
        copies of a real sample, are dropped). Steps are write-once, so `first_step` (at least
        `next_step`) skips the voided step numbers; the epoch keeps its first step and input
        position, and its `EpochEnd` will name the new world's ranks. The pool is released as
        soon as it holds a full step (not at its usual target) so the new world starts without
        waiting for input; what cannot fill a step stays pooled.

        Global steps: `voided` are the published steps the old world did not complete, whole
        (`returned` must be empty). They are emitted again at once, in order, as the same
        global steps (same samples, same `optimizer_step`) placed on the new world; the step
        being formed is the world's no more than before, so planning goes on unchanged.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if first_step < self.next_step:
            raise ValueError(f"first_step {first_step} is before the planner's next step "
                             f"{self.next_step}: published step numbers are never reused")
        target = pool_size(world_size, pool_steps)  # (raises before anything changes)
        if (voided or self._global is not None) and returned:
            raise ValueError("global steps come back whole: pass the voided steps (`voided`), "
                             "not returned batches")
        if voided and self._global is None:
            raise ValueError("only global steps (global_token_budget) come back whole")
        self.world = WorldStamp(self.world.generation + 1, world_size)
        self._pool_target = target
        self.next_step = first_step
        self._last_step = [None] * world_size  # the epoch's END names the new world's ranks
        self._ramp()  # the pool's size for the new world (as a restore computes it)
        events: list[PlanEvent] = []
        if self._global is not None:
            if voided and not self._epoch_started:
                self._start_epoch(events)
            for step in sorted(voided, key=lambda st: st.step):
                if step.info.optimizer_step is None:
                    raise ValueError(f"step {step.step} is not a global step (no optimizer_step)")
                self._emit_global([_pending(b) for b in step.batches if not b.filler], events,
                                  optimizer_step=step.info.optimizer_step)
            return events
        keep = [b for b in returned if not b.filler]
        if keep and not self._epoch_started:
            # Returned samples of an epoch that had ended open the next one (its first step,
            # carry-over and rank bookkeeping are set up as by its first sample).
            self._start_epoch(events)
        self._pool.extend(_pending(b) for b in keep)
        if len(self._pool) >= world_size:
            self._release(events, final=False)
        return events

    def reopen_epoch(self) -> None:
        """Go back into the epoch that just ended, its input all fed: a reconfiguration voided
        its END before any rank could have it (a fully planned job, docs/elastic.md). Then
        `reconfigure` hands back the returned batches and `end_epoch` closes the epoch again,
        its END naming the new world's ranks and its span counting from the same first step.
        Only an epoch that carried nothing over (the job's last one) can be reopened."""
        if self._epoch_started or self.epoch == 0:
            raise ValueError("only an epoch that has just ended can be reopened")
        if self._carry:
            raise ValueError("an epoch that carried samples over cannot be reopened")
        self.epoch -= 1
        self._epoch_started = True
        self._ramp()

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def buffered(self) -> int:
        """Samples fed but not yet in a published step (window + pool)."""
        return len(self._former) + sum(len(b.samples) for b in self._pool)

    @property
    def carried_over(self) -> tuple[MeasuredSample, ...]:
        return self._carry

    def snapshot(self) -> PlannerState:
        return PlannerState(
            epoch=self.epoch,
            next_step=self.next_step,
            samples_consumed=self.samples_consumed,
            epoch_started=self._epoch_started,
            epoch_first_step=self._epoch_first_step,
            last_step=tuple(self._last_step),
            carried_over=self._carry,
            window=tuple(self._former.samples()),
            pool=tuple(self._pool),
            quarantined=self.quarantined,
            compute_model=self.compute_model,
            optimizer_step=None if self._global is None else self.next_optimizer_step,
            epoch_first_optimizer_step=None if self._global is None else self._epoch_first_opt,
            source_shares=None if self._shares is None else self._shares.snapshot(),
        )

    @classmethod
    def restore(
        cls,
        state: PlannerState,
        policy: BatchingPolicy,
        world_size: int,
        mode: JobMode | str = JobMode.JOIN,
        seed: int = 0,
        pool_steps: int | None = None,
        *,
        generation: int = 0,
    ) -> StepPlanner:
        """A planner that continues exactly where the one that took `state` was (for world
        `generation` of `world_size` ranks: the state's checkpoint names it)."""
        p = cls(policy, world_size, mode, seed, pool_steps, generation=generation,
                compute_model=state.compute_model)
        if len(state.last_step) != world_size:
            raise ValueError(f"state is for world_size {len(state.last_step)}, not {world_size}")
        p.epoch = state.epoch
        p.next_step = state.next_step
        p.samples_consumed = state.samples_consumed
        p._epoch_started = state.epoch_started
        p._epoch_first_step = state.epoch_first_step
        p._last_step = list(state.last_step)
        p._carry = state.carried_over
        p.quarantined = state.quarantined
        p._pool = list(state.pool)
        if p._global is not None:
            if state.optimizer_step is None:
                raise ValueError("state was planned without global_token_budget; the policy "
                                 "has one (a job keeps its batching settings)")
            p.next_optimizer_step = state.optimizer_step
            p._epoch_first_opt = state.epoch_first_optimizer_step or 0
        elif state.optimizer_step is not None:
            raise ValueError("state was planned with global_token_budget; the policy has none "
                             "(a job keeps its batching settings)")
        if state.source_shares is not None:
            p._shares = SourceShares.restore(state.source_shares)
        p._ramp()
        for s in state.window:
            # The window was below both of its bounds, so re-adding cuts nothing; the same
            # arrival order gives the same sorted window.
            if p._former.add(s):
                raise ValueError("state.window holds more than policy.lookahead_tokens or "
                                 "policy.max_window_samples allow")
        return p

    # -- internals --------------------------------------------------------------------------

    def _start_epoch(self, events: list[PlanEvent]) -> None:
        if self._epoch_started:
            return
        self._epoch_started = True
        self._epoch_first_step = self.next_step
        self._epoch_first_opt = self.next_optimizer_step
        self._last_step = [None] * self.world_size
        if self._shares is not None:  # each epoch holds its own shares
            self._shares.reset_epoch()
        self._ramp()
        carry, self._carry = self._carry, ()
        for s in carry:  # carried samples open the epoch (already admitted once: in budget)
            self._admit(s, events)

    def _admit(self, s: MeasuredSample, events: list[PlanEvent]) -> None:
        n = s.num_tokens
        v = s.num_visual_tokens
        if n <= 0 or v < 0:
            self.quarantined += 1
            events.append(Quarantined(s, QuarantineReason.INVALID_SIZE,
                                      f"num_tokens={n}, num_visual_tokens={v}"))
            return
        vis_over = self._vcap is not None and v > self._vcap
        tok_over = n > self._max_alone
        if not (vis_over or tok_over):
            for b in self._former.add(s):
                self._pool.append(PendingBatch(tuple(b)))
            return
        pol = self.policy.over_budget
        if vis_over:
            why = f"num_visual_tokens={v} exceeds max_visual_tokens={self._vcap}"
            if pol is OverBudgetPolicy.ALONE:
                self._pool.append(PendingBatch((s,), over_budget=True))
            else:
                if pol is OverBudgetPolicy.TRUNCATE:
                    why += " (truncation cannot cut visual tokens)"
                self.quarantined += 1
                events.append(Quarantined(s, QuarantineReason.OVER_VISUAL_CAP, why))
            return
        why = f"num_tokens={n} exceeds token_budget={self._budget}"
        if self._sent(n) != n:
            why = f"num_tokens={n} (padded to {self._sent(n)}) exceeds token_budget={self._budget}"
        keep = self._max_alone  # (a multiple of pad_to_multiple)
        if pol is OverBudgetPolicy.ALONE:
            self._pool.append(PendingBatch((s,), over_budget=True))
        elif pol is OverBudgetPolicy.TRUNCATE and v <= keep:
            self._pool.append(
                PendingBatch((s,), over_budget=True, truncated_to=((s.sample_id, keep),))
            )
        else:
            if pol is OverBudgetPolicy.TRUNCATE:  # the image tokens alone exceed the budget
                why += f" and its {v} visual tokens cannot be truncated"
            self.quarantined += 1
            events.append(Quarantined(s, QuarantineReason.OVER_BUDGET, why))

    def _give_back(self) -> list[MeasuredSample]:
        """The samples of the pool's newest plain batches, at most one window's bounds of them
        (`lookahead_tokens`, `max_window_samples`): the end of the epoch cuts them again with
        the window, longest first. So it regroups at most two windows (an SDO job keeps its
        window small for local batches: they stay local); over-budget batches stay as they
        are."""
        room_tokens = self.policy.lookahead_tokens
        room_samples = self.policy.max_window_samples
        back: list[PendingBatch] = []
        for pb in reversed(self._pool):
            if pb.over_budget:
                continue
            room_tokens -= sum(s.num_tokens for s in pb.samples)
            room_samples -= len(pb.samples)
            if room_tokens < 0 or room_samples < 0:
                break
            back.append(pb)
        if not back:
            return []
        taken = {id(pb) for pb in back}
        self._pool = [pb for pb in self._pool if id(pb) not in taken]
        return [s for pb in reversed(back) for s in pb.samples]

    def _ramp(self) -> None:
        """Window and pool sizes for the steps already emitted in this epoch."""
        if not self.policy.ramp_up:
            return
        if self._global is not None:  # by global steps formed: the same at any world size
            k = min(30, self.next_optimizer_step - self._epoch_first_opt) if (
                self._epoch_started) else 0
            self._former.limit_tokens(self._budget * RAMP_FIRST_BUDGETS << k)
            return
        k = min(30, self.next_step - self._epoch_first_step) if self._epoch_started else 0
        self._pool_now = min(self._pool_target, self.world_size << k)
        self._former.limit_tokens(self._budget * RAMP_FIRST_BUDGETS << k)

    def _cost(self, pb: PendingBatch) -> float:
        """What rank balancing evens out: predicted seconds under a compute model, else the
        policy's compute cost."""
        lens = pb.lengths()
        if self.compute_model is None:
            return self._cm.compute_cost(lens)
        return self.compute_model.predict(batch_features(pb.samples, lens, self._cm.collate))

    def _release(self, events: list[PlanEvent], final: bool) -> list[PendingBatch]:
        """Group the pool into full steps and emit them; a short remainder stays pooled.

        With `final`, the biggest batches are split until the remainder fills a step; what still
        cannot (fewer samples than ranks) is emitted partial (join) or returned (quota).
        """
        w = self.world_size
        pool, self._pool = self._pool, []
        rem = len(pool) % w
        if final and rem:
            pool = split_to_fill(pool, w - rem)
        costs = [self._cost(b) for b in pool]
        groups = group_by_cost(costs, w)
        rest: list[int] = []
        if groups and len(groups[-1]) < w and not (final and self.mode is JobMode.JOIN):
            rest = sorted(groups.pop())
        if self._shares is not None:
            # A mixture: the step that keeps the sources' shares goes next, and only until the
            # pool is below its target again (its batches are the shares' reservoir).
            groups, rest = self._by_shares(pool, costs, w, keep=0 if final else self._pool_now - 1)
            if rest and final and self.mode is JobMode.JOIN:  # the partial last step
                groups.append(rest)
                rest = []
        for group in groups:
            self._emit_step([pool[i] for i in group], events)
        self._ramp()
        left = [pool[i] for i in rest]
        if not final:
            self._pool = left
            return []
        return left

    def _by_shares(self, pool: list[PendingBatch], costs: list[float], w: int, keep: int
                   ) -> tuple[list[list[int]], list[int]]:
        """Steps of `w` batches out of the pool, each the run of `w` neighbours in cost order
        (balanced as `group_by_cost` makes them) that the source shares pick, until at most
        `keep` batches are left (at least one step): (the steps, the batches left)."""
        shares = self._shares
        assert shares is not None
        order = sorted(range(len(pool)), key=lambda i: (-costs[i], i))
        amounts = {i: shares.amounts(pool[i].samples) for i in order}
        chosen: list[list[int]] = []
        while len(order) >= w and (not chosen or len(order) > keep):
            runs = [[sum(x) for x in zip(*(amounts[i] for i in order[j:j + w]), strict=True)]
                    for j in range(len(order) - w + 1)]
            j = shares.pick_amounts(runs)
            group, order = order[j:j + w], order[:j] + order[j + w:]
            chosen.append(group)
            shares.take([s for i in group for s in pool[i].samples])
        return chosen, sorted(order)

    def _release_global(self, events: list[PlanEvent], final: bool) -> None:
        """Global steps: cut the pool, in formation order, into steps of up to G (at least one
        formed batch each); the last run stays pooled while it might take more, unless
        `final`."""
        if self._shares is not None:
            self._release_global_shares(events, final)
            return
        g = self._global
        # The formed batch a step takes next is the next in formation order (a mixture's
        # source shares choose instead: `_release_global_shares`).
        pool = self._pool
        start = 0
        while start < len(pool):
            acc, k = 0, start
            while k < len(pool):
                c = self._cm.token_cost(pool[k].lengths())
                if k > start and acc + c > g:
                    break
                acc += c
                k += 1
            if k == len(pool) and acc < g and not final:
                break  # the step may still take the next formed batch
            self._emit_global(pool[start:k], events)
            start = k
        self._pool = pool[start:]
        self._ramp()

    def _release_global_shares(self, events: list[PlanEvent], final: bool) -> None:
        """A mixture's global steps: each takes, out of a reservoir of formed micro-batches
        (`SHARE_RESERVOIR`, at least four steps' worth: never sized by W), the one the source
        shares pick next among those that still fit G, until none does."""
        g = self._global
        shares = self._shares
        assert g is not None and shares is not None
        per_step = -(-g // self._budget)
        reservoir = max(SHARE_RESERVOIR, 4 * per_step)
        if self.policy.ramp_up:  # it grows with the steps formed, as the window does (_ramp)
            k = min(30, self.next_optimizer_step - self._epoch_first_opt)
            reservoir = min(reservoir, per_step << k)
        pool = self._pool
        costs = [self._cm.token_cost(pb.lengths()) for pb in pool]
        amounts = [shares.amounts(pb.samples) for pb in pool]
        while pool and (final or len(pool) >= reservoir):
            take: list[PendingBatch] = []
            acc = 0
            while pool:  # the pick among the formed batches that still fit (any, at first)
                fits = [k for k in range(len(pool)) if not take or acc + costs[k] <= g]
                if not fits:
                    break
                k = fits[shares.pick_amounts([amounts[k] for k in fits])]
                take.append(pool.pop(k))
                acc += costs.pop(k)
                amounts.pop(k)
                shares.take(take[-1].samples)
            self._emit_global(take, events)
        self._pool = pool
        self._ramp()

    def _emit_global(self, units: list[PendingBatch], events: list[PlanEvent],
                     optimizer_step: int | None = None) -> None:
        """Emit a global step of `units` (formed batches), placed on this world's ranks; a new
        one gets the next optimizer step, a re-emitted one keeps its own."""
        if optimizer_step is None:
            optimizer_step = self.next_optimizer_step
            self.next_optimizer_step += 1
        step = self.next_step
        self.next_step += 1
        placed = split_step(units, self.world_size, self._cost, seed=self.seed,
                            key=optimizer_step)
        batches = []
        tokens = samples = loss = 0
        for r, micros in enumerate(placed):
            for m, (pb, filler) in enumerate(micros):
                lens = pb.lengths()
                b = Batch(rank=r, samples=pb.samples, cost=self._cm.token_cost(lens),
                          over_budget=pb.over_budget, truncated_to=dict(pb.truncated_to),
                          filler=filler, micro=m)
                batches.append(b)
                if not filler:
                    tokens += sum(lens)
                    samples += len(pb.samples)
                    loss += b.loss_tokens
            self._last_step[r] = step
        events.append(Step(self.epoch, step, tuple(batches),
                           StepInfo(samples, tokens, loss, optimizer_step), self.world,
                           self.compute_model))

    def _emit_step(
        self, group: list[PendingBatch], events: list[PlanEvent], fillers: int = 0
    ) -> None:
        """Emit `group` as the next step; `fillers` more batches (quota's closing step) copy the
        group's shortest sample so that every rank has a batch."""
        step = self.next_step
        self.next_step += 1
        w = self.world_size
        if fillers:
            group = group + [filler_of(group)] * fillers
        if len(group) == w:
            ranks = rank_order(self.seed, step, w)
        else:  # partial final step (join): ranks 0..n-1 get the batches, the rest are absent
            ranks = list(range(len(group)))
        real = len(group) - fillers
        batches = []
        tokens = samples = loss = 0
        for i, (pb, r) in enumerate(zip(group, ranks, strict=True)):
            lens = pb.lengths()
            b = Batch(
                rank=r,
                samples=pb.samples,
                cost=self._cm.token_cost(lens),
                over_budget=pb.over_budget,
                truncated_to=dict(pb.truncated_to),
                filler=i >= real,
            )
            batches.append(b)
            self._last_step[r] = step
            if b.filler:
                continue
            tokens += sum(lens)
            samples += len(pb.samples)
            loss += b.loss_tokens
        batches.sort(key=lambda b: b.rank)
        events.append(Step(self.epoch, step, tuple(batches), StepInfo(samples, tokens, loss),
                           self.world, self.compute_model))



def _pending(b: Batch) -> PendingBatch:
    """A published batch as a formed one again (its truncation as canonical sorted pairs)."""
    return PendingBatch(b.samples, b.over_budget, tuple(sorted(
        b.truncated_to.items(), key=lambda kv: (isinstance(kv[0], str), kv[0]))))
