"""Augmentation: exact replay from (seed, epoch, sample_id); epochs differ; cost really changes."""

from __future__ import annotations

import json

import numpy as np

from pipeline.preprocess import augment
from pipeline.preprocess.sample import ProcessedSample

from .conftest import make_job, processor_for, src

AUG = {"augment": {"system_prompts": ["You are terse.", "You are a very verbose and chatty "
                                      "assistant who loves long answers."],
                   "system_prompt_prob": 0.7, "turn_subsample_prob": 0.7,
                   "image_scale_min": 0.5, "image_scale_max": 2.0}}


def _rec() -> bytes:
    msgs = [{"role": "user", "content": [{"type": "image", "image": "astro.png"},
                                         {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": "An astronaut."}]
    for i in range(4):
        msgs += [{"role": "user", "content": f"Question {i}?"},
                 {"role": "assistant", "content": f"Answer number {i}."}]
    return json.dumps({"messages": msgs}).encode()


def test_rng_is_a_stable_hash_not_python_hash():
    a = augment.rng_for(7, 1, "f.jsonl:3").integers(0, 2**31, size=3).tolist()
    b = augment.rng_for(7, 1, "f.jsonl:3").integers(0, 2**31, size=3).tolist()
    assert a == b
    # Pinned: blake2b("7:1:f.jsonl:3") must give these in any process, any PYTHONHASHSEED.
    assert a == PINNED


PINNED = augment.rng_for(7, 1, "f.jsonl:3").integers(0, 2**31, size=3).tolist()


def test_pinned_values_are_process_independent():
    import subprocess
    import sys

    code = ("from pipeline.preprocess import augment;"
            "print(augment.rng_for(7, 1, 'f.jsonl:3').integers(0, 2**31, size=3).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, check=True).stdout
    assert out.strip() == str(PINNED)


def test_same_seed_epoch_id_is_byte_identical_and_epochs_differ(image_dir):
    from pipeline.preprocess.process import Processor

    job = make_job(seed=3, **AUG)
    f = src(image_dir / "data.jsonl")
    digests = {}
    costs = set()
    for epoch in range(5):
        a = processor_for(job, epoch).process_one(f, 5, _rec())
        assert isinstance(a, ProcessedSample)
        if epoch < 2:  # a fresh instance (as in another process) gives the same bytes
            b = Processor(job, epoch).process_one(f, 5, _rec())
            assert a.digest() == b.digest()
            assert np.array_equal(a.pixel_values, b.pixel_values)
        digests[epoch] = a.digest()
        costs.add((a.num_tokens, a.num_visual_tokens))
    assert len(set(digests.values())) > 1  # epochs differ...
    assert len(costs) > 1  # ...and so does the true cost
    other_row = processor_for(job, 0).process_one(f, 6, _rec())
    assert other_row.digest() != digests[0]


def test_disabled_augmentation_is_epoch_independent(image_dir):
    job = make_job(seed=3, **{"augment": {**AUG["augment"], "enabled": False}})
    f = src(image_dir / "data.jsonl")
    d = {processor_for(job, e).process_one(f, 5, _rec()).digest() for e in range(3)}
    assert len(d) == 1


def test_turn_subsampling_keeps_prefix_ending_on_assistant(image_dir):
    job = make_job(seed=1, augment={"turn_subsample_prob": 1.0})
    f = src(image_dir / "data.jsonl")
    full = processor_for(make_job(seed=1), 0).process_one(f, 5, _rec())
    lengths = set()
    for epoch in range(8):
        s = processor_for(job, epoch).process_one(f, 5, _rec())
        assert s.input_ids[-2] == 151645  # ends with the assistant's <|im_end|>\n
        assert s.num_tokens <= full.num_tokens
        lengths.add(s.num_tokens)
    assert len(lengths) > 2 and min(lengths) < full.num_tokens
