"""Source files, their exact row numbering, and reading rows by range or by index.

Rows are numbered by the source itself (0-based JSONL line / Parquet row), never by Ray's block
layout, so `sample_id = "<source>:<row>"` is stable across runs, block sizes and restarts. A
JSONL file is indexed once (`LineIndex`: the byte offset of every 64th line start, found by
Ray tasks over byte ranges for large files, cached per process), which gives both the read plan
(chunks of whole lines, read in parallel by Ray tasks; their row counts may differ per file,
task_size.py) and random access for `SampleStore` (one read of at most 64 lines). JSONL is read
as bytes and parsed by us: a bad line becomes a quarantined row instead of failing Ray's JSON
reader. Local paths and any URI pyarrow's filesystems understand (s3://, gs://, ...) work.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import posixpath
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import numpy as np

from pipeline.config import SourceConfig
from pipeline.errors import UserError

Kind = Literal["jsonl", "parquet"]
_DATA_EXT = (".jsonl", ".json", ".parquet", ".pq")
_INDEX_BLOCK = 16 * 1024 * 1024
_FIRST_ROW_BYTES = 16 * 1024 * 1024  # the most `check_sources` reads of a first JSONL row


class SourceNotFound(UserError):
    """A configured source path does not exist (or holds no data files)."""


@dataclass(frozen=True)
class SourceFile:
    source: str  # the name used in sample ids (the path as configured)
    path: str  # what we open: a local path or a URI
    kind: Kind


@dataclass(frozen=True)
class Chunk:
    """A contiguous run of rows of one file: one Ray task's input."""

    file: SourceFile
    first_row: int
    num_rows: int
    byte_start: int = 0  # jsonl: the anchored bytes that hold the rows (LineIndex.span)
    byte_end: int = 0
    span_first_row: int = 0  # jsonl: the row at byte_start
    span_rows: int = 0  # jsonl: rows in [byte_start, byte_end)
    row_group: int = -1  # parquet
    group_offset: int = 0  # parquet: first row's position inside the row group


def _is_uri(path: str) -> bool:
    return "://" in path


def is_remote(path: str) -> bool:
    """A URI of one of pyarrow's filesystems (s3://, gs://, ...), not a local path or file://."""
    return _is_uri(path) and not path.startswith("file://")


@functools.lru_cache(maxsize=256)
def _remote_fs(path: str) -> tuple[Any, str]:
    """The pyarrow filesystem of a remote URI and the path inside it (one filesystem per URI
    and process: creating one starts a cloud SDK client, seconds on a busy machine, and a
    shuffled epoch opens its files again for every block)."""
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(path)


def open_input(path: str) -> BinaryIO:
    """A source file (local path, file:// or remote URI) opened for reading bytes, seekable."""
    if is_remote(path):
        fs, p = _remote_fs(path)
        return fs.open_input_file(p)
    return open(path.removeprefix("file://"), "rb")


def _kind(path: str, fmt: str) -> Kind:
    if fmt != "auto":
        return fmt  # type: ignore[return-value]
    name = path.split("?", 1)[0] if is_remote(path) else path  # a URI's query is no part of it
    return "parquet" if name.lower().endswith((".parquet", ".pq")) else "jsonl"


def expand_sources(cfg: SourceConfig) -> list[SourceFile]:
    """Every file of a job's sources, in deterministic order (a mixture's sources in turn; each
    one's paths in config order, then sorted names). A file is in one source only."""
    out = [f for s in cfg.mixture_value().sources for f in expand_paths(s.paths, s.format)]
    names = [f.source for f in out]
    if len(set(names)) != len(names):
        raise UserError("source.paths lists the same file twice")
    return out


