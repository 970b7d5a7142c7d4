"""Visual tokens: counts agree with the processor's own arithmetic and expand in the ids."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.preprocess.labels import IGNORE
from pipeline.preprocess.records import ImageRef
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.vision import VisionProcessor, _rgb_view, decode_image

from .conftest import make_job, processor_for, src

PAD, V_START, V_END = 151655, 151652, 151653


@pytest.mark.parametrize("name", ["astro.png", "astro_full.jpg", "page.png"])
@pytest.mark.parametrize(("lo", "hi"), [(56 * 56, 1024 * 1024), (56 * 56, 128 * 128)])
def test_visual_tokens_match_processor_patch_count(image_dir, name, lo, hi):
    vp = VisionProcessor(make_job(image_min_pixels=lo, image_max_pixels=hi).preprocess)
    im = decode_image(ImageRef(path=name), str(image_dir / "x.jsonl"))
    pixels, grid = vp.process([im])
    from transformers import Qwen2VLImageProcessorPil

    ref = Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi)
    patches = ref.get_number_of_image_patches(im.height, im.width, {})
    assert int(np.prod(grid[0])) == patches == pixels.shape[0]
    assert vp.visual_tokens(grid)[0] == patches // vp.merge_size**2
    h, w = grid[0][1] * 14, grid[0][2] * 14
    assert h * w <= hi and h * w >= min(lo, 28 * 28)


def test_astronaut_512_is_324_tokens_at_256px_cap(image_dir):
    vp = VisionProcessor(make_job(image_max_pixels=256 * 256).preprocess)
    im = decode_image(ImageRef(path="astro_full.jpg"), str(image_dir / "x.jsonl"))
    _, grid = vp.process([im])
    assert grid.tolist() == [[1, 18, 18]] and vp.visual_tokens(grid).tolist() == [81]


def _image_chat(*names):
    return {"conversations": [{"from": "human", "value": "<image>" * len(names) + "Describe."},
                              {"from": "gpt", "value": "A picture."}], "images": list(names)}


def test_image_pad_runs_inside_vision_markers(image_dir):
    job = make_job()
    f = src(image_dir / "data.jsonl")
    s = processor_for(job).process_one(f, 0, json.dumps(_image_chat("astro.png", "page.png"))
                                       .encode())
    assert isinstance(s, ProcessedSample)
    ids = s.input_ids
    per = (np.prod(s.image_grid_thw, axis=1) // 4).tolist()
    assert s.num_visual_tokens == sum(per) == int((ids == PAD).sum())
    starts = np.flatnonzero(ids == V_START)
    for st, n in zip(starts, per, strict=True):
        assert (ids[st + 1: st + 1 + n] == PAD).all() and ids[st + 1 + n] == V_END
    assert (s.labels[ids == PAD] == IGNORE).all()
    assert s.pixel_values.shape == (int(np.prod(s.image_grid_thw, axis=1).sum()), 1176)
    assert s.pixel_values.dtype == np.uint8 and s.image_grid_thw.dtype == np.int64  # raw pixels


def test_truncation_never_splits_an_image(image_dir):
    rec = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "one " * 12},
                                     {"type": "image", "image": "astro.png"}]},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": [{"type": "text", "text": "two"},
                                     {"type": "image", "image": "page.png"}]},
        {"role": "assistant", "content": "second answer"}]}
    raw = json.dumps(rec).encode()
    f = src(image_dir / "data.jsonl")
    full = processor_for(make_job(image_max_pixels=128 * 128)).process_one(f, 0, raw)
    assert len(full.image_grid_thw) == 2
    second_start = int(np.flatnonzero(full.input_ids == V_START)[1])
    # A cut inside the second image drops that image whole (and its pixels), keeps the first.
    job = make_job(max_seq_len=second_start + 5, image_max_pixels=128 * 128)
    s = processor_for(job).process_one(f, 0, raw)
    assert isinstance(s, ProcessedSample) and s.truncated
    assert s.num_tokens == second_start
    assert s.image_grid_thw.tolist() == full.image_grid_thw[:1].tolist()
    first_patches = int(np.prod(full.image_grid_thw[0]))
    assert np.array_equal(s.pixel_values, full.pixel_values[:first_patches])
    assert s.num_visual_tokens == first_patches // 4 == int((s.input_ids == PAD).sum())
    assert np.array_equal(s.input_ids, full.input_ids[:second_start])
    # A cut inside the first image leaves no assistant token: quarantined, never half an image.
    first_start = int(np.flatnonzero(full.input_ids == V_START)[0])
    job = make_job(max_seq_len=first_start + 3, image_max_pixels=128 * 128)
    q = processor_for(job).process_one(f, 0, raw)
    assert q.reason == "no_loss_tokens" and "image 1 (" in q.detail


def test_rgb_pixels_are_a_view_of_the_image_or_a_copy_when_pillow_will_not_export_them():
    from PIL import Image

    rng = np.random.default_rng(0)
    for (w, h), view in (((1003, 997), True), ((3000, 2000), False)):  # > Pillow's 16 MB block
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        rgb = _rgb_view(im)
        assert np.array_equal(rgb, np.asarray(im)) and rgb.shape == (h, w, 3)
        assert (rgb.base is not None and rgb.strides[1] == 4) is view  # 4 bytes a pixel: Pillow's
