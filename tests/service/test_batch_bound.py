"""The largest batch a job can send (pipeline/service/batch_bound.py): no batch the planner and
the collate make is ever larger, at the defaults it is close to real batches of real
1024x1024 pictures, and `serve`'s notice says what a trainer then holds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.config import TrainingJobConfig
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Step
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.vision import VisionProcessor
from pipeline.sample_data import IMAGES_DIR
from pipeline.service.batch_bound import batch_size_notice, largest_batch
from pipeline.service.collate import Piece, collate

MiB = 1024 * 1024
PATCH_BYTES = {"uint8": 1176, "bfloat16": 2352, "float32": 4704}
SOURCE = {"paths": ["records.jsonl"]}


def job(**kw) -> TrainingJobConfig:
    preprocess = kw.pop("preprocess", {})
    return TrainingJobConfig.model_validate({"job_id": "vlm", "world_size": 1, "source": SOURCE,
                                             "preprocess": preprocess, "batching": kw})


def sample(i: int, tokens: int, visual: int, pixels: np.ndarray | None = None,
           grid: np.ndarray | None = None) -> ProcessedSample:
    ids = np.full(tokens, 7, np.int32)
    return ProcessedSample(f"s:{i}", "s", i, ids, ids.copy(), num_visual_tokens=visual,
                           pixel_values=pixels, image_grid_thw=grid)


def batch_bytes(cfg: TrainingJobConfig, samples: list[ProcessedSample]) -> list[tuple[int, int]]:
    """Every batch the planner forms of `samples`, collated: its text and its pixel bytes."""
    by_id = {s.sample_id: s for s in samples}
    planner = StepPlanner(cfg.batching.policy(), 1)
    events = planner.feed_many(s.measured(cfg.batching.collate) for s in samples)
    out = []
    for step in (e for e in events + planner.end_epoch() if isinstance(e, Step)):
        for b in step.batches:
            pieces = [Piece(by_id[s.sample_id], b.truncated_to.get(s.sample_id))
                      for s in b.samples]
            arrays = collate(pieces, cfg.batching.collate)
            pixels = sum(arrays[k].nbytes for k in ("pixel_values", "image_grid_thw")
                         if k in arrays)
            out.append((sum(a.nbytes for a in arrays.values()) - pixels, pixels))
    return out


def full_size_picture(pixel_dtype: str):
    """One real picture at image_max_pixels (1024 x 1024), through the real image processor."""
    im = Image.open(IMAGES_DIR / "astronaut.jpg").convert("RGB").resize((1024, 1024))
    return VisionProcessor(job(preprocess={"pixel_dtype": pixel_dtype}).preprocess).process([im])


@pytest.mark.parametrize("pixel_dtype", ["uint8", "bfloat16"])
def test_real_batches_of_1024_pictures_at_the_default_budget_stay_under_the_bound(pixel_dtype):
    cfg = job(preprocess={"pixel_dtype": pixel_dtype})
    pixels, grid = full_size_picture(pixel_dtype)
    visual = int(grid.prod()) // 4
    samples = [sample(i, visual + 40, visual, pixels, grid) for i in range(26)]
    sizes = [text + pixels for text, pixels in batch_bytes(cfg, samples)]
    bound = largest_batch(cfg)
    assert max(sizes) <= bound.nbytes
    assert max(sizes) >= 0.9 * bound.nbytes  # tight: a full batch of these is within 10%
    if pixel_dtype == "uint8":  # the batch of the issue: 73,299,955 bytes, over 64 MB
        assert 73_299_955 <= bound.nbytes < 80e6
        assert bound.full_size_images == 12


def test_the_notice_names_the_size_the_chunks_and_what_a_trainer_holds():
    cfg = job()
    notice = batch_size_notice(cfg, largest_batch(cfg), prefetch_bytes=256 * MiB,
                               prefetch_steps=4, max_message_bytes=64 * MiB,
                               chunk_bytes=1 * MiB)
    assert notice == (
        "job 'vlm': a batch of images may reach 77.3 MB (token_budget 16384 with up to 16384 "
        "visual tokens of uint8 pixel patches: 12 images at image_max_pixels 1048576); it "
        "travels in up to 74 chunks of 1 MiB (grpc.max_message_mb is 64). A trainer with the "
        "default prefetch_bytes (256 MiB) holds 3 such batches besides the one it trains on "
        "(309 MB); set BatchStream(prefetch_bytes=...) for its memory, or lower "
        "batching.token_budget, batching.max_visual_tokens or preprocess.image_max_pixels")


def test_no_notice_while_a_batch_fits_a_message_and_the_window():
    cfg = job(token_budget=4096, max_visual_tokens=2048)
    bound = largest_batch(cfg)
    assert bound.nbytes == 9 * 4096 + 2048 * 4704 + 24 * (2048 // 4)
    assert batch_size_notice(cfg, bound, prefetch_bytes=256 * MiB, prefetch_steps=4,
                             max_message_bytes=64 * MiB, chunk_bytes=4 * MiB) is None
    big = largest_batch(job(preprocess={"pixel_dtype": "float32"}))
    assert big.nbytes > 4 * largest_batch(job()).pixel_bytes * 0.99


@settings(max_examples=40, deadline=None)
@given(budget=st.integers(16, 160), collate_mode=st.sampled_from(["padded", "packed"]),
       pixel_dtype=st.sampled_from(["uint8", "bfloat16", "float32"]),
       cap=st.one_of(st.none(), st.integers(4, 200)),
       over_budget=st.sampled_from(["truncate", "alone", "quarantine"]),
       max_seq_len=st.integers(16, 240), seed=st.integers(0, 2**16))
def test_no_planned_batch_is_larger_than_the_bound(budget, collate_mode, pixel_dtype, cap,
                                                   over_budget, max_seq_len, seed):
    cfg = job(token_budget=budget, collate=collate_mode, max_visual_tokens=cap,
              over_budget=over_budget,
              preprocess={"pixel_dtype": pixel_dtype, "max_seq_len": max_seq_len,
                          "image_min_pixels": 28 * 28})
    most_tokens = cfg.max_sample_tokens()
    most_visual = cfg.max_sample_visual_tokens() or most_tokens
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(30):  # what preprocessing hands the planner: within the sample limits
        tokens = int(rng.integers(1, most_tokens + 1))
        visual = int(rng.integers(0, min(tokens, most_visual) + 1)) if rng.random() < 0.7 else 0
        pixels = np.zeros((4 * visual, PATCH_BYTES[pixel_dtype] // 1176 * 1176), np.uint8)
        grid = np.array([[1, 2, 2 * visual]], np.int64) if visual else None
        samples.append(sample(i, tokens, visual, pixels if visual else None, grid))
    bound = largest_batch(cfg)
    for text, pixels in batch_bytes(cfg, samples):
        assert text <= bound.text_bytes and pixels <= bound.pixel_bytes
