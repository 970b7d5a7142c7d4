"""Issue #13 end to end: `over_budget: truncate` with a token budget far below max_seq_len.

Real pictures through the real Ray preprocessing, the real planner and the service's collate,
then a real (tiny, built in-process) Qwen2-VL forward on every batch: the model refuses a batch
whose `<|image_pad|>` count differs from its image features, so every batch passing it is the
guarantee. The planner must never cut a sample (preprocessing already made each fit alone).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Quarantined, Step
from pipeline.preprocess.pipeline import iter_samples
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.service.collate import Piece, collate

from .conftest import make_job, write_jsonl

PAD = 151655
BUDGET, VISUAL_CAP = 192, 48
PICTURES = {"astronaut.png": ("astronaut", (128, 128)), "chelsea.png": ("chelsea", (150, 100)),
            "rocket.png": ("rocket", (80, 120)), "coffee.png": ("coffee", (200, 130))}


@pytest.fixture(scope="module")
def image_chats(tmp_path_factory):
    import skimage.data as d
    from PIL import Image

    folder = tmp_path_factory.mktemp("image_chats")
    for name, (fn, size) in PICTURES.items():
        Image.fromarray(getattr(d, fn)()).resize(size).save(folder / name)
    rng = random.Random(13)
    records, pictures = [], 0
    for i in range(40):
        pics = [rng.choice(sorted(PICTURES)) for _ in range(rng.randint(0, 3))]
        pictures += len(pics)
        before = pics[: rng.randint(0, len(pics))]
        question = f"Question {i}: " + "tell me more " * rng.randint(0, 12)
        parts = ([{"type": "image", "image": p} for p in before]
                 + [{"type": "text", "text": question}]
                 + [{"type": "image", "image": p} for p in pics[len(before):]])
        records.append({"messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": "It shows this. " * rng.randint(1, 60)}]})
    return write_jsonl(folder / "data.jsonl", records), pictures


@pytest.fixture(scope="module")
def qwen2_vl():
    """A two-layer Qwen2-VL with the real vocabulary ids and patch layout; no weights loaded."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config={"vocab_size": 151680, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2,
                       "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2},
        image_token_id=PAD, video_token_id=151656, vision_start_token_id=151652)
    return Qwen2VLForConditionalGeneration(cfg).eval()


def _forward(model, arrays: dict[str, np.ndarray]) -> float:
    """The batch as a trainer meets it: framed for the wire, decoded by the client and turned
    into the model's inputs (int64 ids, normalized pixels), then one forward."""
    import torch

    from pipeline.service.wire_codec import batch_message_bytes
    from trainer_client.decode import decode_batch
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    msg = pb.ServerMessage.FromString(batch_message_bytes(pb.Batch(), arrays))
    kw = dict(decode_batch(msg.batch).to_model_inputs())
    kw["mm_token_type_ids"] = (kw["input_ids"] == PAD).long()
    with torch.no_grad():
        return float(model(**kw).loss)


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_truncate_under_a_small_budget_gives_model_ready_batches(ray_session, image_chats,
                                                                 qwen2_vl, mode):
    path, pictures = image_chats
    job = make_job([str(path)], image_max_pixels=28 * 28 * 24, batching={
        "token_budget": BUDGET, "max_visual_tokens": VISUAL_CAP, "collate": mode,
        "over_budget": "truncate", "max_window_samples": 16})
    assert job.max_sample_tokens() == BUDGET < job.preprocess.max_seq_len
    items = list(iter_samples(job, 0))
    samples = {s.sample_id: s for s in items if isinstance(s, ProcessedSample)}
    assert {q.reason for q in items if isinstance(q, QuarantinedRecord)} <= {"no_loss_tokens"}
    cut = [s for s in samples.values() if s.truncated]
    assert any(s.image_grid_thw is not None for s in cut), "some cut samples keep images"
    assert len(samples) >= 30

    policy = BatchingPolicy(token_budget=BUDGET, collate=mode, max_visual_tokens=VISUAL_CAP,
                            max_window_samples=16, over_budget="truncate")
    planner = StepPlanner(policy, world_size=2, pool_steps=1)
    events = planner.feed_many(s.measured(mode) for s in samples.values()) + planner.end_epoch()
    assert not [e for e in events if isinstance(e, Quarantined)]
    batches = [b for e in events if isinstance(e, Step) for b in e.batches]
    assert sum(len(b.samples) for b in batches) == len(samples)
    images = 0
    for b in batches:
        assert not b.truncated_to and not b.over_budget and b.cost <= BUDGET
        arrays = collate([Piece(samples[s.sample_id]) for s in b.samples], mode)
        grid = arrays.get("image_grid_thw", np.zeros((0, 3), np.int64))
        per_image = np.prod(grid, axis=1)
        assert int((arrays["input_ids"] == PAD).sum()) == int((per_image // 4).sum())
        assert int((per_image // 4).sum()) <= VISUAL_CAP
        assert arrays.get("pixel_values", np.zeros((0, 1))).shape[0] == int(per_image.sum())
        assert np.isfinite(_forward(qwen2_vl, arrays))
        images += len(grid)
    assert 10 < images < pictures  # most images kept, some dropped whole by the cut


def test_the_model_refuses_a_batch_that_lost_an_images_pixels(image_chats, qwen2_vl):
    """The check above can fail: drop one image's pixels and grid row, keep its tokens."""
    from .conftest import processor_for, src

    job = make_job(image_max_pixels=28 * 28 * 24)
    rec = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": "astronaut.png"}, {"type": "text", "text": "and"},
        {"type": "image", "image": "rocket.png"}]}, {"role": "assistant", "content": "Two."}]}
    s = processor_for(job).process_one(src(image_chats[0]), 0, json.dumps(rec).encode())
    arrays = collate([Piece(s)], "padded")
    assert np.isfinite(_forward(qwen2_vl, arrays))
    last = int(np.prod(s.image_grid_thw[-1]))
    arrays["pixel_values"] = arrays["pixel_values"][:-last]
    arrays["image_grid_thw"] = arrays["image_grid_thw"][:-1]
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        _forward(qwen2_vl, arrays)
