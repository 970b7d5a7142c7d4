"""The production source: Ray Data preprocessing feeding the served job (shared Ray session)."""

from __future__ import annotations

from pathlib import Path

import pytest
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
