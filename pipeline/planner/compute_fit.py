"""Fitting a batch's measured compute time from its shape: the model that balances ranks by time.

Trainers report how long each batch took to compute (forward + backward, not the wait in
collectives). Each job fits, online, a non-negative linear model of those seconds over a few
batch features (`FEATURES`), robust to the outliers a real trainer produces (GC pauses,
checkpoint steps, a noisy neighbour) and to nonsense reports (rejected and counted): nothing a
client reports can make the fit raise or keep its gate closed for good, and a fit that fails
anyway leaves the model in force and is tried again. The model is trusted -- the *gate* opens --
only once it predicts held-out batches within a stated relative error over enough reports; until
then the planner balances by tokens. When the error of the model in force drifts (another
model, another parallel layout) the old reports are dropped and the gate closes until a refit
passes again.

Pure: no I/O, no clock. numpy only (a Lawson-Hanson active-set NNLS on a handful of columns).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.planner.types import Collate, MeasuredSample

# What a batch's compute time is fitted on, in this order (a ComputeModel's coefficients follow
# it): a per-batch constant; text tokens (what the embedding/MLP of text costs); padded tokens
# (what the collate makes the model run, padding included); sum of L^2 over the rows the model
# runs (attention); visual tokens and images (a vision tower costs per patch and per image);
# samples (per-sample overhead). An image is a sample with visual tokens: the plan knows no more.
FEATURES = ("batch", "text_tokens", "padded_tokens", "attention", "visual_tokens", "images",
            "samples")


def batch_features(samples: Sequence[MeasuredSample], lengths: Sequence[int],
                   collate: Collate) -> tuple[float, ...]:
    """The `FEATURES` of a batch of `samples` whose token lengths (after truncation) are
    `lengths`, under `collate` (padded: every row runs at the longest length)."""
    if not lengths:
        return (0.0,) * len(FEATURES)
    n = len(lengths)
    visual = [min(s.num_visual_tokens, n_kept) for s, n_kept in zip(samples, lengths, strict=True)]
    text = sum(lengths) - sum(visual)
    if collate is Collate.PADDED:
        longest = max(lengths)
        padded = n * longest
        attention = n * longest * longest
    else:
        padded = sum(lengths)
        attention = sum(x * x for x in lengths)
    return (1.0, float(text), float(padded), float(attention), float(sum(visual)),
            float(sum(1 for v in visual if v > 0)), float(n))


def rank_features(batches: Sequence[tuple[Sequence[MeasuredSample], Sequence[int]]],
                  collate: Collate) -> tuple[float, ...]:
    """The `FEATURES` of a rank's micro-batches of one step, `(samples, lengths)` each: their
    sum (every feature adds up over batches, so a model's prediction of the rank's step is the
    sum of its micro-batches' predictions; "batch" counts them)."""
    total = [0.0] * len(FEATURES)
    for samples, lengths in batches:
        for i, f in enumerate(batch_features(samples, lengths, collate)):
            total[i] += f
    return tuple(total)


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """A fitted model in force: seconds = sum(coefficients[i] * features[i]) (`FEATURES` order).

    `error`: its held-out relative error when fitted; `reports`: how many reports it was fitted
    on. Frozen: a plan records the model its steps were balanced by, and a restored planner
    balances by the same one."""

    coefficients: tuple[float, ...]
    error: float = 0.0
    reports: int = 0

    def __post_init__(self) -> None:
        c = tuple(float(x) for x in self.coefficients)
        if len(c) != len(FEATURES):
            raise ValueError(f"a compute model has {len(FEATURES)} coefficients {FEATURES}, "
                             f"got {len(c)}")
        if any(not math.isfinite(x) or x < 0 for x in c):
            raise ValueError(f"compute model coefficients must be finite and >= 0, got {c}")
        if not math.isfinite(self.error) or self.error < 0:
            raise ValueError(f"compute model error must be finite and >= 0, got {self.error}")
        object.__setattr__(self, "coefficients", c)

    def predict(self, features: Sequence[float]) -> float:
        """Predicted seconds of a batch with these `FEATURES`."""
        return sum(c * f for c, f in zip(self.coefficients, features, strict=True))

    def named(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients, strict=True))

    def to_list(self) -> list[float]:
        """JSON form: the coefficients, then error and reports."""
        return [*self.coefficients, self.error, self.reports]

    @classmethod
    def from_list(cls, v: Sequence[float]) -> ComputeModel:
        *coefficients, error, reports = v
        return cls(tuple(coefficients), float(error), int(reports))


