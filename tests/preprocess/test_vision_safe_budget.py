"""Issue #13: vision-safe sample limits, through the real preprocessing with real pictures.

Truncation happens in one place, `Processor`, to `TrainingJobConfig.max_sample_tokens()` (and the
visual cap under `over_budget: truncate`). Every sample it emits holds exactly prod(grid_thw) /
merge_size**2 `<|image_pad|>` tokens per image it carries, between its vision markers; it is the
longest prefix of the uncut sample that splits no image and fits the limits; or the record is
quarantined with the documented reason. The oracle below is declarative (scan every prefix
length), not a second copy of the cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeline.config import PIXELS_PER_VISUAL_TOKEN, ConfigError, TrainingJobConfig, load_config
from pipeline.preprocess.labels import IGNORE
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.preprocess.truncation import Cut, vision_safe_cut
from pipeline.preprocess.vision import VisionProcessor

from .conftest import make_job, processor_for, src

PAD, V_START, V_END = 151655, 151652, 151653
# skimage.data pictures, saved small with different aspect ratios: (function, (width, height)).
PICTURES = {"astronaut.png": ("astronaut", (128, 128)), "chelsea.png": ("chelsea", (150, 100)),
            "rocket.png": ("rocket", (80, 120)), "coffee.png": ("coffee", (200, 130)),
            "camera.png": ("camera", (96, 96))}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "judge", "boxing", "matches", "near", "Paris", "in", "1999"]


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    import skimage.data as d
    from PIL import Image

    folder = tmp_path_factory.mktemp("pictures")
    for name, (fn, size) in PICTURES.items():
        Image.fromarray(getattr(d, fn)()).resize(size).save(folder / name)
    return folder


def _text(n: int, offset: int) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n))


@st.composite
def records(draw) -> dict:
    """OpenAI-style chats of 1-3 rounds with 0-3 pictures at the start (before the first
    question), in the middle (inside the middle round's question) or at the end (after the last
    question)."""
    rounds = draw(st.integers(1, 3))
    places = draw(st.lists(st.sampled_from(["start", "middle", "end"]), max_size=3))
    names = iter(draw(st.lists(st.sampled_from(sorted(PICTURES)), min_size=len(places),
                               max_size=len(places))))
    messages = []
    for r in range(rounds):
        q = _text(draw(st.integers(0, 40)), r)
        half = len(q) // 2
        parts: list[dict] = []
        if r == 0:
            parts += [{"type": "image", "image": next(names)} for p in places if p == "start"]
        if r == rounds // 2:
            parts.append({"type": "text", "text": q[:half]})
            parts += [{"type": "image", "image": next(names)} for p in places if p == "middle"]
            parts.append({"type": "text", "text": q[half:]})
        else:
            parts.append({"type": "text", "text": q})
        if r == rounds - 1:
            parts += [{"type": "image", "image": next(names)} for p in places if p == "end"]
        messages += [{"role": "user", "content": parts},
                     {"role": "assistant", "content": _text(draw(st.integers(1, 60)), r + 3)}]
    return {"messages": messages}


def _limit_job(image_max_pixels: int, **limits) -> TrainingJobConfig:
    batching = {k: limits.pop(k) for k in ("token_budget", "over_budget", "max_visual_tokens")
                if k in limits}
    return make_job(image_max_pixels=image_max_pixels, batching=batching, **limits)


def _spans(s: ProcessedSample) -> list[tuple[int, int, int]]:
    """(start, end, visual tokens) of each image span, read from the ids and the grid: the run
    after each vision start must be exactly that image's pad count, then a vision end."""
    starts = np.flatnonzero(s.input_ids == V_START)
    grid = np.zeros((0, 3), np.int64) if s.image_grid_thw is None else s.image_grid_thw
    assert len(starts) == len(grid), "every vision start belongs to an image the sample carries"
    out = []
    for st_, thw in zip(starts, grid, strict=True):
        n = int(np.prod(thw)) // 4  # merge_size 2
        run = s.input_ids[st_ + 1: st_ + 1 + n]
        assert len(run) == n and (run == PAD).all(), "image pad run shorter than its grid"
        assert s.input_ids[st_ + 1 + n] == V_END, "image pad run longer than its grid"
        out.append((int(st_), int(st_) + n + 2, n))
    return out