def expand_paths(paths: Sequence[str], fmt: str = "auto") -> list[SourceFile]:
    """Paths of one source -> files in deterministic order (given order, then sorted names)."""
    out: list[SourceFile] = []
    for entry in paths:
        if is_remote(entry):
            import pyarrow.fs as pafs

            fs, root = _remote_fs(entry)
            info = fs.get_file_info(root)
            if info.type == pafs.FileType.NotFound:
                raise SourceNotFound(f"source not found: {entry}")
            if info.type == pafs.FileType.Directory:
                sel = pafs.FileSelector(root, recursive=True)
                names = sorted(i.path for i in fs.get_file_info(sel)
                               if i.is_file and i.path.lower().endswith(_DATA_EXT))
                scheme = entry.split("://", 1)[0]
                files = [f"{scheme}://{n}" for n in names]
            else:
                files = [entry]
        else:
            local = entry.removeprefix("file://")
            if any(c in local for c in "*?["):
                files = sorted(glob.glob(local, recursive=True))
            elif os.path.isdir(local):
                files = sorted(
                    os.path.join(dp, f) for dp, _, fs_ in os.walk(local) for f in fs_
                    if f.lower().endswith(_DATA_EXT)
                )
            elif os.path.isfile(local):
                files = [local]
            else:
                raise SourceNotFound(f"source not found: {entry}" + (
                    "" if os.path.isabs(local) else f" (relative to the working directory "
                    f"{os.getcwd()}: {os.path.abspath(local)})"))
        if not files:
            raise SourceNotFound(f"source holds no .jsonl/.parquet files: {entry}")
        out += [SourceFile(f, f, _kind(f, fmt)) for f in files]
    names = [f.source for f in out]
    if len(set(names)) != len(names):
        raise UserError("source.paths lists the same file twice")
    return out


def check_sources(cfg: SourceConfig) -> None:
    """What `serve` checks before it starts: every configured path exists (a relative one is
    named as resolved against the working directory), and the first file of each is readable
    and its first row parses (a JSON line, a Parquet row). A `UserError` says which and why."""
    expand_sources(cfg)  # every path (and no file twice)
    checked: set[str] = set()
    mixture = cfg.mixture is not None
    for i, source in enumerate(cfg.mixture_value().sources):
        fmt = f"source.mixture[{i}].format" if mixture else "source.format"
        for entry in source.paths:
            first = expand_paths([entry], source.format)[0]
            if first.path in checked:
                continue
            checked.add(first.path)
            name = f"source {source.name!r}: {entry}" if mixture else f"source {entry}"
            try:
                _first_row(first)
            except OSError as exc:
                raise UserError(f"{name}: cannot read {first.path}: "
                                f"{exc.strerror or exc}") from None
            except ValueError as exc:
                raise UserError(f"{name}: the first row of {first.path} does not parse as "
                                f"{first.kind} ({exc}); is {fmt} right?") from None


def _first_row(f: SourceFile) -> None:
    """Read and parse `f`'s first row (the first non-empty line of a JSONL file): ValueError
    when it does not parse, OSError when the file cannot be read."""
    if f.kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            with open_input(f.path) as src:
                next(pq.ParquetFile(src).iter_batches(batch_size=1), None)
        except pa.ArrowInvalid as exc:
            raise ValueError(str(exc)) from None
        return
    with open_input(f.path) as src:
        line = b""
        while not line.strip():
            line = src.readline(_FIRST_ROW_BYTES)
            if not line:
                return  # an empty file: nothing to parse
    if not line.endswith(b"\n") and len(line) >= _FIRST_ROW_BYTES:
        return  # a row longer than the check reads: preprocessing judges it
    json.loads(line)


def read_bytes(path: str, start: int = 0, end: int | None = None) -> bytes:
    with open_input(path) as f:
        if start:  # a whole file needs no seek: a pipe (FIFO) reads too
            f.seek(start)
        return f.read() if end is None else f.read(end - start)


def resolve_relative(source_path: str, rel: str) -> str:
    """A path referenced from inside a source file is relative to that file's folder."""
    if _is_uri(rel) or os.path.isabs(rel):
        return rel
    if _is_uri(source_path):
        return posixpath.join(posixpath.dirname(source_path), rel)
    return os.path.join(os.path.dirname(source_path), rel)


def stat_key(path: str) -> tuple:
    """(path, size, mtime): what per-file caches are keyed by, so a changed file is re-read."""
    if is_remote(path):
        fs, p = _remote_fs(path)
        info = fs.get_file_info(p)
        return (path, info.size, info.mtime_ns)
    st = os.stat(path.removeprefix("file://"))
    return (path, st.st_size, st.st_mtime_ns)


