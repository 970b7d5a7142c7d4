"""Where a job's order stands: the feed's resume point, and the mixture changes in force.

The producer keeps an `OrderCursor` beside the planner state in its checkpoint (published
with the steps it planned, atomically), so a restarted producer, a replay or a resume reads the
same order: the epoch's position (positions are rows, quarantined ones included) and every
mixture change this epoch took, at the position it took effect. A change is re-derived from
nothing else: the `mix` request it applied is named by its sequence number (`mix_seq`), the
schedule entries by how many were applied (`schedule_next`), so neither is applied twice.

`position` travels as the checkpoint's row count (`PlannerCheckpoint.samples_consumed`); the
rest as JSON (`PlannerCheckpoint.order`), empty for a job that never changed its mixture, so a
checkpoint of an earlier build reads as the cursor it was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MixChange:
    """From `position` of the epoch on (the first step planned with it: `step`), the rest of
    the epoch holds `counts[i]` samples of source i: `weights` (name -> weight) applied by
    `by` ("mix 3": the third `mix` request; "schedule 0": the first schedule entry)."""

    position: int
    step: int
    counts: tuple[int, ...]
    weights: tuple[tuple[str, float], ...]
    by: str

    def to_list(self) -> list:
        return [self.position, self.step, list(self.counts), [list(w) for w in self.weights],
                self.by]

    @classmethod
    def from_list(cls, x: list) -> MixChange:
        return cls(int(x[0]), int(x[1]), tuple(int(c) for c in x[2]),
                   tuple((str(n), float(w)) for n, w in x[3]), str(x[4]))


@dataclass(frozen=True)
class OrderCursor:
    """The feed's resume point in an epoch and the mixture in force.

    `weights`: the weights every epoch starts with (None: the configured mixture's counts);
    `changes`: the changes taken in the current epoch (its first positions keep the epoch's
    start counts until the first change); `published`: per source, what the epoch's published
    steps hold of it and its records quarantined (samples, loss tokens, quarantined), for a
    mixture's status."""

    position: int = 0
    changes: tuple[MixChange, ...] = ()
    weights: tuple[tuple[str, float], ...] | None = None
    mix_seq: int = 0
    schedule_next: int = 0
    published: tuple[tuple[int, int, int], ...] = ()

    def at(self, position: int) -> OrderCursor:
        return replace(self, position=position)

    def next_epoch(self) -> OrderCursor:
        """The cursor at the next epoch's start: the weights in force stay, changes and
        counts reset."""
        weights = self.changes[-1].weights if self.changes else self.weights
        return OrderCursor(0, (), weights, self.mix_seq, self.schedule_next)

    def with_change(self, change: MixChange, *, mix_seq: int | None = None,
                    schedule_next: int | None = None) -> OrderCursor:
        keep = tuple(c for c in self.changes if c.position < change.position)
        return replace(self, changes=(*keep, change),
                       mix_seq=self.mix_seq if mix_seq is None else mix_seq,
                       schedule_next=(self.schedule_next if schedule_next is None
                                      else schedule_next))

    @property
    def weights_now(self) -> tuple[tuple[str, float], ...] | None:
        """The weights in force at `position` (None: the configured mixture)."""
        return self.changes[-1].weights if self.changes else self.weights

    def extras(self) -> bytes:
        """Everything but the position, as JSON (empty for a cursor that never changed)."""
        if not (self.changes or self.weights is not None or self.mix_seq or self.schedule_next
                or self.published):
            return b""
        d: dict = {"c": [c.to_list() for c in self.changes], "m": self.mix_seq,
                   "s": self.schedule_next}
        if self.weights is not None:
            d["w"] = [list(w) for w in self.weights]
        if self.published:
            d["p"] = [list(p) for p in self.published]
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def restore(cls, position: int, extras: bytes) -> OrderCursor:
        if not extras:
            return cls(position)
        d = json.loads(extras)
        weights = d.get("w")
        return cls(position, tuple(MixChange.from_list(c) for c in d["c"]),
                   None if weights is None else tuple((str(n), float(w)) for n, w in weights),
                   int(d["m"]), int(d["s"]),
                   tuple((int(a), int(b), int(c)) for a, b, c in d.get("p", ())))