def assert_vision_consistent(s: ProcessedSample, max_tokens: int | None = None,
                             max_visual: int | None = None) -> None:
    spans = _spans(s)
    n_pad = int((s.input_ids == PAD).sum())
    assert n_pad == sum(n for _, _, n in spans) == s.num_visual_tokens
    rows = 0 if s.image_grid_thw is None else int(np.prod(s.image_grid_thw, axis=1).sum())
    assert (0 if s.pixel_values is None else s.pixel_values.shape[0]) == rows
    assert len(s.input_ids) == len(s.labels) == s.num_tokens
    assert (s.labels[s.input_ids == PAD] == IGNORE).all()
    if max_tokens is not None:
        assert s.num_tokens <= max_tokens
    if max_visual is not None:
        assert s.num_visual_tokens <= max_visual


def expected_prefix(full: ProcessedSample, max_tokens: int, max_visual: int | None) -> int:
    """The longest prefix length that fits, splits no image and keeps the visual cap."""
    spans = _spans(full)
    for n in range(min(full.num_tokens, max_tokens), -1, -1):
        whole = [v for a, b, v in spans if b <= n]
        if any(a < n < b for a, b, _ in spans):
            continue
        if max_visual is not None and sum(whole) > max_visual:
            continue
        return n
    raise AssertionError("the empty prefix always fits")


limits = st.fixed_dictionaries({
    "max_seq_len": st.integers(24, 700),
    "token_budget": st.integers(24, 700),
    "over_budget": st.sampled_from(["truncate", "truncate", "alone", "quarantine"]),
    "truncation": st.sampled_from(["truncate", "truncate", "quarantine"]),
    "max_visual_tokens": st.none() | st.integers(4, 120),
    "chat_template": st.sampled_from([None, "qwen2"]),
})


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rec=records(), lim=limits,
       image_max_pixels=st.sampled_from([28 * 28 * 8, 28 * 28 * 24, 28 * 28 * 64]))
def test_every_sample_holds_whole_images_within_the_limit(pictures, rec, lim, image_max_pixels):
    lim = dict(lim)
    template = lim.pop("chat_template")
    job = _limit_job(image_max_pixels, chat_template=template, **lim)
    f = src(pictures / "data.jsonl")
    raw = json.dumps(rec).encode()
    full = processor_for(_limit_job(image_max_pixels, chat_template=template,
                                    max_seq_len=1_000_000, over_budget="alone")
                         ).process_one(f, 0, raw)
    assert isinstance(full, ProcessedSample) and not full.truncated, full
    assert_vision_consistent(full)
    out = processor_for(job).process_one(f, 0, raw)

    max_tokens, max_visual = job.max_sample_tokens(), job.max_sample_visual_tokens()
    if job.preprocess.truncation == "quarantine" and full.num_tokens > job.preprocess.max_seq_len:
        assert isinstance(out, QuarantinedRecord) and out.reason == "too_long"
        event("too_long")
        return
    n = expected_prefix(full, max_tokens, max_visual)
    if not (full.labels[:n] != IGNORE).any():
        assert isinstance(out, QuarantinedRecord) and out.reason == "no_loss_tokens", out
        assert "no assistant token" in out.detail
        event("no_loss_tokens")
        return
    assert isinstance(out, ProcessedSample), out
    assert_vision_consistent(out, max_tokens, max_visual)
    # Cut only at text: a prefix of the uncut sample, labels cut with the ids, images whole.
    assert out.num_tokens == n
    assert np.array_equal(out.input_ids, full.input_ids[:n])
    assert np.array_equal(out.labels, full.labels[:n])
    k = len(_spans(out))
    if k:
        assert np.array_equal(out.image_grid_thw, full.image_grid_thw[:k])
        assert np.array_equal(out.pixel_values, full.pixel_values[: out.pixel_values.shape[0]])
    assert out.truncated == (n < full.num_tokens)
    event(f"kept {k} of {len(_spans(full))} images, " + ("cut" if out.truncated else "whole"))
    assert out.cost == out.num_tokens  # default cost model: the tokens
    if job.batching.over_budget == "truncate":  # fits a batch alone: the planner never cuts
        assert out.num_tokens <= job.batching.token_budget


# -- the cut itself, exhaustively on made-up layouts ------------------------------------------

@st.composite
def layouts(draw):
    """A sample of text gaps and image spans: (num_tokens, spans, visual tokens)."""
    pos, spans, visual = 0, [], []
    for _ in range(draw(st.integers(0, 4))):
        pos += draw(st.integers(0, 30))
        v = draw(st.integers(1, 40))
        spans.append((pos, pos + v + 2))
        visual.append(v)
        pos += v + 2
    return pos + draw(st.integers(0, 30)), spans, visual


