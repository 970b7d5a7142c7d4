"""The real Ray Data stream: order, exact rows across blocks and files, quarantine, restart,
and random access that is byte-identical to what was streamed. One shared Ray (ray_session)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.preprocess.pipeline import (
    PreprocessStats,
    SampleQuarantined,
    SampleStore,
    build_dataset,
    iter_samples,
)
from pipeline.preprocess.process import Processor
from pipeline.preprocess.rows import SCHEMA, from_row
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk

from .conftest import chat, make_job, write_jsonl

AUG = {"augment": {"system_prompts": ["Short.", "Be extremely thorough in every answer."],
                   "system_prompt_prob": 0.5, "turn_subsample_prob": 0.5,
                   "image_scale_min": 0.5, "image_scale_max": 1.5}}
CHUNK = 4  # small chunks: many Ray blocks, rows must still be exact


def _img_chat(name: str, i: int) -> dict:
    return {"conversations": [{"from": "human", "value": f"<image>\nPicture {i}?"},
                              {"from": "gpt", "value": f"Picture {i} shows something."},
                              {"from": "human", "value": "More?"},
                              {"from": "gpt", "value": "Nothing more " * (i % 5 + 1)}],
            "images": [name]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, image_dir):
    d = tmp_path_factory.mktemp("ds")
    for name in ("astro.png", "broken.jpg"):
        (d / name).write_bytes((image_dir / name).read_bytes())
    a = []
    for i in range(11):
        a.append(_img_chat("astro.png", i) if i % 3 == 0 else chat(f"Q{i}", f"A{i} " * (i + 1)))
    a[5] = b'{"messages": oops'
    a[8] = _img_chat("broken.jpg", 8)
    write_jsonl(d / "a.jsonl", a)
    b = [chat(f"B{i}", "answer " * i) for i in range(6)]
    b[2] = b"\xff\xfe not utf8"
    b[4] = {"messages": [{"role": "user", "content": "no answer"}]}
    write_jsonl(d / "b.jsonl", b)
    png = io.BytesIO()
    from PIL import Image

    Image.open(image_dir / "page.png").save(png, format="PNG")
    rows = []
    for i in range(7):
        img = i % 2 == 0
        rows.append({
            "messages": [{"role": "user", "content": ("<image>" if img else "") + f"P{i}"},
                         {"role": "assistant", "content": f"parquet answer {i}"}],
            "images": [{"bytes": png.getvalue(), "path": None}] if img else [],
        })
    pq.write_table(pa.Table.from_pylist(rows), d / "c.parquet", row_group_size=3)
    paths = [str(d / "a.jsonl"), str(d / "b.jsonl"), str(d / "c.parquet")]
    # File order: the rows below are checked in their files' order (the shuffled order is
    # checked against pipeline/order's placements: test_a_shuffled_stream_...).
    return make_job(paths, seed=11, image_max_pixels=96 * 96, shuffle=False, **AUG)


EXPECTED_Q = {("a.jsonl", 5): "bad_json", ("a.jsonl", 8): "bad_image",
              ("b.jsonl", 2): "bad_utf8", ("b.jsonl", 4): "missing_roles"}


@pytest.fixture(scope="module")
def streamed(ray_session, dataset):
    stats = PreprocessStats()
    items = list(iter_samples(dataset, 1, stats=stats, chunk_rows=CHUNK, concurrency=2))
    return items, stats


def _key(item):
    return item.source.rsplit("/", 1)[1], item.row


def test_stream_order_exact_rows_and_quarantine(dataset, streamed):
    items, stats = streamed
    assert [_key(i) for i in items] == (
        [("a.jsonl", r) for r in range(11)] + [("b.jsonl", r) for r in range(6)]
        + [("c.parquet", r) for r in range(7)])
    q = {_key(i): i.reason for i in items if isinstance(i, QuarantinedRecord)}
    assert q == EXPECTED_Q
    assert stats.rows == 24 and stats.samples == 20 and stats.quarantined == 4
    assert dict(stats.quarantined_by_reason) == {"bad_json": 1, "bad_image": 1, "bad_utf8": 1,
                                                 "missing_roles": 1}
    samples = [i for i in items if isinstance(i, ProcessedSample)]
    assert sum(s.num_tokens for s in samples) == stats.num_tokens
    with_images = [s for s in samples if s.image_grid_thw is not None]
    assert len(with_images) == 4 + 4  # jsonl rows 0, 3, 6, 9; parquet rows 0, 2, 4, 6
    for s in with_images:
        assert s.num_visual_tokens > 0 and s.pixel_values.shape[1] == 1176
    assert all(s.sample_id == f"{s.source}:{s.row}" for s in samples)


def test_stream_equals_plain_processing_and_random_access(dataset, streamed):
    items, _ = streamed
    proc = Processor(dataset, 1)
    plain = []
    for c in plan_chunks(expand_sources(dataset.source), 1000):
        plain += proc.process(c.file, read_chunk(c))
    assert len(plain) == len(items)
    store = SampleStore(dataset)
    for got, want in zip(items, plain, strict=True):
        if isinstance(want, QuarantinedRecord):
            assert got == want
            with pytest.raises(SampleQuarantined):
                store.get(want.sample_id, 1)
            continue
        assert got.digest() == want.digest()
        assert store.get(got.sample_id, 1).digest() == got.digest()
    # Another epoch is a different sample for at least some ids (augmentation is on).
    first = [i for i in items if isinstance(i, ProcessedSample)]
    assert any(store.get(s.sample_id, 2).digest() != s.digest() for s in first)
    with pytest.raises(KeyError):
        store.get("nope.jsonl:3", 1)


def test_restart_from_start_row_resumes_exactly(dataset, streamed):
    items, _ = streamed
    k = 9  # mid-chunk, mid-file
    # Actor pool this time, and an object-store cap below one block: must still make progress.
    tail = list(iter_samples(dataset, 1, start_row=k, chunk_rows=CHUNK, concurrency=1,
                             compute="actors", object_store_limit=1024))
    assert [_key(i) for i in tail] == [_key(i) for i in items[k:]]
    for a, b in zip(tail, items[k:], strict=True):
        assert (a.digest() if isinstance(a, ProcessedSample) else a) == \
               (b.digest() if isinstance(b, ProcessedSample) else b)


def test_build_dataset_plan_columns_and_limits(ray_session, dataset, streamed):
    ds = build_dataset(dataset, 1, start_row=2, limit=3, chunk_rows=CHUNK, concurrency=1)
    ctx = ds.context
    assert ctx.execution_options.preserve_order
    assert (ctx.execution_options.resource_limits.object_store_memory
            == dataset.preprocess.object_store_mb * 2**20)
    rows = ds.take_all()
    assert set(rows[0]) == set(SCHEMA.names)
    assert [r["row"] for r in rows] == [2, 3, 4]
    items, _ = streamed
    assert [from_row(r).digest() for r in rows] == [i.digest() for i in items[2:5]]


def test_a_shuffled_stream_follows_the_epochs_order_and_copies_are_samples_of_their_own(
        ray_session, dataset):
    """The default order (shuffled) and a mixture reading b twice: the stream is exactly the
    order's placements, each item byte-identical to random access by its id, and a copy
    (`#1`) is augmented by its own id."""
    from pipeline.order.cursor import OrderCursor
    from pipeline.order.job_order import JobOrder

    paths = dataset.source.paths
    mixed = dataset.model_copy(update={"source": type(dataset.source).model_validate({
        "mixture": [{"name": "a", "paths": [paths[0], paths[2]]},
                    {"name": "b", "paths": [paths[1]], "repeat": 2}],
        "shuffle_block_rows": 10})})
    order = JobOrder(mixed.source, mixed.seed)
    want = [(order.layouts[p.source].files[p.file].source, p.row, p.copy)
            for p in order.epoch(1, OrderCursor()).placements()]
    assert len(want) == 11 + 7 + 2 * 6 and want != sorted(want)
    items = list(iter_samples(mixed, 1, chunk_rows=CHUNK, concurrency=2))
    from pipeline.preprocess.process import split_sample_id

    got = [split_sample_id(i.sample_id) if isinstance(i, ProcessedSample)
           else (i.source, i.row, None) for i in items]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got if g[2] is not None] == [
        w[2] for w, g in zip(want, got, strict=True) if g[2] is not None]
    store = SampleStore(mixed)
    samples = [i for i in items if isinstance(i, ProcessedSample)]
    for s in samples:
        assert store.get(s.sample_id, 1).digest() == s.digest()
    copies = {s.sample_id: s for s in samples}
    twins = [(copies[s.sample_id.split("#")[0]], s) for s in samples if "#1" in s.sample_id]
    assert len(twins) == 4 and any(a.digest() != b.digest() for a, b in twins)
    # From the middle, the rest is the same.
    k = 13
    tail = list(iter_samples(mixed, 1, start_row=k, chunk_rows=CHUNK, concurrency=1))
    assert [getattr(i, "sample_id", None) for i in tail] == [
        getattr(i, "sample_id", None) for i in items[k:]]