# Every INDEX_STRIDE-th line start is kept: a read of rows [a, b) reads from the anchor at or
# before a to the one at or after b (at most 2 strides more than it needs), and the index costs
# 8 bytes per 64 lines. Files over INDEX_SPLIT_BYTES are indexed by Ray tasks over byte ranges
# (when Ray is up), so no process reads a whole large file to plan its rows.
INDEX_STRIDE = 64
INDEX_SPLIT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class LineIndex:
    """Where the rows of one JSONL file start: `anchors[k]` is the byte offset of line
    `k * INDEX_STRIDE` (for every k with a line there), then the file size as a sentinel. A
    final newline does not open another row."""

    rows: int
    size: int
    anchors: np.ndarray

    def span(self, first: int, end: int) -> tuple[int, int, int, int]:
        """Rows [first, end) lie in bytes [start, stop), which hold rows [anchor_row,
        anchor_row + rows_in_span): -> (start, stop, anchor_row, rows_in_span)."""
        a, b = first // INDEX_STRIDE, -(-end // INDEX_STRIDE)
        b = min(b, len(self.anchors) - 1)
        top = min(b * INDEX_STRIDE, self.rows)
        return int(self.anchors[a]), int(self.anchors[b]), a * INDEX_STRIDE, top - a * INDEX_STRIDE


def _newlines(path: str, start: int, end: int) -> np.ndarray:
    """Absolute offsets of the newlines in bytes [start, end), read in bounded blocks."""
    out = [np.zeros(0, dtype=np.int64)]
    pos = start
    while pos < end:
        block = read_bytes(path, pos, min(end, pos + _INDEX_BLOCK))
        if not block:
            break
        out.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10) + pos)
        pos += len(block)
    return np.concatenate(out).astype(np.int64, copy=False)


def _anchors_in(newlines: np.ndarray, first_newline: int, rows: int) -> np.ndarray:
    """Line starts that are anchors, among the lines opened by these newlines (newline number
    `g`, counted over the file from 0, opens line g + 1)."""
    opened = np.arange(first_newline + 1, first_newline + 1 + len(newlines), dtype=np.int64)
    keep = (opened % INDEX_STRIDE == 0) & (opened < rows)
    return newlines[keep] + 1


def _range_counts(path: str, start: int, end: int) -> tuple[int, np.ndarray]:
    nl = _newlines(path, start, end)
    return len(nl), nl


def _index_ranges(path: str, size: int) -> tuple[list[int], list[Any], Any]:
    """Per byte range: its newline count and its newline offsets (Ray refs when Ray is up and
    the file is large, else arrays), plus how to turn offsets into anchors."""
    ranges = [(s, min(size, s + INDEX_SPLIT_BYTES)) for s in range(0, size, INDEX_SPLIT_BYTES)]
    # Ray is up only in a process that imported it: never import it here (the bootstrap
    # producer indexes while `serve` imports Ray on another thread, and a second importer can
    # be handed the half-imported module).
    ray = sys.modules.get("ray") if len(ranges) > 1 else None
    is_up = getattr(ray, "is_initialized", None)
    distributed = callable(is_up) and is_up()
    if not distributed:
        done = [_range_counts(path, s, e) for s, e in ranges]
        return [c for c, _ in done], [nl for _, nl in done], _anchors_in
    count_task = ray.remote(num_cpus=0, num_returns=2)(_range_counts)
    pairs = [count_task.remote(path, s, e) for s, e in ranges]
    counts = ray.get([c for c, _ in pairs])
    anchor_task = ray.remote(num_cpus=0)(_anchors_in)

    def anchors(nl_ref: Any, first: int, rows: int) -> Any:
        return anchor_task.remote(nl_ref, first, rows)  # the offsets never leave the cluster

    return counts, [nl for _, nl in pairs], anchors


