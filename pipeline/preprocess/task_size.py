"""How much one Ray preprocessing task takes on, by bytes of output rather than rows.

A 1024 x 1024 image becomes ~6 MB of uint8 patches (twice that in bfloat16, four times in
float32), a chat a few KB of token ids. A fixed 256 rows per task made image tasks of ~1.5 GB
and ~10 s: the object store filled in a few tasks, the first sample waited for a whole task and
back-pressure could not act inside one. Both sizes below come from `preprocess.task_output_mb`:

- Rows per task (`rows_per_task`, the read plan): a file's bytes per row are estimated from a
  sample of its first rows (`SAMPLE_ROWS`, one read), each image at the most the job's
  `image_max_pixels` and `pixel_dtype` let it carry, text at one token per character, the
  whole within the sample limit (`JobConfig.max_sample_tokens`). A task reads as many rows as
  fit the target, at least one and at most `MAX_TASK_ROWS`, so chat tasks stay as large as
  before and Ray's cost per task stays small next to their work.
- Blocks inside a task: the task prepares its records one by one and finishes and yields a
  part as soon as what the part holds reaches the target (`Processor.process_parts`: pixels
  measured, text counted at 8 bytes a character); Ray Data, whose `target_max_block_size` is
  the same target, emits a block as soon as what it was handed exceeds it, so a part of images
  leaves as a block at once. A file whose later rows carry more images than its sample still
  streams blocks of about the target (a part of images: at most the target plus one record),
  and back-pressure acts between them.

Sizes change how rows are grouped into tasks and blocks, never which rows or what they become:
sample ids are source rows (sources.py) and augmentation is seeded per sample (augment.py).
"""

from __future__ import annotations

import functools

from pipeline.config import PIXELS_PER_VISUAL_TOKEN, JobConfig
from pipeline.preprocess.records import decode_line, parse_record
from pipeline.preprocess.sources import SourceFile, read_head, stat_key
from pipeline.preprocess.vision import PATCH_VALUES, PATCHES_PER_VISUAL_TOKEN, PIXEL_BYTES

MAX_TASK_ROWS = 256
SAMPLE_ROWS = 64  # a file's rows sampled for its estimate (one line-index stride: one read)
MiB = 1 << 20

TOKEN_BYTES = 8  # int32 input_ids + int32 labels
_ROW_BYTES = 256  # a row's ids, counts and strings besides its arrays


def task_bytes(job: JobConfig) -> int:
    """The output one task aims at: `preprocess.task_output_mb`, also Ray's block size."""
    return job.preprocess.task_output_mb * MiB


def row_bytes(job: JobConfig, images: int, text_chars: int) -> int:
    """About the most output one record of `images` images and `text_chars` characters of text
    becomes: its images at `image_max_pixels`, a token per character, within the sample limit
    (truncation drops what does not fit)."""
    p = job.preprocess
    limit = job.max_sample_tokens()
    visual = min(images * (p.image_max_pixels // PIXELS_PER_VISUAL_TOKEN), limit)
    tokens = min(text_chars + visual, limit)
    pixels = visual * PATCHES_PER_VISUAL_TOKEN * PATCH_VALUES * PIXEL_BYTES[p.pixel_dtype]
    return _ROW_BYTES + TOKEN_BYTES * tokens + pixels


def rows_per_task(job: JobConfig, f: SourceFile) -> int:
    """Rows of `f` one task reads: as many as `task_bytes` holds at the mean estimated bytes
    of the file's first rows, within [1, MAX_TASK_ROWS]."""
    sample = _head_profile(stat_key(f.path), f)
    if not sample:
        return MAX_TASK_ROWS
    mean = sum(row_bytes(job, images, chars) for images, chars in sample) / len(sample)
    return max(1, min(MAX_TASK_ROWS, int(task_bytes(job) // mean)))


@functools.lru_cache(maxsize=256)
def _head_profile(key: tuple, f: SourceFile) -> tuple[tuple[int, int], ...]:
    """(images, text characters) of each of the file's first SAMPLE_ROWS rows; a row that does
    not parse counts as empty (it will be quarantined). Cached while the file is unchanged
    (`key` holds its size and mtime)."""
    out = []
    for raw in read_head(f, SAMPLE_ROWS):
        try:
            conv = parse_record(decode_line(raw) if isinstance(raw, bytes) else raw)
        except Exception:  # its task quarantines it; here it only counts as empty
            out.append((0, 0))
            continue
        chars = sum(len(s.text) for t in conv.turns for s in t.segments)
        out.append((len(conv.images), chars))
    return tuple(out)
