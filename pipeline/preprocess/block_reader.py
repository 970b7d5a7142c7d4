"""Reading one block of an epoch's order: its rows, unit by unit, each unit read once.

An `OrderBlock` (pipeline/order/epoch_order.py) names, per source, pieces of read units and how
their rows go. `read_block` reads the units those pieces lie in, whole (JSONL: one ranged read
of a unit's bytes, adjacent units of a file as one read: a block in file order is one read per
file; Parquet: a row group), a few at a time on threads (remote storage answers each request in
tens of milliseconds; local files do not mind), and returns the block's rows in position order
as `(file, row, copy, raw)`, what `Processor.process_rows` takes. Where the units are in their
files travels with the pieces (the driver's line index found them), so a Ray task reading a
block never indexes a file. Never a request per row: the reads are the units the block touches
(S3 requests are counted in tests/order/test_remote_sources.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pipeline.preprocess.process import RawRow
from pipeline.preprocess.sources import (
    SourceFile,
    is_remote,
    read_lines,
    read_row_group,
    read_rows,
)

if TYPE_CHECKING:
    from pipeline.order.epoch_order import OrderBlock, Piece

READ_THREADS = 16

# A read: (source, file, first unit's first row, rows, byte start, byte stop, row group); a
# JSONL run of adjacent units has its bytes, a Parquet unit its group, else (-1) the rows are
# read through the file's index.
_Read = tuple[int, int, int, int, int, int, int]


def _reads(block: OrderBlock, files: Sequence[Sequence[SourceFile]]) -> list[_Read]:
    """The distinct reads the block's pieces need: each unit once, adjacent JSONL units of a
    file merged into one read."""
    units: dict[tuple[int, int], Piece] = {}
    for part in block.parts:
        for p in part.pieces:
            units.setdefault((part.source, p.unit), p)
    out: list[_Read] = []
    cur: list[int] | None = None
    for (source, _), p in sorted(units.items()):
        jsonl = files[source][p.file].kind == "jsonl" and p.unit_offset >= 0
        if (cur is not None and jsonl and cur[0] == source and cur[1] == p.file
                and cur[6] < 0 and cur[5] == p.unit_offset
                and cur[2] + cur[3] == p.unit_first):
            cur[3] = p.unit_first + p.unit_rows - cur[2]
            cur[5] = p.unit_offset + p.unit_bytes
            continue
        if cur is not None:
            out.append(tuple(cur))  # type: ignore[arg-type]
        rows = p.unit_rows
        if jsonl:
            cur = [source, p.file, p.unit_first, rows, p.unit_offset,
                   p.unit_offset + p.unit_bytes, -1]
        else:  # a Parquet row group (its index), or a unit whose bytes are unknown
            cur = [source, p.file, p.unit_first, rows, -1, -1, p.unit_offset]
    if cur is not None:
        out.append(tuple(cur))  # type: ignore[arg-type]
    return out


def _read(files: Sequence[Sequence[SourceFile]], r: _Read) -> list[Any]:
    source, file, first, rows, start, stop, group = r
    f = files[source][file]
    if start >= 0:
        return read_lines(f.path, start, stop, rows)
    if group >= 0 and f.kind == "parquet":
        return read_row_group(f.path, group)  # (the whole group: its rows from `first`)
    return read_rows(f, first, first + rows)


def read_block(block: OrderBlock, files: Sequence[Sequence[SourceFile]], skip: int = 0
               ) -> list[RawRow]:
    """The block's rows from position `block.start + skip` on. `files[s][f]` is file f of
    source s."""
    reads = _reads(block, files)
    remote = any(is_remote(files[r[0]][r[1]].path) for r in reads)
    if len(reads) > 1 and (remote or len(reads) > 4):
        with ThreadPoolExecutor(min(READ_THREADS, len(reads)),
                                thread_name_prefix="block-read") as pool:
            got = list(pool.map(lambda r: _read(files, r), reads))
    else:
        got = [_read(files, r) for r in reads]
    raw: dict[tuple[int, int, int], Any] = {}
    for (s, f, first, _, _, _, _), rows in zip(reads, got, strict=True):
        for i, value in enumerate(rows):
            raw[(s, f, first + i)] = value
    per_part = [[(files[part.source][p.file], p.first_row + r, p.copy,
                  raw[(part.source, p.file, p.first_row + r)])
                 for p in part.pieces for r in range(p.num_rows)] for part in block.parts]
    return block.arrange(per_part)[skip:]