@functools.lru_cache(maxsize=64)
def _line_index(key: tuple) -> LineIndex:
    path, size = key[0], key[1]
    if size == 0:
        return LineIndex(0, 0, np.zeros(1, dtype=np.int64))
    counts, newlines, anchors_of = _index_ranges(path, size)
    ends_with_newline = read_bytes(path, size - 1, size) == b"\n"
    rows = sum(counts) + (0 if ends_with_newline else 1)
    parts, first = [], 0
    for n, nl in zip(counts, newlines, strict=True):
        parts.append(anchors_of(nl, first, rows))
        first += n
    if parts and not isinstance(parts[0], np.ndarray):
        import ray

        parts = ray.get(parts)
    anchors = np.concatenate([np.zeros(1, dtype=np.int64), *parts, np.array([size])])
    return LineIndex(rows, size, anchors.astype(np.int64, copy=False))


def line_index(path: str) -> LineIndex:
    """The file's `LineIndex` (cached per process while the file's size and mtime stay)."""
    return _line_index(stat_key(path))


@functools.lru_cache(maxsize=64)
def _parquet_groups(key: tuple) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow.parquet as pq

    md = pq.read_metadata(_open_parquet_target(key[0]))
    groups = [md.row_group(i) for i in range(md.num_row_groups)]
    return (np.array([g.num_rows for g in groups], dtype=np.int64),
            np.array([g.total_byte_size for g in groups], dtype=np.int64))


def _open_parquet_target(path: str):
    if is_remote(path):
        fs, p = _remote_fs(path)
        return fs.open_input_file(p)
    return path.removeprefix("file://")


def parquet_row_groups(path: str) -> np.ndarray:
    """Rows of each row group."""
    return _parquet_groups(stat_key(path))[0]


def parquet_group_bytes(path: str) -> np.ndarray:
    """Uncompressed bytes of each row group (what reading it holds in memory)."""
    return _parquet_groups(stat_key(path))[1]


def num_rows(f: SourceFile) -> int:
    if f.kind == "jsonl":
        return line_index(f.path).rows
    return int(parquet_row_groups(f.path).sum())


ChunkRows = int | Callable[[SourceFile], int]


def plan_chunks(files: list[SourceFile], chunk_rows: ChunkRows, start_row: int = 0,
                limit: int | None = None) -> list[Chunk]:
    """Read plan in stream order; the first `start_row` rows (across files) are left out and
    at most `limit` rows follow. `chunk_rows` is the rows per chunk, or a function giving them
    per file, asked only about the files the plan reads."""
    rows_for = chunk_rows if callable(chunk_rows) else lambda _f: chunk_rows
    chunks: list[Chunk] = []
    skip, left = start_row, limit
    for f in files:
        if left is not None and left <= 0:
            break
        n = num_rows(f)
        first = min(skip, n)
        skip -= first
        end = n if left is None else min(n, first + left)
        if end <= first:
            continue
        k = rows_for(f)
        if k <= 0:
            raise ValueError(f"chunk_rows must be > 0, got {k} for {f.source}")
        chunks += _file_chunks(f, first, end, k)
        left = None if left is None else left - (end - first)
    return chunks


def _jsonl_chunk(f: SourceFile, idx: LineIndex, first: int, end: int) -> Chunk:
    start, stop, span_first, span_rows = idx.span(first, end)
    return Chunk(f, first, end - first, start, stop, span_first_row=span_first,
                 span_rows=span_rows)


def _file_chunks(f: SourceFile, first: int, end: int, k: int) -> list[Chunk]:
    """Rows [first, end) of one file in chunks of at most `k` (Parquet: never across row
    groups)."""
    if f.kind == "jsonl":
        idx = line_index(f.path)
        return [_jsonl_chunk(f, idx, r, min(end, r + k)) for r in range(first, end, k)]
    chunks: list[Chunk] = []
    base = 0
    for g, n in enumerate(parquet_row_groups(f.path).tolist()):
        lo, hi = max(first, base), min(end, base + n)
        chunks += [Chunk(f, r, min(hi, r + k) - r, row_group=g, group_offset=r - base)
                   for r in range(lo, hi, k)]
        base += n
    return chunks