@dataclass(frozen=True, slots=True)
class ComputeReport:
    """A trainer's measurement: rank `rank` computed its batch of step `step` in `seconds`;
    `features` are that batch's `FEATURES` (from the published plan)."""

    step: int
    rank: int
    seconds: float
    features: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class FitSettings:
    """The fit's knobs. The gate: held-out error <= `max_error` over >= `min_reports` reports."""

    window: int = 512  # reports kept (the newest): a sliding window
    min_reports: int = 32
    max_error: float = 0.10
    # The first steps of each world run slower (allocator and kernel warm-up, compilation).
    warmup_steps: int = 3
    min_seconds: float = 1e-6  # a batch reported faster than this (a microsecond) is nonsense
    max_seconds: float = 3600.0  # a batch reported slower than this is nonsense
    refit_every: int = 16  # new reports between fits
    drift_reports: int = 32  # the newest reports the model in force is checked against
    drift_factor: float = 2.0  # drift: their error > drift_factor * max_error

    def __post_init__(self) -> None:
        if self.min_reports < 8 or self.window < self.min_reports:
            raise ValueError("need 8 <= min_reports <= window")
        if not 0 < self.max_error < 1:
            raise ValueError(f"max_error must be in (0, 1), got {self.max_error}")
        if self.warmup_steps < 0 or self.refit_every < 1 or self.drift_reports < 8:
            raise ValueError("warmup_steps >= 0, refit_every >= 1, drift_reports >= 8")
        if not 0 < self.min_seconds < self.max_seconds or self.drift_factor < 1:
            raise ValueError("0 < min_seconds < max_seconds and drift_factor >= 1")


HOLDOUT_EVERY = 4  # every 4th report is held out to judge a fit
# The worst 10% of held-out errors (at least one) are outliers (GC, checkpoints, a report that
# makes no sense), not model error; and no one report's error counts for more than 100%.
TRIM = 0.10
MAX_REPORT_ERROR = 1.0


class ComputeFitter:
    """Online fit for one job. `offer` reports, call `refit` now and then; `model` is the model
    in force (None: the gate is closed, balance by tokens)."""

    def __init__(self, settings: FitSettings | None = None,
                 model: ComputeModel | None = None) -> None:
        self.settings = settings or FitSettings()
        self.model = model  # carried over from a checkpoint: in force until drift says otherwise
        self.last_fit: ComputeModel | None = None  # the latest fit, passed the gate or not
        self._window: deque[ComputeReport] = deque(maxlen=self.settings.window)
        self._new = 0
        self.accepted = 0
        self.rejected = 0  # nonsense: not finite, outside [min_seconds, max_seconds], bad features
        self.warmup = 0  # left out: the first steps of a world
        self.drifts = 0
        self.failed = 0  # fits the arithmetic could not carry (the model in force stayed)

    @property
    def reports(self) -> int:
        return len(self._window)

    def offer(self, report: ComputeReport, *, world_first_step: int = 0) -> bool:
        """Take a report; False when it is left out (nonsense, counted in `rejected`; or a
        warm-up step of the world that began at `world_first_step`, counted in `warmup`)."""
        s = report.seconds
        f = report.features
        if (not isinstance(s, (int, float)) or not math.isfinite(s)
                or not self.settings.min_seconds <= s <= self.settings.max_seconds
                or len(f) != len(FEATURES) or any(not math.isfinite(x) or x < 0 for x in f)):
            self.rejected += 1
            return False
        if report.step < world_first_step + self.settings.warmup_steps:
            self.warmup += 1
            return False
        self._window.append(report)
        self.accepted += 1
        self._new += 1
        return True

    def refit(self, *, force: bool = False) -> ComputeModel | None:
        """Check the model in force for drift and fit again when `refit_every` reports arrived
        (or `force`); returns the model in force afterwards. Never raises: a fit that fails
        (counted in `failed`) keeps the model in force and is tried again at the next call."""
        if not force and self._new < self.settings.refit_every:
            return self.model
        try:
            with np.errstate(all="ignore"):  # overflow is an outcome here, not a warning
                fitted = self._drift_then_fit()
        except (ArithmeticError, ValueError, np.linalg.LinAlgError):
            self.failed += 1
            return self.model
        self._new = 0
        if fitted is not None:
            self.last_fit = fitted
            if fitted.error <= self.settings.max_error:
                self.model = fitted
        return self.model

    def _drift_then_fit(self) -> ComputeModel | None:
        """Retire the model in force if it drifted; then a fit of the window (None: too few
        reports)."""
        cfg = self.settings
        if self.model is not None and len(self._window) >= cfg.drift_reports:
            recent = list(self._window)[-cfg.drift_reports:]
            if _error(self.model.coefficients, recent) > cfg.drift_factor * cfg.max_error:
                # The trainer changed: what came before describes another trainer.
                self.drifts += 1
                self.model = None
                self._window = deque(recent, maxlen=cfg.window)
        return fit(list(self._window)) if len(self._window) >= cfg.min_reports else None


