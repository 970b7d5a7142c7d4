"""The order of an epoch: which sample sits at each position, as a pure function.

`EpochOrder(seed, epoch, layouts, segments, settings)` places every sample of an epoch:
position -> (source, file, row, copy). It depends on nothing else: not on the world size, the
number of Ray workers, timing or restarts, so every reader of an epoch (the producer actor,
the bootstrap producer, `plan --data`, a producer restarted from its checkpoint) reads the same
order, and a resume from any position reads the same rest.

How (shuffled, the default; docs/data-order.md has the measured quality):

1. *Streams.* Each source's samples of the epoch form a stream of passes over its read units
   (read_units.py): pass k (< P, the source's whole copies this epoch) is every unit once,
   copy k, the units of each file in a seeded random order and the files interleaved evenly
   (so a source of several files mixes them in every part of a pass); pass P is the
   fraction (`repeat: 1.5`, `choose` below the rows), taken from a rotation of the units that
   is fixed across epochs, starting where the previous epoch's fraction ended, so every row
   gets its turn; later passes (a `mix` that asks more of a source) are whole again.
2. *Interleave.* Positions are shared among the sources by Webster's rule over their counts
   (interleave.py): every part of the epoch holds each source at its share, within a sample.
3. *Blocks.* The epoch is cut into blocks of `block_rows` positions (fewer when the sources'
   raw rows would pass `block_bytes`); a block holds, of each source, the next stretch of its
   stream, shuffled. A block's rows are read whole, unit by unit (never row by row), and held
   raw while its positions are processed in order: a block is the shuffle's buffer, bounded in
   rows and in bytes.

A `mix` change (or a `schedule` entry) at position q starts a new segment: the rest of the
epoch is shared by the new counts, each stream continuing where it stood. With `shuffle=False`
units keep file order (files one after another), nothing is shuffled, and a job of one source
read once is its files' rows in order, as before order existed.

Randomness comes from permute.py only (fixed across machines and library versions).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipeline.order.interleave import merge_order, prefix_counts
from pipeline.order.permute import permutation, random_keys, stream_key

if TYPE_CHECKING:
    from pipeline.order.read_units import SourceLayout

MiB = 1 << 20


@dataclass(frozen=True)
class OrderSettings:
    shuffle: bool = True
    block_rows: int = 65536
    block_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        if self.block_rows < 1 or self.block_bytes < 1:
            raise ValueError(f"block_rows and block_bytes must be >= 1, got {self.block_rows}, "
                             f"{self.block_bytes}")


@dataclass(frozen=True)
class Segment:
    """From position `start` on, the rest of the epoch holds `counts[i]` samples of source i."""

    start: int
    counts: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + sum(self.counts)


@dataclass(frozen=True, slots=True)
class Placement:
    """The sample at one position: row `row` of file `file` of source `source`, copy `copy`
    (0: the row's first appearance in the epoch)."""

    source: int
    file: int
    row: int
    copy: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows [first_row, first_row + num_rows) of one file, read for copy `copy`: part of read
    unit `unit`, which holds `unit_rows` rows from `unit_first` on and is read whole:
    `unit_bytes` bytes from `unit_offset` (JSONL; Parquet: `unit_offset` is its row group;
    -1: not known, read through the file's index)."""

    file: int
    first_row: int
    num_rows: int
    copy: int
    unit: int
    unit_first: int = 0
    unit_rows: int = 0
    unit_offset: int = -1
    unit_bytes: int = 0


@dataclass(frozen=True)
class BlockPart:
    """One source's share of a block: `pieces` are read whole, in order, and the block's k-th
    row of this source is row `take[k]` of all their rows (rows of a piece read for an earlier
    block that the block must not repeat are never taken)."""

    source: int
    pieces: tuple[Piece, ...]
    take: np.ndarray

    def rows(self) -> list[tuple[int, int, int]]:
        """(file, row, copy) of every row of the pieces, in piece order."""
        return [(p.file, p.first_row + r, p.copy) for p in self.pieces for r in range(p.num_rows)]


@dataclass(frozen=True)
class OrderBlock:
    """Positions [start, end) of the epoch: what to read, and how the rows go."""

    start: int
    end: int
    parts: tuple[BlockPart, ...]
    merge: np.ndarray  # the source of each position, in order

    def __len__(self) -> int:
        return self.end - self.start

    def arrange(self, rows_by_part: Sequence[Sequence]) -> list:
        """Items given per part, one per row of its pieces in piece order -> the block's items
        in position order."""
        taken = [[items[i] for i in part.take.tolist()]
                 for part, items in zip(self.parts, rows_by_part, strict=True)]
        at = {part.source: k for k, part in enumerate(self.parts)}
        nxt = [0] * len(self.parts)
        out = []
        for s in self.merge.tolist():
            k = at[s]
            out.append(taken[k][nxt[k]])
            nxt[k] += 1
        return out

    def placements(self) -> list[Placement]:
        return self.arrange([[Placement(part.source, *r) for r in part.rows()]
                             for part in self.parts])


def stratified_units(units: int, per_block: int, key: int) -> np.ndarray:
    """A seeded order of `units` units in which every run of `per_block` (a block's share of
    the source) holds one unit of each stratum, a stretch of consecutive units in file order: so
    each block samples the whole source evenly, not a random handful of its regions.

    The units form `per_block` strata of K or K - 1 consecutive units (K = ceil(units /
    per_block); the short strata spread evenly), dealt to K blocks: each stratum's units in a
    random order, so block j < K - 1 takes exactly one unit of every stratum, the last block the
    rest; each block's units then come in a random order (a block cut short, at a pass's end,
    takes a random subset of the strata). Read block by block: a permutation of range(units)."""
    m = min(per_block, units)
    k = -(-units // m)
    short = m * k - units  # strata of k - 1 units
    s = np.arange(m, dtype=np.int64)
    is_short = (((s + 1) * short) // m) > ((s * short) // m)
    sizes = np.where(is_short, k - 1, k)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    grid = starts[:, None] + np.arange(k, dtype=np.int64)[None, :]
    pad = np.arange(k)[None, :] >= sizes[:, None]
    keys = random_keys(key, m * k).reshape(m, k)
    keys[pad] = np.iinfo(np.uint64).max  # a short stratum's missing unit: the last block's
    grid[pad] = units
    cols = np.take_along_axis(grid, np.argsort(keys, axis=1, kind="stable"), axis=1).T
    order = np.argsort(random_keys(key ^ 0x5A5A5A5A5A5A5A5A, m * k).reshape(k, m),
                       axis=1, kind="stable")
    seq = np.take_along_axis(cols, order, axis=1).reshape(-1)
    return seq[seq < units]


class SourceStream:
    """A source's samples of one epoch in stream order (before the blocks shuffle them).
    `per_block`: about how many of its units one block takes (the strata of the unit order)."""

    def __init__(self, seed: int, epoch: int, layout: SourceLayout, count: int,
                 shuffle: bool, per_block: int = 1) -> None:
        self.seed, self.epoch, self.layout, self.shuffle = seed, epoch, layout, shuffle
        self.per_block = max(1, per_block)
        self.rows = layout.num_rows
        if self.rows <= 0:
            raise ValueError(f"source {layout.name!r} holds no rows")
        self.whole, self.part = divmod(count, self.rows)  # P whole passes, then f rows
        # Where this epoch's fraction starts in the rotation (the previous epoch's ended there).
        self.offset = (epoch * self.part) % self.rows

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a stream lives for one epoch)
    def _units(self, kind: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The unit order of a pass (kind "pass", number k) or of the rotation, and the rows
        before each unit in it (cumulative, with the total last)."""
        lay = self.layout
        if not self.shuffle:
            order = np.arange(lay.num_units, dtype=np.int64)
        else:
            key = (stream_key(self.seed, "rotation", lay.name) if kind == "rotation" else
                   stream_key(self.seed, self.epoch, "pass", lay.name, k))
            order = stratified_units(lay.num_units, self.per_block, key)
        cum = np.concatenate(([0], np.cumsum(lay.rows[order]))).astype(np.int64)
        return order, cum

    def _range(self, kind: str, k: int, a: int, b: int, copy: int) -> list[Piece]:
        """Rows [a, b) of one pass (or of the rotation) as pieces."""
        order, cum = self._units(kind, k)
        lay = self.layout
        out = []
        i = int(np.searchsorted(cum, a, side="right")) - 1
        while a < b:
            u = int(order[i])
            lo = a - int(cum[i])
            n = min(b, int(cum[i + 1])) - a
            out.append(Piece(int(lay.file[u]), int(lay.first[u]) + lo, n, copy, u,
                             int(lay.first[u]), int(lay.rows[u]), int(lay.offset[u]),
                             int(lay.nbytes[u])))
            a += n
            i += 1
        return out

    def pieces(self, a: int, b: int) -> list[Piece]:
        """Stream rows [a, b) as pieces, in stream order."""
        R, P, f = self.rows, self.whole, self.part
        out: list[Piece] = []
        while a < b:
            if a < P * R:  # a whole pass
                k, x = divmod(a, R)
                n = min(b - a, R - x)
                out += self._range("pass", k, x, x + n, k)
            elif a < P * R + f:  # the fraction, from the rotation (wrapping around)
                x = (self.offset + a - P * R) % R
                n = min(b - a, P * R + f - a, R - x)
                out += self._range("rotation", 0, x, x + n, P)
            else:  # asked for more than the epoch's count: whole passes again
                k, x = divmod(a - P * R - f, R)
                n = min(b - a, R - x)
                copy = P + (1 if f else 0) + k
                out += self._range("pass", copy, x, x + n, copy)
            a += n
        return out


@dataclass(frozen=True)
class _SegmentStart:
    """Where each source's sequence stands when a segment starts: first the rows a change
    interrupted (`left[i]`: pieces and the rows of them not yet placed, in their order), then
    its stream from `base[i]`."""

    base: tuple[int, ...]
    left: tuple[tuple[tuple[Piece, ...], np.ndarray] | None, ...]


class EpochOrder:
    """The order of one epoch (see the module docstring). `segments[0].start == 0`; each later
    segment starts inside the previous one (a mixture change at that position).

    A change inside a block keeps the block's positions before it as they were; the block's
    rows not yet placed go first into the new segment's sequences, so no row of the epoch is
    placed twice and none read for the epoch is skipped."""

    def __init__(self, seed: int, epoch: int, layouts: Sequence[SourceLayout],
                 segments: Sequence[Segment], settings: OrderSettings = OrderSettings()) -> None:
        if not segments or segments[0].start != 0:
            raise ValueError("the first segment starts at position 0")
        for s in segments:
            if len(s.counts) != len(layouts) or min(s.counts, default=0) < 0:
                raise ValueError(f"segment counts {s.counts} do not fit {len(layouts)} sources")
        for prev, s in itertools.pairwise(segments):
            if not prev.start < s.start <= prev.end:
                raise ValueError(f"segment at {s.start} is not inside the one at {prev.start}")
        self.seed, self.epoch, self.settings = int(seed), int(epoch), settings
        self.layouts = tuple(layouts)
        self.segments = tuple(segments)
        first = segments[0]
        size, total = self.block_size(first), max(1, sum(first.counts))
        self.streams = [SourceStream(seed, epoch, lay, n, settings.shuffle,
                                     round(size * n / total / (lay.num_rows / lay.num_units))
                                     if lay.num_units else 1)
                        for lay, n in zip(layouts, first.counts, strict=True)]
        self._starts = [_SegmentStart(tuple([0] * len(layouts)), tuple([None] * len(layouts)))]
        for k in range(1, len(segments)):
            self._starts.append(self._continue(k - 1, segments[k].start))
        self._file_source = {f.source: i for i, lay in enumerate(layouts) for f in lay.files}

    @property
    def size(self) -> int:
        """Positions in the epoch."""
        return self.segments[-1].end

    def with_change(self, position: int, counts: Sequence[int]) -> EpochOrder:
        """This order with the rest of the epoch from `position` shared by `counts`."""
        if position == 0:
            return EpochOrder(self.seed, self.epoch, self.layouts,
                              [Segment(0, tuple(counts))], self.settings)
        keep = [s for s in self.segments if s.start < position]
        return EpochOrder(self.seed, self.epoch, self.layouts,
                          [*keep, Segment(position, tuple(counts))], self.settings)

    def source_totals(self) -> list[int]:
        """The positions of each source in the whole epoch (its segments' parts)."""
        totals = [0] * len(self.layouts)
        for k, seg in enumerate(self.segments):
            used = prefix_counts(seg.counts, self._limit(k) - seg.start)
            totals = [t + u for t, u in zip(totals, used, strict=True)]
        return totals

    def source_of(self, file_name: str) -> int:
        """The mixture source of a file (by its name in sample ids)."""
        return self._file_source[file_name]

    def block_size(self, segment: Segment) -> int:
        """Positions per block of a segment: `block_rows`, fewer where the raw rows the block
        holds would pass `block_bytes` (at the segment's mix of sources)."""
        total = sum(segment.counts)
        if total == 0:
            return 1
        row_bytes = sum(c * lay.row_bytes for c, lay in zip(segment.counts, self.layouts,
                                                             strict=True)) / total
        by_bytes = int(self.settings.block_bytes // row_bytes) if row_bytes > 0 else total
        return max(1, min(self.settings.block_rows, by_bytes))

    def _segment_at(self, position: int) -> int:
        """The segment holding `position` (the last one starting at or before it)."""
        return max(k for k, s in enumerate(self.segments) if s.start <= position)

    def _bounds(self, k: int, g: int) -> tuple[int, int]:
        """Block g of segment k as the segment alone would have it (a later change cuts it
        short where it starts: `blocks`)."""
        seg = self.segments[k]
        size = self.block_size(seg)
        return seg.start + g * size, min(seg.end, seg.start + (g + 1) * size)

    def _limit(self, k: int) -> int:
        """Where segment k's positions end: at the next change, else at the epoch's end."""
        return self.segments[k + 1].start if k + 1 < len(self.segments) else self.segments[k].end

    def _continue(self, k: int, q: int) -> _SegmentStart:
        """Where the sequences stand at position q of segment k (the start of segment k + 1)."""
        seg, start = self.segments[k], self._starts[k]
        g = (q - seg.start) // self.block_size(seg)
        lo, hi = self._bounds(k, g)
        if q == lo:  # on a block boundary: nothing interrupted
            used = prefix_counts(seg.counts, q - seg.start)
            return _SegmentStart(self._advance(start, used), tuple([None] * len(self.layouts)))
        block = self._block(k, g)
        placed = np.bincount(block.merge[:q - lo], minlength=len(self.layouts))
        used = prefix_counts(seg.counts, hi - seg.start)
        left: list = [None] * len(self.layouts)
        for part in block.parts:
            rest = part.take[int(placed[part.source]):]
            if len(rest):
                left[part.source] = (part.pieces, rest)
        return _SegmentStart(self._advance(start, used), tuple(left))

    def _advance(self, start: _SegmentStart, used: Sequence[int]) -> tuple[int, ...]:
        """Stream positions after a segment's sequences gave `used` rows each."""
        out = []
        for i, u in enumerate(used):
            left = start.left[i]
            n_left = 0 if left is None else len(left[1])
            out.append(start.base[i] + max(0, u - n_left))
        return tuple(out)

    def _block(self, k: int, g: int) -> OrderBlock:
        seg, start = self.segments[k], self._starts[k]
        lo, hi = self._bounds(k, g)
        before = prefix_counts(seg.counts, lo - seg.start)
        after = prefix_counts(seg.counts, hi - seg.start)
        parts = []
        for i, (a, b) in enumerate(zip(before, after, strict=True)):
            if b == a:
                continue
            pieces: list[Piece] = []
            order: list[np.ndarray] = []
            left = start.left[i]
            n_left = 0 if left is None else len(left[1])
            if a < n_left:  # the interrupted block's rows come first
                pieces += left[0]
                order.append(left[1][a:min(b, n_left)])
            if b > n_left:
                offset = sum(p.num_rows for p in pieces)
                lo_s = start.base[i] + max(0, a - n_left)
                pieces += self.streams[i].pieces(lo_s, start.base[i] + b - n_left)
                order.append(offset + np.arange(b - max(a, n_left), dtype=np.int64))
            seq = np.concatenate(order)
            perm = (permutation(b - a, self.seed, self.epoch, "block", seg.start, g,
                                self.layouts[i].name)
                    if self.settings.shuffle else np.arange(b - a, dtype=np.int64))
            parts.append(BlockPart(i, tuple(pieces), seq[perm]))
        merge = merge_order([b - a for a, b in zip(before, after, strict=True)])
        return OrderBlock(lo, hi, tuple(parts), merge)

    def blocks(self, start: int = 0) -> Iterator[OrderBlock]:
        """The blocks from the one holding position `start` to the epoch's end."""
        if start >= self.size:
            return
        k = self._segment_at(start)
        while k < len(self.segments):
            seg, limit = self.segments[k], self._limit(k)
            g = max(0, start - seg.start) // self.block_size(seg)
            while True:
                lo, hi = self._bounds(k, g)
                if lo >= min(hi, limit):
                    break
                block = self._block(k, g)
                if hi > limit:  # a change starts inside: the block's rest is not placed here
                    block = OrderBlock(lo, limit, block.parts, block.merge[:limit - lo])
                yield block
                g += 1
            k += 1

    def placements(self, start: int = 0) -> Iterator[Placement]:
        """Every position's sample from `start` on (tests, `plan --lengths`)."""
        for block in self.blocks(start):
            skip = max(0, start - block.start)
            yield from block.placements()[skip:]

    def at(self, position: int) -> Placement:
        block = next(self.blocks(position))
        return block.placements()[position - block.start]