class _GroupCache:
    """Last few Parquet row groups read, for random access without rereading a group."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._d: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()  # a block's units are read on several threads

    def get(self, path: str, group: int):
        import pyarrow.parquet as pq

        key = (path, group)
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return self._d[key]
        table = pq.ParquetFile(_open_parquet_target(path)).read_row_group(group)
        with self._lock:
            self._d[key] = table
            if len(self._d) > self.size:
                self._d.popitem(last=False)
        return table


_groups = _GroupCache()


def read_chunk(chunk: Chunk) -> list[tuple[int, Any]]:
    """-> [(row, raw)] where raw is the line's bytes (jsonl) or the row as a dict (parquet)."""
    if chunk.file.kind == "jsonl":
        lines = _span_lines(chunk.file.path, chunk.byte_start, chunk.byte_end, chunk.span_rows)
        skip = chunk.first_row - chunk.span_first_row
        return [(chunk.first_row + i, ln.removesuffix(b"\r"))
                for i, ln in enumerate(lines[skip: skip + chunk.num_rows])]
    table = _groups.get(chunk.file.path, chunk.row_group)
    rows = table.slice(chunk.group_offset, chunk.num_rows).to_pylist()
    return [(chunk.first_row + i, r) for i, r in enumerate(rows)]


def _span_lines(path: str, start: int, stop: int, rows: int) -> list[bytes]:
    data = read_bytes(path, start, stop)
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    if len(lines) != rows:  # the file changed since it was indexed
        raise RuntimeError(f"{path} changed while being read")
    return lines


def read_rows(f: SourceFile, first: int, end: int) -> list[Any]:
    """Rows [first, end) of one file, as `read_chunk` yields them, with one read (JSONL: their
    anchored bytes; Parquet: each row group they touch, read whole, the groups cached)."""
    if end <= first:
        return []
    if f.kind == "jsonl":
        start, stop, span_first, span_rows = line_index(f.path).span(first, end)
        lines = _span_lines(f.path, start, stop, span_rows)
        return [ln.removesuffix(b"\r") for ln in lines[first - span_first: end - span_first]]
    ends = np.cumsum(parquet_row_groups(f.path))
    out: list[Any] = []
    g = int(np.searchsorted(ends, first, side="right"))
    row = first
    while row < end:
        base = int(ends[g - 1]) if g else 0
        stop = min(end, int(ends[g]))
        out += _groups.get(f.path, g).slice(row - base, stop - row).to_pylist()
        row, g = stop, g + 1
    return out


def read_lines(path: str, start: int, stop: int, rows: int) -> list[bytes]:
    """The `rows` lines in bytes [start, stop) of a JSONL file (one read), as `read_chunk`
    yields them; RuntimeError if the file no longer holds them there (it changed)."""
    return [ln.removesuffix(b"\r") for ln in _span_lines(path, start, stop, rows)]


def read_row_group(path: str, group: int) -> list[Any]:
    """A Parquet row group's rows as dicts (the group read whole; the last few are cached)."""
    return _groups.get(path, group).to_pylist()


def read_row(f: SourceFile, row: int) -> Any:
    """One row by index (random access): the same raw value `read_chunk` yields for it."""
    n = num_rows(f)
    if not 0 <= row < n:
        raise KeyError(f"{f.source} has no row {row} (it has {n})")
    if f.kind == "jsonl":
        start, stop, first, rows = line_index(f.path).span(row, row + 1)
        return _span_lines(f.path, start, stop, rows)[row - first].removesuffix(b"\r")
    groups = parquet_row_groups(f.path)
    ends = np.cumsum(groups)
    g = int(np.searchsorted(ends, row, side="right"))
    off = row - (int(ends[g - 1]) if g else 0)
    return _groups.get(f.path, g).slice(off, 1).to_pylist()[0]


def read_head(f: SourceFile, n: int) -> list[Any]:
    """The raw values of the file's first `n` rows (all of them when it has fewer), as
    `read_chunk` yields them: one read (JSONL: anchored bytes; Parquet: the first record batch,
    not the first row group whole)."""
    if not num_rows(f):
        return []
    if f.kind == "jsonl":
        idx = line_index(f.path)
        return [raw for _, raw in read_chunk(_jsonl_chunk(f, idx, 0, min(n, idx.rows)))]
    import pyarrow.parquet as pq

    batches = pq.ParquetFile(_open_parquet_target(f.path)).iter_batches(batch_size=n)
    return next(batches).to_pylist()
