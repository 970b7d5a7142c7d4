"""Source files, their exact row numbering, and reading rows by range or by index.

Rows are numbered by the source itself (0-based JSONL line / Parquet row), never by Ray's block
layout, so `sample_id = "<source>:<row>"` is stable across runs, block sizes and restarts. A
JSONL file is indexed once (byte offset of every line start, cached per process) which gives
both the read plan (chunks of whole lines, read in parallel by Ray tasks) and O(1) random
access for `SampleStore`. JSONL is read as bytes and parsed by us: a bad line becomes a
quarantined row instead of failing Ray's JSON reader. Local paths and any URI pyarrow's
filesystems understand (s3://, gs://, ...) work.
"""

from __future__ import annotations

import functools
import glob
import os
import posixpath
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from pipeline.config import SourceConfig
from pipeline.errors import UserError

Kind = Literal["jsonl", "parquet"]
_DATA_EXT = (".jsonl", ".json", ".parquet", ".pq")
_INDEX_BLOCK = 16 * 1024 * 1024


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
    byte_start: int = 0  # jsonl
    byte_end: int = 0
    row_group: int = -1  # parquet
    group_offset: int = 0  # parquet: first row's position inside the row group


def _is_uri(path: str) -> bool:
    return "://" in path


def _fs(path: str):
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(path)


def _kind(path: str, fmt: str) -> Kind:
    if fmt != "auto":
        return fmt  # type: ignore[return-value]
    return "parquet" if path.lower().endswith((".parquet", ".pq")) else "jsonl"


def expand_sources(cfg: SourceConfig) -> list[SourceFile]:
    """Configured paths -> files in deterministic order (config order, then sorted names)."""
    out: list[SourceFile] = []
    for entry in cfg.paths:
        if _is_uri(entry) and not entry.startswith("file://"):
            import pyarrow.fs as pafs

            fs, root = _fs(entry)
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
                raise SourceNotFound(f"source not found: {entry}")
        if not files:
            raise SourceNotFound(f"source holds no .jsonl/.parquet files: {entry}")
        out += [SourceFile(f, f, _kind(f, cfg.format)) for f in files]
    names = [f.source for f in out]
    if len(set(names)) != len(names):
        raise UserError("source.paths lists the same file twice")
    return out


def read_bytes(path: str, start: int = 0, end: int | None = None) -> bytes:
    if _is_uri(path) and not path.startswith("file://"):
        fs, p = _fs(path)
        with fs.open_input_file(p) as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)
    with open(path.removeprefix("file://"), "rb") as f:
        f.seek(start)
        return f.read() if end is None else f.read(end - start)


def resolve_relative(source_path: str, rel: str) -> str:
    """A path referenced from inside a source file is relative to that file's folder."""
    if _is_uri(rel) or os.path.isabs(rel):
        return rel
    if _is_uri(source_path):
        return posixpath.join(posixpath.dirname(source_path), rel)
    return os.path.join(os.path.dirname(source_path), rel)


def _stat_key(path: str) -> tuple:
    if _is_uri(path) and not path.startswith("file://"):
        fs, p = _fs(path)
        info = fs.get_file_info(p)
        return (path, info.size, info.mtime_ns)
    st = os.stat(path.removeprefix("file://"))
    return (path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _line_index(key: tuple) -> np.ndarray:
    path, size = key[0], key[1]
    starts = [np.zeros(1, dtype=np.int64)]
    pos = 0
    while pos < size:
        block = read_bytes(path, pos, min(size, pos + _INDEX_BLOCK))
        if not block:
            break
        nl = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10).astype(np.int64)
        starts.append(nl + pos + 1)
        pos += len(block)
    idx = np.concatenate(starts)
    # A final newline does not open another row; the last element is the file end sentinel.
    idx = idx[idx < size]
    return np.append(idx, size)


def line_index(path: str) -> np.ndarray:
    """Byte offset of each line start, plus the file size as a final sentinel (cached)."""
    return _line_index(_stat_key(path))


@functools.lru_cache(maxsize=64)
def _parquet_groups(key: tuple) -> np.ndarray:
    import pyarrow.parquet as pq

    md = pq.read_metadata(_open_parquet_target(key[0]))
    return np.array([md.row_group(i).num_rows for i in range(md.num_row_groups)], dtype=np.int64)


