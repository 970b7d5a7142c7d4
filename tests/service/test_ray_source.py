"""The production source: Ray Data preprocessing feeding the served job (shared Ray session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from service_helpers import consume_all, job_dict, service_config

from pipeline.producer.actor import stop_producer
from pipeline.service.server import start_service
from trainer_client import EpochEndInfo

CHATS = Path(__file__).resolve().parents[2] / "pipeline" / "sample_data" / "chats.jsonl"
pytestmark = pytest.mark.slow


@pytest.mark.skipif(not CHATS.exists(), reason="sample data missing")
def test_ray_preprocessed_chats_are_served_exactly_once(ray_session, tmp_path, redis_url,
                                                        redis_client):
    from pipeline.preprocess.pipeline import SampleStore

    chats = tmp_path / "chats.jsonl"  # a slice keeps the test short; it includes a bad row
    chats.write_bytes(b"".join(CHATS.read_bytes().splitlines(keepends=True)[:60]))
    job = job_dict(source={"paths": [str(chats)]},
                   batching={"token_budget": 8192, "max_window_samples": 64})
    cfg = service_config(job, redis_url=redis_url)
    svc = start_service(cfg)  # no explicit source: Ray Data, its producer a Ray actor
    try:
        got = consume_all(svc.address, "j", 2)
        counts = svc.runtimes["j"].state.counters()
        ids = [i for r in got for b in got[r] if not isinstance(b, EpochEndInfo)
               for i in b.info.sample_ids]
        assert len(ids) == len(set(ids)) == counts.samples_in > 0
        assert counts.samples_in + counts.quarantined == 60
        # Random access rebuilds the very tokens that were delivered.
        b = next(x for x in got[0] if not isinstance(x, EpochEndInfo))
        first = SampleStore(cfg.jobs[0]).get(b.info.sample_ids[0], 0)
        n = first.num_tokens
        assert b["input_ids"][0, :n].tolist() == first.input_ids.tolist()
    finally:
        svc.stop(grace=0.5)
        stop_producer("j")


@pytest.mark.skipif(not CHATS.exists(), reason="sample data missing")
def test_a_checkpoint_far_back_in_the_epoch_replays_byte_identical_batches(
        ray_session, tmp_path, redis_url, redis_client):
    """Resume from anywhere in the current epoch (issue #13): a trainer restored from a state
    saved more than 64 steps ago, after the whole epoch was acknowledged and every staged
    payload released, gets the very same batches again, rebuilt by id from the plan."""
    from trainer_client import BatchStream

    chats = tmp_path / "chats.jsonl"
    chats.write_bytes(b"".join(CHATS.read_bytes().splitlines(keepends=True)[:200]))
    job = job_dict(world_size=1, source={"paths": [str(chats)]},
                   batching={"token_budget": 1024, "max_window_samples": 32, "pool_steps": 1})
    svc = start_service(service_config(job, redis_url=redis_url))
    try:
        first: dict[int, str] = {}
        with BatchStream(svc.address, "j", 0, 1) as stream:
            for batch in stream:
                first[batch.info.step] = batch.digest()
                if batch.info.step == 2:
                    saved = stream.state_dict()
        assert len(first) > 64 + 3, f"only {len(first)} steps: the epoch is too short"
        runtime = svc.runtimes["j"]
        assert runtime.state.acked(0) == max(first)  # everything acknowledged, then released
        rebuilt_before = runtime.payloads.rebuilt
        with BatchStream(svc.address, "j", 0, 1, client_id="restored") as stream:
            stream.load_state_dict(saved)
            again = {b.info.step: b.digest() for b in stream}
        assert again == {n: d for n, d in first.items() if n >= 3}
        assert runtime.payloads.rebuilt > rebuilt_before  # not served from a cache
    finally:
        svc.stop(grace=0.5)
        stop_producer("j")


def _plasma_mib() -> float:
    import re

    import ray
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return float(re.search(r"Plasma memory usage (\d+) MiB", text)[1])


def test_with_no_consumer_preprocessing_and_planning_wait_with_flat_memory(
        ray_session, tmp_path, redis_url, redis_client):
    """Back-pressure end to end (issue #12): nobody consumes. The producer stops at
    `max_ahead` steps, Ray Data stops at `preprocess.object_store_mb`, and what the job holds
    stays flat instead of growing with the dataset."""
    import json
    import time

    from pipeline.producer.actor import find_producer
    from pipeline.sample_data.generate import generate

    total = 12_000
    chats = tmp_path / "many.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in generate(total, 5, mean_tokens=80,
                                                                     image_frac=0.0)))
    job = job_dict(world_size=2, source={"paths": [str(chats)]},
                   preprocess={"object_store_mb": 4},
                   batching={"token_budget": 2048, "pool_steps": 1})
    svc = start_service(service_config(job, redis_url=redis_url))
    try:
        state = svc.runtimes["j"].state
        deadline = time.monotonic() + 120
        while state.published_through() < 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state.published_through() >= 0, "nothing planned"

        def held() -> tuple:
            info = ray.get(find_producer("j").info.remote(), timeout=30)
            return (state.published_through(), state.counters().samples_in,
                    info["held"]["blocks"], _plasma_mib())

        # Until it ran into its limits (seconds; longer on a loaded machine): two readings 4 s
        # apart alike. Without back-pressure it would grow until the deadline.
        second, deadline = held(), time.monotonic() + 120
        while True:
            first = second
            time.sleep(4.0)
            second = held()
            if first[:3] == second[:3] or time.monotonic() > deadline:
                break
        assert first[:3] == second[:3], (first, second)  # nothing more planned or read
        published, samples_in, blocks, plasma = second
        assert published <= 2 * 10 + 4  # max_ahead per rank (+ the balancing pool)
        assert samples_in < total // 3 and blocks <= 8  # the rest was never preprocessed
        # Seen: 3 MiB in the object store, 266 of 12,000 rows published, 2 blocks held.
        assert abs(second[3] - first[3]) <= 2 and plasma <= 16, (first, second)
    finally:
        svc.stop(grace=0.5)
        stop_producer("j")
