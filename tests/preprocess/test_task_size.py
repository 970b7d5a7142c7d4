"""Ray tasks sized by bytes: the output a record can become, rows per task from a file's first
rows (images at the job's pixel limit and dtype; text tasks still 256 rows), and parts inside a
task closed by the bytes they hold. Without Ray; through Ray: test_image_tasks.py."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import SourceConfig
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
from pipeline.preprocess.task_size import MAX_TASK_ROWS, row_bytes, rows_per_task, task_bytes
from pipeline.preprocess.vision import VisionProcessor

from .conftest import chat, make_job, processor_for, write_jsonl

IMAGE_1024_UINT8 = 1337 * 4 * 1176  # 1024 x 1024 = 1337 visual tokens of 4 patches of 1176


def _image_chat(i: int, name: str = "img.jpg") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": name},
                                                      {"type": "text", "text": f"What {i}?"}]},
                         {"role": "assistant", "content": "A picture."}]}


def _digest(item):
    return item.digest() if isinstance(item, ProcessedSample) else item


def test_a_records_bytes_are_its_images_at_the_pixel_limit_in_the_dtype():
    assert row_bytes(make_job(), 0, 1000) < 10_000  # 1,000 characters: a few KB of ids
    one = row_bytes(make_job(), 1, 10) - row_bytes(make_job(), 0, 10)
    assert IMAGE_1024_UINT8 <= one < IMAGE_1024_UINT8 + 20_000  # + its visual tokens' ids
    assert (row_bytes(make_job(pixel_dtype="bfloat16"), 1, 10)
            > 2 * IMAGE_1024_UINT8 > row_bytes(make_job(), 1, 10))
    assert row_bytes(make_job(pixel_dtype="float32"), 1, 10) > 4 * IMAGE_1024_UINT8
    small = make_job(image_max_pixels=256 * 256)
    assert row_bytes(small, 1, 10) < row_bytes(make_job(), 1, 10) / 15


def test_truncation_bounds_a_records_bytes():
    """A sample never holds more visual tokens than the sample limit (max_seq_len 4096 by
    default): 4 images of 1024 x 1024 (5,348 visual tokens) carry no more than 8 would."""
    job = make_job()
    assert row_bytes(job, 8, 10) == row_bytes(job, 4, 10) > row_bytes(job, 3, 10)
    assert row_bytes(job, 8, 10) == 256 + 4096 * (4 * 1176 + 8)
    assert row_bytes(make_job(max_seq_len=2048), 2, 10) == 256 + 2048 * (4 * 1176 + 8)


def test_the_estimate_holds_the_real_output_of_a_1024_image(image_dir):
    """An upper bound, and a close one, of what the image processor makes of a real picture."""
    from PIL import Image

    im = Image.open(image_dir / "astro_full.jpg").convert("RGB").resize((1024, 1024))
    for dtype in ("uint8", "bfloat16", "float32"):
        job = make_job(pixel_dtype=dtype)
        pixels, _ = VisionProcessor(job.preprocess).process([im])
        assert 0.9 * (row_bytes(job, 1, 0) - 256) < pixels.nbytes <= row_bytes(job, 1, 0)


def test_text_files_keep_large_tasks_and_image_files_get_small_ones(tmp_path):
    chats = write_jsonl(tmp_path / "chats.jsonl",
                        [chat(f"Question {i}?", "An answer. " * 20) for i in range(300)])
    images = write_jsonl(tmp_path / "images.jsonl", [_image_chat(i) for i in range(300)])
    mixed = write_jsonl(tmp_path / "mixed.jsonl",
                        [_image_chat(i) if i % 4 == 0 else chat(f"Q{i}", "A.")
                         for i in range(300)])
    c, i, m = expand_sources(SourceConfig(paths=[str(chats), str(images), str(mixed)]))
    job = make_job()
    assert rows_per_task(job, c) == MAX_TASK_ROWS == 256
    assert rows_per_task(job, i) == 10  # 64 MiB of ~6.3 MB images
    assert task_bytes(job) == 64 * 2**20
    assert rows_per_task(make_job(pixel_dtype="bfloat16"), i) == 5
    assert rows_per_task(make_job(pixel_dtype="float32"), i) == 2
    assert rows_per_task(make_job(task_output_mb=4), i) == 1  # never less than one row
    k = rows_per_task(job, m)
    assert 38 <= k <= 43  # one row in 4 with an image
    # The read plan asks each file it reads for its size.
    plan = plan_chunks([c, i, m], lambda f: rows_per_task(job, f))
    sizes = {f.source: [ch.num_rows for ch in plan if ch.file == f] for f in (c, i, m)}
    assert sizes == {c.source: [256, 44], i.source: [10] * 30,
                     m.source: [k] * (300 // k) + [300 % k]}


def test_parquet_rows_with_embedded_images_are_sampled_from_the_first_batch(tmp_path,
                                                                          image_dir):
    from PIL import Image

    buf = io.BytesIO()
    Image.open(image_dir / "astro.png").save(buf, format="PNG")
    rows = [{"messages": [{"role": "user", "content": f"<image>Q{i}"},
                          {"role": "assistant", "content": "A."}],
             "images": [{"bytes": buf.getvalue(), "path": None}]} for i in range(100)]
    p = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p, row_group_size=40)
    (f,) = expand_sources(SourceConfig(paths=[str(p)]))
    job = make_job([str(p)])
    assert rows_per_task(job, f) == 10
    plan = plan_chunks([f], lambda g: rows_per_task(job, g))
    assert [ch.num_rows for ch in plan] == [10] * 10
    assert [r for ch in plan for r, _ in read_chunk(ch)] == list(range(100))


def test_bad_and_empty_files_are_sized_without_failing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"{oops\n\xff\xfe\n" + b'{"messages": 3}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    b, e = expand_sources(SourceConfig(paths=[str(bad), str(empty)]))
    assert rows_per_task(make_job(), b) == rows_per_task(make_job(), e) == MAX_TASK_ROWS


def test_a_file_changed_on_disk_is_sampled_again(tmp_path):
    p = tmp_path / "x.jsonl"
    write_jsonl(p, [chat() for _ in range(50)])
    (f,) = expand_sources(SourceConfig(paths=[str(p)]))
    assert rows_per_task(make_job(), f) == MAX_TASK_ROWS
    write_jsonl(p, [_image_chat(i) for i in range(51)])
    assert rows_per_task(make_job(), f) == 10


def test_a_task_yields_parts_closed_by_the_bytes_they_hold(tmp_path, image_dir):
    """`process_parts` finishes a part as soon as its prepared records hold `part_bytes` (so a
    part is at most that plus one record), a quarantined row weighs nothing, and the parts are
    exactly what one `process` call makes of the same rows."""
    (tmp_path / "astro.png").write_bytes((image_dir / "astro.png").read_bytes())
    records = [_image_chat(i, "astro.png") for i in range(7)]
    records[2] = b'{"broken'
    records[4] = chat("Only text", "here.")
    path = write_jsonl(tmp_path / "parts.jsonl", records)
    job = make_job([str(path)], image_max_pixels=96 * 96, augment={"enabled": False})
    proc = processor_for(job)
    (f,) = expand_sources(job.source)
    (chunk,) = plan_chunks([f], 100)
    rows = read_chunk(chunk)
    whole = proc.process(f, rows)
    image = next(i for i in whole if isinstance(i, ProcessedSample)).pixel_values.nbytes
    raw = [(f, row, 0, value) for row, value in rows]  # copy 0 of each row
    parts = list(proc.process_parts(raw, 3 * image))  # 3 images and their text
    assert [[i.row for i in part] for part in parts] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [_digest(i) for part in parts for i in part] == [_digest(i) for i in whole]
    assert [len(p) for p in proc.process_parts(raw, 1)] == [1, 1, 2, 1, 1, 1]
    assert [len(p) for p in proc.process_parts(raw, 2**40)] == [7]  # text: one part
