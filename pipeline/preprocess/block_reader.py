"""Reading one block of an epoch's order: its rows, unit by unit, each unit read once.

An `OrderBlock` (pipeline/order/epoch_order.py) names, per source, pieces of read units and how
their rows go. `read_block` reads the pieces (adjacent pieces of a file as one read: a block in
file order is one read per file), a few at a time on threads (remote storage answers each
request in tens of milliseconds; local files do not mind), and returns the block's rows in
position order as `(file, row, copy, raw)`, what `Processor.process_rows` takes. Never a
request per row: the number of reads is the number of units the block touches (S3 requests are
counted in tests/order/test_remote_sources.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pipeline.preprocess.process import RawRow
from pipeline.preprocess.sources import SourceFile, is_remote, read_rows

if TYPE_CHECKING:
    from pipeline.order.epoch_order import OrderBlock

READ_THREADS = 16


def _runs(block: OrderBlock) -> list[tuple[int, int, int, int]]:
    """(source, file, first row, end row) of each read: a part's adjacent pieces of one file
    merged, each distinct run once."""
    runs: dict[tuple[int, int, int, int], None] = {}
    for part in block.parts:
        cur: list[int] | None = None
        for p in part.pieces:
            if cur is not None and cur[0] == p.file and cur[2] == p.first_row:
                cur[2] += p.num_rows
                continue
            if cur is not None:
                runs[(part.source, cur[0], cur[1], cur[2])] = None
            cur = [p.file, p.first_row, p.first_row + p.num_rows]
        if cur is not None:
            runs[(part.source, cur[0], cur[1], cur[2])] = None
    return list(runs)


def read_block(block: OrderBlock, files: Sequence[Sequence[SourceFile]], skip: int = 0
               ) -> list[RawRow]:
    """The block's rows from position `block.start + skip` on. `files[s][f]` is file f of
    source s."""
    runs = _runs(block)
    remote = any(is_remote(files[s][f].path) for s, f, _, _ in runs)

    def read(run: tuple[int, int, int, int]) -> list[Any]:
        s, f, a, b = run
        return read_rows(files[s][f], a, b)

    if len(runs) > 1 and (remote or len(runs) > 4):
        with ThreadPoolExecutor(min(READ_THREADS, len(runs)),
                                thread_name_prefix="block-read") as pool:
            got = dict(zip(runs, pool.map(read, runs), strict=True))
    else:
        got = {r: read(r) for r in runs}
    raw: dict[tuple[int, int, int], Any] = {}
    for (s, f, a, _), rows in got.items():
        for i, value in enumerate(rows):
            raw[(s, f, a + i)] = value
    per_part = [[(files[part.source][p.file], p.first_row + r, p.copy,
                  raw[(part.source, p.file, p.first_row + r)])
                 for p in part.pieces for r in range(p.num_rows)] for part in block.parts]
    return block.arrange(per_part)[skip:]
