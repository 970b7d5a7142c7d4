"""A job's sources and order settings -> each epoch's `EpochOrder`; and what a mixture change
does to an epoch.

Built once per process that reads the job's order (the producer actor, the bootstrap producer,
`plan --data`): the sources' files and read units come from their indexes (sources.py; a
JSONL file's line index is cached per process), so building it reads no row. Every reader
builds the same order from the same config and cursor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.config import SourceConfig
from pipeline.order.cursor import MixChange, OrderCursor
from pipeline.order.epoch_order import EpochOrder, Segment
from pipeline.order.mixture import Mixture, MixtureError, apportion, check_weights
from pipeline.order.read_units import SourceLayout, layout
from pipeline.preprocess.sources import SourceFile, expand_paths


@dataclass(frozen=True)
class SourceTarget:
    """A source's target in part of an epoch: its name and its share of the samples there."""

    name: str
    share: float


class JobOrder:
    def __init__(self, source: SourceConfig, seed: int) -> None:
        self.config = source
        self.seed = int(seed)
        self.mixture: Mixture = source.mixture_value()
        self.settings = source.order_settings()
        files = [expand_paths(s.paths, s.format) for s in self.mixture.sources]
        seen: dict[str, str] = {}
        for s, fs in zip(self.mixture.sources, files, strict=True):
            for f in fs:
                if f.source in seen:
                    raise MixtureError(f"source {s.name!r}: {f.source} is also in source "
                                       f"{seen[f.source]!r} (a file belongs to one source)")
                seen[f.source] = s.name
        self.layouts: list[SourceLayout] = [
            layout(s.name, fs, source.read_unit_rows)
            for s, fs in zip(self.mixture.sources, files, strict=True)]
        self.rows = [lay.num_rows for lay in self.layouts]
        self.base_counts = self.mixture.epoch_counts(self.rows)  # raises on an empty source

    @property
    def names(self) -> tuple[str, ...]:
        return self.mixture.names

    @property
    def files(self) -> list[SourceFile]:
        return [f for lay in self.layouts for f in lay.files]

    @property
    def epoch_size(self) -> int:
        """Samples per epoch (a change of weights moves them among sources, not their sum)."""
        return sum(self.base_counts)

    def counts(self, weights: Sequence[tuple[str, float]] | None, total: int) -> list[int]:
        """`total` samples shared by `weights` (None: the configured mixture's counts)."""
        if weights is None:
            return list(self.base_counts)
        w = dict(weights)
        return apportion(total, [w[n] for n in self.names])

    def epoch(self, epoch: int, cursor: OrderCursor) -> EpochOrder:
        """The order of `epoch` with the cursor's mixture changes."""
        segments = [Segment(0, tuple(self.counts(cursor.weights, self.epoch_size)))]
        for c in cursor.changes:
            if c.position == 0:
                segments = [Segment(0, c.counts)]
            else:
                segments = [s for s in segments if s.start < c.position]
                segments.append(Segment(c.position, c.counts))
        return EpochOrder(self.seed, epoch, self.layouts, segments, self.settings)

    def change(self, order: EpochOrder, cursor: OrderCursor, weights: Mapping[str, float], *,
               step: int, by: str, mix_seq: int | None = None,
               schedule_next: int | None = None) -> OrderCursor:
        """The cursor with `weights` in force from its position on (checked: every source
        named, each >= 0, summing to > 0)."""
        check_weights(self.names, weights, by)
        ordered = tuple((n, float(weights[n])) for n in self.names)
        rest = order.size - cursor.position
        counts = tuple(self.counts(ordered, rest))
        return cursor.with_change(MixChange(cursor.position, step, counts, ordered, by),
                                  mix_seq=mix_seq, schedule_next=schedule_next)

    def targets(self, order: EpochOrder, position: int) -> list[SourceTarget]:
        """Each source's share of the samples of the segment that holds `position`."""
        seg = order.segments[max(k for k, s in enumerate(order.segments) if s.start <= position)]
        total = sum(seg.counts) or 1
        return [SourceTarget(n, c / total) for n, c in zip(self.names, seg.counts, strict=True)]
