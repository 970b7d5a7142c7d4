"""Batches of any size (issue #32): a job of 1024 x 1024 pictures at the default budget and the
default gRPC message limit (64 MiB) is delivered exactly once to 2 ranks, in uint8 and in
bfloat16, each batch whole and byte for byte what its samples hold. Before chunked delivery
its first batch (73 MB) failed with RESOURCE_EXHAUSTED and the rank never got past it."""

from __future__ import annotations

import numpy as np
import pytest
from service_helpers import consume_all, service_config, serving
from vlm_data import preprocess, vlm_job, write_records

from trainer_client import BatchStream

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return write_records(tmp_path_factory.mktemp("pictures"), 26)  # ~2 steps of 12 pictures


@pytest.mark.parametrize("pixel_dtype", ["uint8", "bfloat16"])
def test_batches_of_1024_pictures_reach_two_ranks_exactly_once_and_whole(records, pixel_dtype):
    job = vlm_job("vlm", 2, records, pixel_dtype)
    samples = preprocess(job)
    by_id = {s.sample_id: s for s in samples}
    cfg = service_config(job)
    assert cfg.grpc.max_message_mb == 64 and cfg.jobs[0].batching.token_budget == 16384
    with serving(cfg, {"vlm": samples}) as svc:
        got = consume_all(f"127.0.0.1:{svc.port}", "vlm", 2, tensors="numpy")
        with BatchStream(f"127.0.0.1:{svc.port}", "vlm", 0, 2) as s:
            notice = s.job_status().batch_size_notice
    batches = [b for rank in got.values() for b in rank[:-1]]
    ids = [i for b in batches for i in b.info.sample_ids]
    assert sorted(ids) == sorted(by_id)  # every picture exactly once across the ranks
    assert max(b.nbytes for b in batches) > 64 * MiB  # beyond one message: it came in chunks
    for b in batches:  # whole, and the very bytes its samples hold
        mine = [by_id[i] for i in b.info.sample_ids]
        assert b["pixel_values"].tobytes() == np.concatenate(
            [s.pixel_values for s in mine]).tobytes()
        assert np.array_equal(b["image_grid_thw"], np.concatenate(
            [s.image_grid_thw for s in mine]))
        for row, s in enumerate(mine):
            assert np.array_equal(b["input_ids"][row, :s.num_tokens], s.input_ids)
    assert "a batch of images may reach" in notice  # status says what a trainer holds
