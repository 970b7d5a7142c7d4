"""Exact row numbering and read plans, independent of chunk sizes; random access reads."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline.preprocess.sources as sources
from pipeline.config import SourceConfig
from pipeline.preprocess.sources import (
    INDEX_STRIDE,
    SourceNotFound,
    expand_sources,
    line_index,
    num_rows,
    plan_chunks,
    read_chunk,
    read_row,
)


def _rows(files, chunk_rows, start=0, limit=None):
    out = []
    for c in plan_chunks(files, chunk_rows, start, limit):
        out += [(c.file.source, r, raw) for r, raw in read_chunk(c)]
    return out


@pytest.mark.parametrize("ending", [b"\n", b""])
def test_jsonl_rows_exact_for_any_chunk_size(tmp_path, ending):
    lines = [b"a", b"", b"bb", b"c\r", b"  ", b"dd"]
    p = tmp_path / "x.jsonl"
    p.write_bytes(b"\n".join(lines) + ending)
    (f,) = expand_sources(SourceConfig(paths=[str(p)]))
    assert num_rows(f) == 6 and line_index(str(p)).anchors[-1] == p.stat().st_size
    want = [(str(p), i, ln.removesuffix(b"\r")) for i, ln in enumerate(lines)]
    for k in (1, 2, 4, 6, 100):
        assert _rows([f], k) == want
        assert _rows([f], k, start=3) == want[3:]
        assert _rows([f], k, start=1, limit=3) == want[1:4]
    assert [read_row(f, i) for i in range(6)] == [w[2] for w in want]
    with pytest.raises(KeyError):
        read_row(f, 6)


def test_directory_order_multiple_files_and_start_row_across_files(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "b.jsonl").write_bytes(b"b0\nb1\nb2\n")
    (d / "a.jsonl").write_bytes(b"a0\na1\n")
    (d / "notes.txt").write_text("ignored")
    files = expand_sources(SourceConfig(paths=[str(d)]))
    assert [f.source.rsplit("/", 1)[1] for f in files] == ["a.jsonl", "b.jsonl"]
    got = [(s.rsplit("/", 1)[1], r, raw) for s, r, raw in _rows(files, 2, start=1)]
    assert got == [("a.jsonl", 1, b"a1"), ("b.jsonl", 0, b"b0"), ("b.jsonl", 1, b"b1"),
                   ("b.jsonl", 2, b"b2")]


def test_parquet_rows_across_row_groups(tmp_path):
    p = tmp_path / "x.parquet"
    table = pa.table({"k": list(range(10))})
    pq.write_table(table, p, row_group_size=3)
    (f,) = expand_sources(SourceConfig(paths=[str(p)]))
    assert f.kind == "parquet" and num_rows(f) == 10
    for k in (1, 2, 5):
        assert [(r, raw["k"]) for _, r, raw in _rows([f], k)] == [(i, i) for i in range(10)]
        assert [r for _, r, _ in _rows([f], k, start=4, limit=4)] == [4, 5, 6, 7]
    assert [read_row(f, i)["k"] for i in (9, 0, 4)] == [9, 0, 4]


def test_missing_source_is_a_user_error(tmp_path):
    with pytest.raises(SourceNotFound, match="source not found"):
        expand_sources(SourceConfig(paths=[str(tmp_path / "nope.jsonl")]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceNotFound, match=r"no \.jsonl"):
        expand_sources(SourceConfig(paths=[str(tmp_path / "empty")]))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3 * INDEX_STRIDE + 3), ending=st.sampled_from([b"\n", b""]),
       chunk=st.integers(1, 2 * INDEX_STRIDE + 1), start=st.integers(0, 3 * INDEX_STRIDE + 5),
       seed=st.integers(0, 9))
def test_anchored_spans_give_exact_rows_around_stride_boundaries(tmp_path_factory, n, ending,
                                                                 chunk, start, seed):
    rng = random.Random(seed)
    lines = [b"x" * rng.randint(0, 5) for _ in range(n)]
    p = tmp_path_factory.mktemp("spans") / "x.jsonl"
    p.write_bytes(b"\n".join(lines) + (ending if n else b""))
    (f,) = expand_sources(SourceConfig(paths=[str(p)]))
    # An empty last line without a final newline is no row (nothing follows the last newline).
    want_lines = lines if ending or not n or lines[-1] else lines[:-1]
    assert num_rows(f) == len(want_lines)
    want = [(str(p), i, ln) for i, ln in enumerate(want_lines)]
    assert _rows([f], chunk, start=start) == want[start:]
    for i in sorted({0, len(want_lines) // 2, len(want_lines) - 1}) if want_lines else ():
        assert read_row(f, i) == want_lines[i]


def test_a_large_file_is_indexed_by_ray_tasks_alike(ray_session, tmp_path, monkeypatch):
    """Byte ranges indexed by Ray tasks (the offsets stay in the object store) give the index
    one process computes, and the same rows (ranges of 4 KiB here stand for 64 MiB)."""
    rng = random.Random(3)
    lines = [b"r%d " % i + b"y" * rng.randint(0, 90) for i in range(5000)]
    p = tmp_path / "big.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    (f,) = expand_sources(SourceConfig(paths=[str(p)]))
    local = sources._line_index.__wrapped__(sources.stat_key(str(p)))
    monkeypatch.setattr(sources, "INDEX_SPLIT_BYTES", 4096)
    ranges, _, anchors_of = sources._index_ranges(str(p), p.stat().st_size)
    assert len(ranges) > 50 and anchors_of is not sources._anchors_in  # really distributed
    sources._line_index.cache_clear()
    spread = line_index(str(p))
    assert spread.rows == local.rows == 5000
    assert spread.anchors.tolist() == local.anchors.tolist()
    assert [raw for _, _, raw in _rows([f], 256, start=77)] == lines[77:]
    assert read_row(f, 4999) == lines[4999]


def test_rows_per_chunk_per_file_asked_only_of_the_files_read(tmp_path):
    """A plan's chunk size may differ per file (task_size.py); files the plan leaves out by
    `start_row` or `limit` are not asked (sizing one reads its first rows), and the rows are
    exact whatever the sizes."""
    paths = []
    for name, n in (("a", 5), ("b", 7), ("c", 4), ("d", 3)):
        p = tmp_path / f"{name}.jsonl"
        p.write_bytes(b"".join(b"%s%d\n" % (name.encode(), i) for i in range(n)))
        paths.append(str(p))
    files = expand_sources(SourceConfig(paths=paths))
    sizes = {f.source: k for f, k in zip(files, (2, 3, 1, 2), strict=True)}
    asked: list[str] = []

    def rows_for(f):
        asked.append(f.source.rsplit("/", 1)[1])
        return sizes[f.source]

    plan = plan_chunks(files, rows_for, start_row=6, limit=8)
    assert asked == ["b.jsonl", "c.jsonl"]
    assert [(c.file.source.rsplit("/", 1)[1], c.first_row, c.num_rows) for c in plan] == [
        ("b.jsonl", 1, 3), ("b.jsonl", 4, 3), ("c.jsonl", 0, 1), ("c.jsonl", 1, 1)]
    got = [raw for c in plan for _, raw in read_chunk(c)]
    assert got == [b"b1", b"b2", b"b3", b"b4", b"b5", b"b6", b"c0", b"c1"]
    with pytest.raises(ValueError, match="chunk_rows must be > 0"):
        plan_chunks(files, lambda f: 0)
