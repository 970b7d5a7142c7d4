"""A mixture of named sources as a plain value, and how many samples of each an epoch holds.

The semantics follow MosaicML Streaming's streams (docs/data-order.md says where they differ):
each source gives at most one of

- `repeat`: copies of the source per epoch (2 = every row twice, 0.5 = half of the rows). The
  fraction is drawn without replacement and rotated over epochs (epoch_order.py), so every row
  gets its turn;
- `choose`: rows per epoch (more than the source holds: some rows twice, as with repeat);
- `weight`: a share of the epoch, which holds `epoch_samples` samples (or, unset, as many as
  all sources have rows). Weights are relative: give every source one or none.

A source with none of them is read once per epoch (with weights elsewhere: refused, as in
Streaming). With no spec at all and `epoch_samples` set, sources are weighted by their size.
`mix_by` says how the shares hold in every part of the epoch: `samples` (each tenth holds each
source's share of the samples) or `loss_tokens` (every window of steps holds its share of the
trained tokens). A `schedule` changes the weights from a step on; the `mix` command does the
same while the job runs.

Pure: row counts come in, counts go out; `MixtureError` (a ValueError) names the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from pipeline.errors import UserError

MIX_BY = ("samples", "loss_tokens")
DEFAULT_SOURCE = "default"  # the one source of a job without a mixture (source.paths)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class MixtureError(UserError, ValueError):
    """A mixture (or new weights for one) that cannot work; the message names the field. (A
    ValueError too: the config's validators raise it.)"""


@dataclass(frozen=True)
class MixSource:
    name: str
    paths: tuple[str, ...]
    format: str = "auto"
    repeat: float | None = None
    choose: int | None = None
    weight: float | None = None

    @property
    def spec(self) -> str | None:
        """Which of repeat / choose / weight it gives (None: none)."""
        given = [k for k in ("repeat", "choose", "weight") if getattr(self, k) is not None]
        return given[0] if given else None


@dataclass(frozen=True)
class ScheduleEntry:
    """From step `from_step` on, the sources' weights are `weights` (name -> weight)."""

    from_step: int
    weights: tuple[tuple[str, float], ...]

    def as_dict(self) -> dict[str, float]:
        return dict(self.weights)


@dataclass(frozen=True)
class Mixture:
    sources: tuple[MixSource, ...]
    mix_by: str = "samples"
    epoch_samples: int | None = None
    schedule: tuple[ScheduleEntry, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def check(self, where: str = "mixture") -> None:
        """Every rule a mixture's config must keep (row counts aside: `epoch_counts`)."""
        if not self.sources:
            raise MixtureError(f"{where}: give at least one source")
        if self.mix_by not in MIX_BY:
            raise MixtureError(f"mix_by must be one of {', '.join(MIX_BY)}, got {self.mix_by!r}")
        seen: set[str] = set()
        for i, s in enumerate(self.sources):
            at = f"{where}[{i}] ({s.name})"
            if not re.match(NAME_PATTERN, s.name):
                raise MixtureError(f"{at}: name must match {NAME_PATTERN}")
            if s.name in seen:
                raise MixtureError(f"{at}: the name {s.name!r} is given twice")
            seen.add(s.name)
            if not s.paths:
                raise MixtureError(f"{at}: give at least one path")
            given = [k for k in ("repeat", "choose", "weight") if getattr(s, k) is not None]
            if len(given) > 1:
                raise MixtureError(f"{at}: give at most one of repeat, choose, weight (got "
                                   f"{' and '.join(given)})")
            for k in ("repeat", "weight"):
                v = getattr(s, k)
                if v is not None and not (math.isfinite(v) and v >= 0):
                    raise MixtureError(f"{at}.{k} must be a finite number >= 0, got {v}")
            if s.choose is not None and s.choose < 0:
                raise MixtureError(f"{at}.choose must be >= 0, got {s.choose}")
        specs = {s.spec for s in self.sources}
        if "weight" in specs and specs != {"weight"}:
            plain = [s.name for s in self.sources if s.spec != "weight"]
            raise MixtureError(f"{where}: weight is relative, so give every source a weight or "
                               f"none (no weight on: {', '.join(plain)}); use repeat or choose "
                               "for absolute counts")
        if "weight" in specs:
            check_weights(self.names, {s.name: s.weight for s in self.sources}, where)
        if self.epoch_samples is not None:
            if self.epoch_samples < 1:
                raise MixtureError(f"epoch_samples must be >= 1, got {self.epoch_samples}")
            if specs & {"repeat", "choose"}:
                raise MixtureError("epoch_samples sets the size of a weighted epoch: it cannot go "
                                   "with repeat or choose (give weights instead)")
        steps = [e.from_step for e in self.schedule]
        if steps != sorted(set(steps)):
            raise MixtureError(f"schedule: from_step must increase, got {steps}")
        for j, e in enumerate(self.schedule):
            if e.from_step < 0:
                raise MixtureError(f"schedule[{j}].from_step must be >= 0, got {e.from_step}")
            check_weights(self.names, e.as_dict(), f"schedule[{j}].weights")

    def epoch_counts(self, rows: Sequence[int]) -> list[int]:
        """Samples of each source in one epoch, from the sources' row counts."""
        for s, n in zip(self.sources, rows, strict=True):
            if n <= 0:
                raise MixtureError(f"source {s.name!r} holds no rows ({', '.join(s.paths)}): "
                                   "remove it from the mixture or give it data")
        specs = {s.spec for s in self.sources}
        if specs == {"weight"}:
            total = self.epoch_samples if self.epoch_samples is not None else sum(rows)
            counts = apportion(total, [s.weight or 0.0 for s in self.sources])
        elif specs == {None} and self.epoch_samples is not None:
            counts = apportion(self.epoch_samples, [float(n) for n in rows])
        else:
            counts = [_absolute(s, n) for s, n in zip(self.sources, rows, strict=True)]
        if sum(counts) <= 0:
            raise MixtureError("the mixture holds no samples per epoch (every repeat/choose is 0)")
        return counts


def _absolute(s: MixSource, rows: int) -> int:
    if s.choose is not None:
        return s.choose
    r = Fraction(s.repeat if s.repeat is not None else 1)
    return math.floor(r * rows + Fraction(1, 2))  # round half up, exactly


def check_weights(names: Sequence[str], weights: Mapping[str, float], where: str) -> None:
    """Weights for every source of the mixture (by name), each >= 0, summing to > 0."""
    unknown = [n for n in weights if n not in names]
    if unknown:
        raise MixtureError(f"{where}: unknown source {', '.join(map(repr, unknown))} (the "
                           f"mixture has {', '.join(names)})")
    missing = [n for n in names if n not in weights]
    if missing:
        raise MixtureError(f"{where}: give every source a weight (missing: "
                           f"{', '.join(missing)}); 0 leaves a source out")
    for n, w in weights.items():
        if not (isinstance(w, int | float) and math.isfinite(w) and w >= 0):
            raise MixtureError(f"{where}: the weight of {n!r} must be a finite number >= 0, "
                               f"got {w!r}")
    if not sum(weights.values()) > 0:
        raise MixtureError(f"{where}: the weights must sum to a positive number, got "
                           f"{sum(weights.values())}")


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights` by largest remainder (ties: lower index), with
    exact fractions, so every machine splits alike."""
    ws = [Fraction(w) for w in weights]
    s = sum(ws)
    if s <= 0:
        raise MixtureError("weights must sum to a positive number")
    quotas = [total * w / s for w in ws]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    order = sorted(range(len(ws)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def parse_weights(text: str) -> dict[str, float]:
    """`a=0.5,b=0.5` -> {"a": 0.5, "b": 0.5} (the `mix --weights` syntax)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise MixtureError(f"--weights: {part!r} is not name=weight")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise MixtureError(f"--weights: the weight of {name.strip()!r} is not a number: "
                               f"{value!r}") from None
    if not out:
        raise MixtureError("--weights: give name=weight for every source, e.g. a=0.5,b=0.5")
    return out