def _open_parquet_target(path: str):
    if _is_uri(path) and not path.startswith("file://"):
        fs, p = _fs(path)
        return fs.open_input_file(p)
    return path.removeprefix("file://")


def parquet_row_groups(path: str) -> np.ndarray:
    return _parquet_groups(_stat_key(path))


def num_rows(f: SourceFile) -> int:
    if f.kind == "jsonl":
        return len(line_index(f.path)) - 1
    return int(parquet_row_groups(f.path).sum())


def plan_chunks(files: list[SourceFile], chunk_rows: int, start_row: int = 0,
                limit: int | None = None) -> list[Chunk]:
    """Read plan in stream order; the first `start_row` rows (across files) are left out and
    at most `limit` rows follow."""
    chunks = _plan(files, chunk_rows, start_row)
    if limit is None:
        return chunks
    out: list[Chunk] = []
    left = limit
    for c in chunks:
        if left <= 0:
            break
        if c.num_rows > left:
            c = _head(c, left)
        out.append(c)
        left -= c.num_rows
    return out


def _head(c: Chunk, n: int) -> Chunk:
    if c.file.kind == "jsonl":
        idx = line_index(c.file.path)
        return replace(c, num_rows=n, byte_end=int(idx[c.first_row + n]))
    return replace(c, num_rows=n)


def _plan(files: list[SourceFile], chunk_rows: int, start_row: int) -> list[Chunk]:
    if chunk_rows <= 0:
        raise ValueError("chunk_rows must be > 0")
    chunks: list[Chunk] = []
    skip = start_row
    for f in files:
        if f.kind == "jsonl":
            idx = line_index(f.path)
            n = len(idx) - 1
            first = min(skip, n)
            skip -= first
            for r in range(first, n, chunk_rows):
                e = min(n, r + chunk_rows)
                chunks.append(Chunk(f, r, e - r, int(idx[r]), int(idx[e])))
        else:
            base = 0
            for g, n in enumerate(parquet_row_groups(f.path).tolist()):
                first = min(skip, n)
                skip -= first
                for r in range(first, n, chunk_rows):
                    e = min(n, r + chunk_rows)
                    chunks.append(Chunk(f, base + r, e - r, row_group=g, group_offset=r))
                base += n
    return chunks


class _GroupCache:
    """Last few Parquet row groups read, for random access without rereading a group."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._d: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, path: str, group: int):
        import pyarrow.parquet as pq

        key = (path, group)
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        table = pq.ParquetFile(_open_parquet_target(path)).read_row_group(group)
        self._d[key] = table
        if len(self._d) > self.size:
            self._d.popitem(last=False)
        return table


_groups = _GroupCache()


def read_chunk(chunk: Chunk) -> list[tuple[int, Any]]:
    """-> [(row, raw)] where raw is the line's bytes (jsonl) or the row as a dict (parquet)."""
    if chunk.file.kind == "jsonl":
        data = read_bytes(chunk.file.path, chunk.byte_start, chunk.byte_end)
        lines = data.split(b"\n")
        if data.endswith(b"\n"):
            lines.pop()
        if len(lines) != chunk.num_rows:  # the file changed since it was indexed
            raise RuntimeError(f"{chunk.file.path} changed while being read")
        return [(chunk.first_row + i, ln.removesuffix(b"\r")) for i, ln in enumerate(lines)]
    table = _groups.get(chunk.file.path, chunk.row_group)
    rows = table.slice(chunk.group_offset, chunk.num_rows).to_pylist()
    return [(chunk.first_row + i, r) for i, r in enumerate(rows)]


def read_row(f: SourceFile, row: int) -> Any:
    """One row by index (random access): the same raw value `read_chunk` yields for it."""
    n = num_rows(f)
    if not 0 <= row < n:
        raise KeyError(f"{f.source} has no row {row} (it has {n})")
    if f.kind == "jsonl":
        idx = line_index(f.path)
        raw = read_bytes(f.path, int(idx[row]), int(idx[row + 1]))
        return raw.removesuffix(b"\n").removesuffix(b"\r")
    groups = parquet_row_groups(f.path)
    ends = np.cumsum(groups)
    g = int(np.searchsorted(ends, row, side="right"))
    off = row - (int(ends[g - 1]) if g else 0)
    return _groups.get(f.path, g).slice(off, 1).to_pylist()[0]