@settings(max_examples=2000, deadline=None)
@given(layout=layouts(), max_tokens=st.integers(1, 250),
       max_visual=st.none() | st.integers(0, 120))
def test_cut_is_the_longest_vision_safe_prefix(layout, max_tokens, max_visual):
    n, spans, visual = layout
    cut = vision_safe_cut(n, spans, visual, max_tokens, max_visual)
    for length in range(min(n, max_tokens), -1, -1):
        whole = [v for (a, b), v in zip(spans, visual, strict=True) if b <= length]
        split = any(a < length < b for a, b in spans)
        if not split and (max_visual is None or sum(whole) <= max_visual):
            assert cut == Cut(length, len(whole))
            return
    raise AssertionError("unreachable: length 0 always fits")


# -- configuration: one owner for the limit, impossible combinations refused at load ---------

@pytest.mark.parametrize(("over_budget", "expected"), [("truncate", 1000), ("alone", 3000),
                                                       ("quarantine", 3000)])
def test_max_sample_tokens_is_the_budget_only_under_truncate(over_budget, expected):
    job = make_job(max_seq_len=3000, batching={"token_budget": 1000, "over_budget": over_budget,
                                               "max_visual_tokens": 64})
    assert job.max_sample_tokens() == expected
    assert job.max_sample_visual_tokens() == (64 if over_budget == "truncate" else None)
    assert make_job(max_seq_len=500, batching={"token_budget": 1000}).max_sample_tokens() == 500


def test_a_sample_fits_alone_when_its_padded_length_does():
    """With pad_to_multiple, truncation cuts to the largest multiple within the budget (a
    sample of the budget's length would be sent longer than it), and a sample's cost is its
    padded length; a multiple beyond the budget is refused at load, naming the field."""
    job = make_job(max_seq_len=3000, batching={"token_budget": 1000, "pad_to_multiple": 48})
    assert job.max_sample_tokens() == 960 and "pad_to_multiple 48" in job.sample_limit_text()
    assert job.sample_cost(961) == 1008 and job.sample_cost(960) == 960
    assert make_job(max_seq_len=500, batching={"token_budget": 1000, "pad_to_multiple": 48}
                    ).max_sample_tokens() == 500
    for bad in (0, 1001):
        with pytest.raises(ValueError, match="pad_to_multiple"):
            make_job(batching={"token_budget": 1000, "pad_to_multiple": bad})


def test_pixels_per_visual_token_is_the_image_processors(pictures):
    from PIL import Image

    cfg = make_job().preprocess
    vp = VisionProcessor(cfg)
    from pipeline.preprocess.vision import PATCH_SIZE

    assert (PATCH_SIZE * vp.merge_size) ** 2 == PIXELS_PER_VISUAL_TOKEN
    # A picture smaller than image_min_pixels is enlarged to exactly that many visual tokens.
    _, grid = vp.process([Image.open(pictures / "camera.png").convert("RGB").resize((20, 20))])
    assert vp.visual_tokens(grid).tolist() == [cfg.min_image_visual_tokens] == [4]


def _job_file(tmp_path, preprocess: dict, batching: dict) -> Path:
    path = tmp_path / "odb.json"
    path.write_text(json.dumps({"jobs": [{"job_id": "j", "world_size": 2,
                                          "source": {"paths": ["x.jsonl"]},
                                          "preprocess": preprocess, "batching": batching}]}))
    return path


def test_a_visual_cap_below_one_image_is_refused_at_load(tmp_path):
    path = _job_file(tmp_path, {"image_min_pixels": 112 * 112}, {"max_visual_tokens": 15})
    with pytest.raises(ConfigError, match=r"jobs\[0\].*batching.max_visual_tokens \(15\) is "
                                          r"below the 16 visual tokens.*image_min_pixels"):
        load_config(path, environ={})
    ok = load_config(_job_file(tmp_path, {"image_min_pixels": 112 * 112},
                               {"max_visual_tokens": 16}), environ={})
    assert ok.jobs[0].batching.max_visual_tokens == 16


def test_inverted_pixel_limits_are_refused_at_load(tmp_path):
    path = _job_file(tmp_path, {"image_min_pixels": 4096, "image_max_pixels": 1024}, {})
    with pytest.raises(ConfigError, match=r"preprocess.*image_min_pixels \(4096\) > "
                                          r"image_max_pixels \(1024\)"):
        load_config(path, environ={})
