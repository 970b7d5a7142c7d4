"""A source's rows cut into read units: runs of many rows, each read with one request.

- JSONL: runs of `unit_rows` lines (a multiple of the line index's stride) starting on the
  index's anchors, so a unit's bytes are exactly one anchored span: one ranged read, nothing
  read twice.
- Parquet: the file's row groups. Parquet reads a group's column chunks whole, so a smaller
  unit would read its group again for every part; a file written with huge row groups (pyarrow's
  default is 1Mi rows) shuffles coarsely and holds a group in memory while it is read
  (docs/data-order.md).

`SourceLayout` is one source as the order sees it: its files and their units as numpy arrays
(a billion-row source has ~16M units; Python objects for each would not fit). `layout` reads
only what sources.py already indexes (JSONL line anchors, Parquet footers), never rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipeline.preprocess.sources import SourceFile

INDEX_STRIDE = 64  # the JSONL line index's stride (sources.INDEX_STRIDE; checked in its tests)


@dataclass(frozen=True, eq=False)
class SourceLayout:
    """A named source: its files (sample ids name them) and their read units, in file order.

    Unit u is rows [first[u], first[u] + rows[u]) of file `file[u]` and reads `nbytes[u]`
    raw bytes from `offset[u]` (JSONL: the byte offset of its first row; Parquet: its row
    group's index; -1: not known, read through the file's index)."""

    name: str
    files: tuple[SourceFile, ...]
    file: np.ndarray  # int64 [units]
    first: np.ndarray  # int64 [units]
    rows: np.ndarray  # int64 [units]
    nbytes: np.ndarray  # int64 [units]
    offset: np.ndarray  # int64 [units]

    @property
    def num_rows(self) -> int:
        return int(self.rows.sum())

    @property
    def num_units(self) -> int:
        return len(self.rows)

    @property
    def row_bytes(self) -> float:
        """Mean raw bytes per row (0 for an empty source)."""
        n = self.num_rows
        return float(self.nbytes.sum()) / n if n else 0.0


def jsonl_units(rows: int, anchors: np.ndarray, unit_rows: int
                ) -> list[tuple[int, int, int, int]]:
    """(first row, rows, bytes, byte offset) of each unit of a JSONL file of `rows` lines whose
    line index has `anchors` (the offset of every INDEX_STRIDE-th line, then the file size)."""
    if unit_rows <= 0 or unit_rows % INDEX_STRIDE:
        raise ValueError(f"unit_rows must be a positive multiple of {INDEX_STRIDE}, got "
                         f"{unit_rows}")
    out = []
    for r in range(0, rows, unit_rows):
        e = min(rows, r + unit_rows)
        start = int(anchors[r // INDEX_STRIDE])
        stop = int(anchors[-1]) if e == rows else int(anchors[e // INDEX_STRIDE])
        out.append((r, e - r, stop - start, start))
    return out


def parquet_units(group_rows: Sequence[int], group_bytes: Sequence[int]
                  ) -> list[tuple[int, int, int, int]]:
    """(first row, rows, bytes, row group) of each row group holding rows."""
    out, first = [], 0
    for g, (n, b) in enumerate(zip(group_rows, group_bytes, strict=True)):
        if n:
            out.append((first, int(n), int(b), g))
        first += int(n)
    return out


def file_read_units(f: SourceFile, unit_rows: int) -> list[tuple[int, int, int, int]]:
    """The units of one file (reads its index or footer, cached by sources.py)."""
    from pipeline.preprocess.sources import line_index, parquet_group_bytes, parquet_row_groups

    if f.kind == "jsonl":
        idx = line_index(f.path)
        return jsonl_units(idx.rows, idx.anchors, unit_rows)
    return parquet_units(parquet_row_groups(f.path).tolist(),
                         parquet_group_bytes(f.path).tolist())


def make_layout(name: str, files: Sequence[SourceFile],
                units: Sequence[Sequence[tuple[int, ...]]]) -> SourceLayout:
    """A layout from each file's units: (first row, rows, bytes[, offset])."""
    counts = [len(u) for u in units]
    flat = [(*u, -1)[:4] for per_file in units for u in per_file]
    arr = np.array(flat, dtype=np.int64).reshape(-1, 4)
    return SourceLayout(
        name=name, files=tuple(files),
        file=np.repeat(np.arange(len(files), dtype=np.int64), counts),
        first=arr[:, 0].copy(), rows=arr[:, 1].copy(), nbytes=arr[:, 2].copy(),
        offset=arr[:, 3].copy())


def layout(name: str, files: Sequence[SourceFile], unit_rows: int) -> SourceLayout:
    """The layout of a source's files, read from their indexes."""
    return make_layout(name, files, [file_read_units(f, unit_rows) for f in files])


def rows_layout(name: str, rows: int, unit_rows: int = INDEX_STRIDE) -> SourceLayout:
    """A source of `rows` rows held in memory (a lengths file, an array): one file named
    `name`, units of `unit_rows` rows, as a JSONL file of those rows would have."""
    from pipeline.preprocess.sources import SourceFile

    units = [(r, min(unit_rows, rows - r), min(unit_rows, rows - r))
             for r in range(0, rows, unit_rows)]
    return make_layout(name, [SourceFile(name, name, "jsonl")], [units])
