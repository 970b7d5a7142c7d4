"""Every reader of an epoch reads the same order: the producer actor's feed (Ray), the
bootstrap producer's (in this process) and `plan --data`'s stream give exactly the order's
placements, from the start and from any cursor, with a mixture change too; each sample names
its mixture source; and the Ray feed releases what it read when it is closed early (a change
re-reads the epoch from the change)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import TrainingJobConfig
from pipeline.order.cursor import OrderCursor
from pipeline.order.job_order import JobOrder
from pipeline.planner.types import MeasuredSample
from pipeline.preprocess.pipeline import iter_samples
from pipeline.preprocess.process import split_sample_id
from pipeline.preprocess.sample import ProcessedSample
from pipeline.producer.local_feed import LocalFeed
from pipeline.producer.ray_feed import RayFeed


def _chats(path: Path, n: int, tag: str) -> str:
    lines = []
    for i in range(n):
        if i % 17 == 5:
            lines.append("{not json")  # quarantined: still one position of the order
            continue
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": f"{tag} question {i}"},
            {"role": "assistant", "content": f"{tag} answer {i} " + "word " * (i % 7)}]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> TrainingJobConfig:
    d = tmp_path_factory.mktemp("feeds")
    return TrainingJobConfig.model_validate({
        "job_id": "feeds", "world_size": 2, "seed": 3,
        "source": {"mixture": [
            {"name": "a", "paths": [_chats(d / "a.jsonl", 150, "a")]},
            {"name": "b", "paths": [_chats(d / "b.jsonl", 70, "b")], "repeat": 1.5}],
            "shuffle_block_rows": 128}})


def _want(order: JobOrder, epoch: int, cursor: OrderCursor) -> list[tuple[str, int, int]]:
    return [(order.layouts[p.source].files[p.file].source, p.row, p.copy)
            for p in order.epoch(epoch, cursor).placements(cursor.position)]


def _ids(items) -> list[tuple[str, int, int]]:
    out = []
    for it in items:
        if isinstance(it, MeasuredSample | ProcessedSample):
            out.append(split_sample_id(str(it.sample_id)))
        else:  # a quarantined record: its record id (a copy of it is the same record)
            out.append((*split_sample_id(it.sample_id)[:2], None))
    return out


def _norm(item) -> tuple:
    if isinstance(item, MeasuredSample):
        return ("s", item.sample_id, item.num_tokens, item.loss_tokens, item.source)
    return ("q", item.sample_id, getattr(item.reason, "value", item.reason))


def _same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[:2] == w[:2] and g[2] in (w[2], None)


def test_every_feed_reads_the_orders_placements_from_any_cursor(ray_session, job):
    order = JobOrder(job.source, job.seed)
    start = OrderCursor()
    mid = OrderCursor(97)
    changed = order.change(order.epoch(1, mid), mid, {"a": 1.0, "b": 3.0}, step=9,
                           by="mix 1", mix_seq=1)
    assert len(order.epoch(1, changed).segments) == 2
    local = LocalFeed(job)
    ray_feed = RayFeed(job)
    try:
        for epoch, cursor in ((0, start), (1, mid), (1, changed)):
            want = _want(order, epoch, cursor)
            got_local = list(local.iter_epoch(epoch, cursor))
            _same(_ids(got_local), want)
            got_ray = list(ray_feed.iter_epoch(epoch, cursor))
            _same(_ids(got_ray), want)
            assert [_norm(x) for x in got_ray] == [_norm(x) for x in got_local]
            names = {f.source: i for i, lay in enumerate(order.layouts) for f in lay.files}
            assert all(s.source == names[split_sample_id(str(s.sample_id))[0]]
                       for s in got_ray if isinstance(s, MeasuredSample))
            plan = list(iter_samples(job, epoch, cursor=cursor))  # what `plan --data` reads
            _same(_ids(plan), want)
    finally:
        ray_feed.close()
        local.drop()


def test_a_ray_feed_closed_early_holds_nothing_it_did_not_hand_out(ray_session, job):
    feed = RayFeed(job)
    try:
        it = feed.iter_epoch(0, OrderCursor())
        taken = [next(it) for _ in range(20)]
        it.close()
        samples = [s for s in taken if isinstance(s, MeasuredSample)]
        assert feed.held()["waiting_rows"] == len(samples)
        feed.discard(samples)
        assert feed.held() == {"blocks": 0, "batches": 0, "waiting_rows": 0}
    finally:
        feed.close()


def test_copies_are_read_once_per_copy_and_augmented_by_their_own_id(ray_session, job):
    items = [i for i in iter_samples(job, 0) if isinstance(i, ProcessedSample)]
    ids = [i.sample_id for i in items]
    assert len(ids) == len(set(ids))
    copies = [i for i in ids if "#1" in i]
    assert copies and all(i.split("#")[0] in ids for i in copies)
