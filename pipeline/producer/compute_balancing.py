"""The producer's half of compute balancing (docs/compute-balancing.md).

Ranks report each batch's compute seconds on their acks; replicas keep them in the job's state
tagged with the world. Every `poll_seconds` the producer reads the new ones, gives each the
features of its batch (from the published plan; of a global step, the sum over the rank's
micro-batches: its report covers them all), feeds the fit (`compute_fit.ComputeFitter`)
and records where the fit stands, with the measured per-step imbalance, for `status` and
metrics. `model` is the model in force (None: the gate is closed, balance by tokens); the
producer hands it to the planner only when it takes a checkpoint, so that the checkpoint holds
the model that plans the steps after it. Reports of an ended world are ignored (counted as
stale); the model itself carries over a reconfiguration and a restart (it is in the planner
checkpoint). Nothing a report holds makes this raise: the fit rejects or absorbs it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from pipeline.config import ComputeBalancingConfig
from pipeline.jobstate.interface import ComputeFitStatus, JobState, RankCompute
from pipeline.planner.compute_fit import (
    ComputeFitter,
    ComputeModel,
    ComputeReport,
    rank_features,
)
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Collate, Step

IMBALANCE_STEPS = 64  # the newest fully reported steps whose imbalance the status keeps
_OPEN_STEPS = 1024  # steps waiting for their other ranks' reports (older ones are given up)


class ComputeBalancer:
    def __init__(self, state: JobState, config: ComputeBalancingConfig, collate: Collate, *,
                 poll_seconds: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.collate = Collate(collate)
        self.fitter = ComputeFitter(config.fit_settings())
        self.poll_seconds = poll_seconds
        self._clock = clock
        self._next_poll = 0.0
        self._seen = 0  # reports read so far (the state's running count)
        self._adopted = False  # a checkpoint's model was taken (the first restore)
        self.stale = 0
        # step -> (its ranks, rank -> (measured seconds, predicted seconds or None))
        self._open: dict[int, tuple[int, dict[int, tuple[float, float | None]]]] = {}
        self._imbalance: deque[tuple[int, float]] = deque(maxlen=IMBALANCE_STEPS)
        self._last: tuple[int, dict[int, tuple[float, float | None]]] = (-1, {})

    @property
    def model(self) -> ComputeModel | None:
        """The model in force: what the planner balances by from its next checkpoint on."""
        return self.fitter.model

    def adopt(self, planner: StepPlanner) -> None:
        """A planner restored from a checkpoint. A producer's first: the checkpoint's model
        (the one the steps after it were balanced by) is in force until a fit replaces it or
        drift retires it; later ones (the same producer starting over) keep the fit's model.
        The planner is left as restored: the steps after a checkpoint follow its model."""
        if not self._adopted:
            self._adopted = True
            self.fitter.model = planner.compute_model

    def update(self, world: int, world_first_step: int, world_size: int, *,
               force: bool = False) -> None:
        """Read the new reports of world `world` (`world_size` ranks from step
        `world_first_step`) and fit (at most every `poll_seconds` unless `force`)."""
        now = self._clock()
        if not force and now < self._next_poll:
            return
        self._next_poll = now + self.poll_seconds
        total, reports = self.state.compute_reports(self._seen)
        self._seen = total
        if not reports:
            return
        current = [r for r in reports if r.world == world]
        self.stale += len(reports) - len(current)
        steps = self._steps_of(current, world_size)
        for r in current:
            step = steps.get(r.step)
            micros = step.micros_for(r.rank) if step is not None else ()
            if not micros:  # trimmed already, or a rank without a batch there: nothing to fit
                continue
            features = rank_features(
                [(b.samples, [b.truncated_to.get(s.sample_id, s.num_tokens) for s in b.samples])
                 for b in micros], self.collate)
            if self.fitter.offer(ComputeReport(r.step, r.rank, r.seconds, features),
                                 world_first_step=world_first_step):
                model = step.compute  # the model its step was balanced by (None: tokens)
                self._note_measured(r, len(step.ranks()),
                                    None if model is None else model.predict(features))
        self.fitter.refit()
        self.state.set_compute_fit(self.status())

    def status(self) -> ComputeFitStatus:
        f = self.fitter
        m = f.model
        return ComputeFitStatus(
            gate_open=m is not None, coefficients=m.coefficients if m else (),
            error=m.error if m else 0.0, reports=m.reports if m else 0,
            last_error=f.last_fit.error if f.last_fit else -1.0, accepted=f.accepted,
            rejected=f.rejected, warmup=f.warmup, stale=self.stale, drifts=f.drifts,
            fit_failures=f.failed,
            imbalance=tuple(self._imbalance), last_step=self._last[0],
            last_measured={r: m for r, (m, _) in self._last[1].items()},
            last_predicted={r: p for r, (_, p) in self._last[1].items() if p is not None})

    def _steps_of(self, reports: list[RankCompute], world_size: int) -> dict[int, Step]:
        """The reported steps, every batch of each (one read): a step's imbalance needs to
        know how many ranks it has."""
        order = sorted({r.step for r in reports})
        got = self.state.get_steps_for([(n, range(world_size)) for n in order])
        return {n: s for n, s in zip(order, got, strict=True) if s is not None}

    def _note_measured(self, r: RankCompute, ranks: int, predicted: float | None) -> None:
        """Once every rank of a step reported: its imbalance, max/mean of measured compute, and
        its ranks' measured and predicted seconds."""
        if not math.isfinite(r.seconds):
            return
        _, seen = self._open.setdefault(r.step, (ranks, {}))
        seen[r.rank] = (r.seconds, predicted)
        if len(seen) == ranks:
            del self._open[r.step]
            t = [m for m, _ in seen.values()]
            self._imbalance.append((r.step, max(t) * len(t) / sum(t)))
            if r.step > self._last[0]:
                self._last = (r.step, seen)
        while len(self._open) > _OPEN_STEPS:
            del self._open[min(self._open)]