def fit(reports: Sequence[ComputeReport]) -> ComputeModel:
    """Fit `reports` (at least 2*HOLDOUT_EVERY): the error is measured on every HOLDOUT_EVERY-th
    report by a fit of the others; the coefficients returned are then fitted on all of them."""
    if len(reports) < 2 * HOLDOUT_EVERY:
        raise ValueError(f"need at least {2 * HOLDOUT_EVERY} reports, got {len(reports)}")
    held = [r for i, r in enumerate(reports) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train = [r for i, r in enumerate(reports) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    error = _error(robust_fit(train), held)
    return ComputeModel(robust_fit(reports), error, len(reports))


def _error(coefficients: Sequence[float], reports: Sequence[ComputeReport]) -> float:
    """Mean |predicted / measured - 1| over `reports`, each at most MAX_REPORT_ERROR, the worst
    TRIM of them (at least one of two or more) left out."""
    x, y = _arrays(reports)
    rel = np.sort(np.minimum(np.abs(x @ np.asarray(coefficients) / y - 1.0), MAX_REPORT_ERROR))
    keep = len(rel) - min(len(rel) - 1, math.ceil(len(rel) * TRIM))
    error = float(rel[:keep].mean())
    if not math.isfinite(error):
        raise ArithmeticError(f"the fit's error is {error}")
    return error


def _arrays(reports: Sequence[ComputeReport]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([r.features for r in reports], dtype=float).reshape(len(reports), len(FEATURES))
    return x, np.array([r.seconds for r in reports], dtype=float)


def robust_fit(reports: Sequence[ComputeReport], *, rounds: int = 8,
               huber: float = 1.345, cut: float = 4.0) -> tuple[float, ...]:
    """Non-negative coefficients minimising the relative error of `reports`, robustly.

    Iteratively reweighted; no one report can steer it, however far off its seconds are. The
    first round fits the reports whose seconds lie in the middle 80% (relative errors: a long
    batch does not outweigh many short ones). Every later round weighs each report by the
    previous round's prediction, not by its measured seconds (a report far below its batch's
    time would otherwise outweigh all the others: its relative error is at most 1 this way),
    with Huber weights on the residuals' robust scale (MAD, around their median); reports beyond
    `cut` scales (a GC pause, a checkpoint step, a report that makes no sense) get weight 0."""
    x, y = _arrays(reports)
    low, typical, high = np.quantile(y, [0.1, 0.5, 0.9])
    w = ((y >= low) & (y <= high)).astype(float)
    ref = y  # what each report's error is relative to
    coef = np.zeros(x.shape[1])
    for _ in range(rounds):
        sw = w / ref
        if not sw.any():
            break
        coef = nnls(x * sw[:, None], y * sw)
        # A batch predicted to take almost nothing counts as a thousandth of a typical one.
        ref = np.maximum(x @ coef, 1e-3 * typical)
        rel = (y - ref) / ref
        centre = float(np.median(rel[w > 0]))
        scale = max(1.4826 * float(np.median(np.abs(rel[w > 0] - centre))), 1e-3)
        a = np.abs(rel - centre) / scale
        w = np.where(a <= huber, 1.0, huber / np.maximum(a, 1e-12))
        w[a > cut] = 0.0
    if not np.isfinite(coef).all():
        raise ArithmeticError(f"the fit's coefficients are not finite: {coef}")
    return tuple(float(c) for c in coef)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set). Columns are scaled to
    unit norm first (the features differ by orders of magnitude); all-zero columns get 0."""
    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    scaled = np.zeros_like(a)
    scaled[:, live] = a[:, live] / norms[live]
    n = a.shape[1]
    max_iter = max_iter or 30 * n
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    tol = 1e-10 * max(1.0, float(np.abs(b).max(initial=0.0)))
    grad = scaled.T @ (b - scaled @ x)
    for _ in range(max_iter):
        free = ~passive & live
        if not free.any() or grad[free].max() <= tol:
            break
        passive[int(np.argmax(np.where(free, grad, -np.inf)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(scaled[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                break
            bad = passive & (z <= 0)
            step = x[bad] - z[bad]  # > 0 except where both are 0 (then that column just leaves)
            alpha = float(np.min(np.where(step > 0, x[bad] / np.where(step > 0, step, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol * 1e-3
            if not passive.any():
                z = np.zeros(n)
                break
        x = z
        grad = scaled.T @ (b - scaled @ x)
    out = np.zeros(n)
    out[live] = np.maximum(x[live], 0.0) / norms[live]
    return out
