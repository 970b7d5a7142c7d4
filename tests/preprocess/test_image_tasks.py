"""Ray Data on real 1024 x 1024 photos (~6 MB of uint8 patches each): tasks sized by bytes,
blocks bounded and streamed even out of one big task, and the same samples however the rows are
cut. One shared Ray (ray_session)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, TimeoutError

import pytest
import ray

from pipeline.preprocess.pipeline import build_dataset
from pipeline.preprocess.rows import from_table
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.sources import expand_sources
from pipeline.preprocess.task_size import rows_per_task, task_bytes

from .conftest import make_job, write_jsonl

PHOTOS = ["astronaut", "chelsea", "coffee", "rocket", "astronaut", "coffee"]
TARGET_MB = 16


def _photo_records(names: list[str]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": [
        {"type": "image", "image": f"{name}.jpg"}, {"type": "text", "text": f"Photo {i}?"}]},
        {"role": "assistant", "content": f"Photo {i} shows a {name}."}]}
        for i, name in enumerate(names)]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    import skimage.data as d
    from PIL import Image

    folder = tmp_path_factory.mktemp("photos")
    for name in set(PHOTOS):
        Image.fromarray(getattr(d, name)()).convert("RGB").resize((1024, 1024)).save(
            folder / f"{name}.jpg", quality=90)
    return str(write_jsonl(folder / "photos.jsonl", _photo_records(PHOTOS)))


def _job(path: str, **preprocess):
    return make_job([path], task_output_mb=TARGET_MB, **preprocess)


def _blocks(ds) -> list[tuple[int, int, list]]:
    """(rows, bytes, items) of every block the dataset's tasks produced, in stream order."""
    out = []
    for bundle in ds.iter_internal_ref_bundles():
        for entry in bundle.blocks:
            out.append((entry.metadata.num_rows, entry.metadata.size_bytes,
                        from_table(ray.get(entry.ref))))
    return out


def _digests(blocks) -> list:
    return [(i.sample_id, i.digest()) for _, _, items in blocks for i in items
            if isinstance(i, ProcessedSample)]


@pytest.mark.parametrize(("dtype", "rows"), [("uint8", 2), ("bfloat16", 1)])
def test_tasks_of_large_images_stay_under_the_byte_target(ray_session, photos, dtype, rows):
    job = _job(photos, pixel_dtype=dtype)
    (f,) = expand_sources(job.source)
    assert rows_per_task(job, f) == rows  # 16 MiB holds 2 images of ~6 MB, 1 of ~12 MB
    blocks = _blocks(build_dataset(job, 0, concurrency=2))
    assert [b[0] for b in blocks] == [rows] * (len(PHOTOS) // rows)
    assert all(nbytes <= task_bytes(job) for _, nbytes, _ in blocks)
    assert all(len(items[0].pixel_values) > 4 * 1200 for _, _, items in blocks)  # ~1 MP each


def test_one_big_task_streams_bounded_blocks_with_the_same_samples(ray_session, photos):
    """All six photos in one task (chunk_rows): the task still yields blocks of about the
    target (at most the target and one image: 3 photos of ~6 MB for 16 MiB), and the samples
    are byte-identical to those of the tasks sized by bytes."""
    job = _job(photos)
    sized = _blocks(build_dataset(job, 0, concurrency=2))
    big = _blocks(build_dataset(job, 0, chunk_rows=1000, concurrency=1))
    largest_row = max(nbytes / n for n, nbytes, _ in sized)
    assert len(big) >= 2
    assert all(nbytes <= task_bytes(job) + largest_row for _, nbytes, _ in big)
    assert [b[0] for b in big] == [3, 3]
    assert _digests(big) == _digests(sized)  # the epoch's order does not follow task sizes
    assert sorted(sid for sid, _ in _digests(big)) == sorted(
        f"{photos}:{i}" for i in range(len(PHOTOS)))


def test_a_big_task_hands_out_its_first_block_before_it_is_done(ray_session, photos,
                                                               tmp_path):
    """The fourth photo of one big task is a FIFO that is written only once the consumer holds
    the task's first block: a task that returned its output whole would wait on it forever."""
    for name in set(PHOTOS):
        os.symlink(os.path.join(os.path.dirname(photos), f"{name}.jpg"),
                   tmp_path / f"{name}.jpg")
    os.mkfifo(tmp_path / "late.jpg")
    names = [*PHOTOS[:3], "late", *PHOTOS[3:]]
    path = str(write_jsonl(tmp_path / "late.jsonl", _photo_records(names)))
    # File order: the late photo must be the task's fourth (a shuffle could put it first).
    ds = build_dataset(_job(path, shuffle=False), 0, chunk_rows=1000, concurrency=1)

    def first_block():  # Ray Data's iterator waits for the first block already
        blocks = iter(ds.iter_internal_ref_bundles())
        return blocks, next(blocks)

    def feed_the_late_photo() -> None:
        with open(tmp_path / "late.jpg", "wb") as fifo:  # waits for the task to open it
            fifo.write((tmp_path / "astronaut.jpg").read_bytes())

    feeder = threading.Thread(target=feed_the_late_photo, daemon=True)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(first_block)
        try:
            blocks, bundle = first.result(timeout=120)
        except TimeoutError:
            feeder.start()  # let the task finish before failing
            list(first.result(timeout=120)[0])
            pytest.fail("the first block of the task waited for the whole task")
        feeder.start()
        rest = list(blocks)
    feeder.join(timeout=60)
    assert not feeder.is_alive()
    entries = [e for b in [bundle, *rest] for e in b.blocks]
    assert entries[0].metadata.num_rows == 3  # 3 photos: past 16 MiB, yielded at once
    items = [i for e in entries for i in from_table(ray.get(e.ref))]
    assert [i.row for i in items] == list(range(len(names)))
    assert all(isinstance(i, ProcessedSample) and i.pixel_values is not None for i in items)
