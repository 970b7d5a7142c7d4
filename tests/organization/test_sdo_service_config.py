"""How `serve` takes an SDO job: planned with the window `locality` asks for (the registered
config stays the job's own), payloads fetched by a visit's sample, and refused with a clear
error where there is nothing to embed (an in-memory sample source)."""

from __future__ import annotations

import pytest

from pipeline.config import ServiceConfig, TrainingJobConfig
from pipeline.errors import UserError
from pipeline.organization.locality import planner_lookahead
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.sdo_feed import planning_job
from pipeline.service.payloads import payload_id_of
from pipeline.service.server import start_service


def _job(kind: str = "sdo", locality: float = 1.0) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({
        "job_id": "sdo-cfg", "world_size": 2, "source": {"paths": ["chats.jsonl"]},
        "batching": {"token_budget": 1024},
        "organization": {"kind": kind, "locality": locality}})


@pytest.mark.parametrize("locality", [0.0, 0.5, 1.0])
def test_an_sdo_job_is_planned_with_the_locality_window(locality):
    job = _job(locality=locality)
    planned = planning_job(job)
    policy = job.batching.policy()
    want = planner_lookahead(locality, policy.lookahead_tokens, policy.token_budget)
    assert planned.batching.policy().lookahead_tokens == want
    assert planned.batching.model_copy(update={"lookahead_tokens": None}) == job.batching
    assert job.batching.lookahead_tokens is None  # the job itself is untouched
    if locality == 1.0:
        assert want == 2 * 1024
    assert planning_job(_job(kind="none")) == _job(kind="none")


def test_a_visit_fetches_its_samples_payload():
    assert payload_id_of(_job())("data/a.jsonl:7#2") == "data/a.jsonl:7"
    assert payload_id_of(_job())("a#b.jsonl:7#0") == "a#b.jsonl:7"  # split on the last '#'
    assert payload_id_of(_job(kind="none"))("data/a.jsonl:7#2") == "data/a.jsonl:7#2"
    with pytest.raises(ValueError, match="not a visit id"):
        payload_id_of(_job())("data/a.jsonl:7")


def test_an_sdo_job_over_an_in_memory_source_is_refused():
    cfg = ServiceConfig.model_validate({"grpc": {"port": 0}, "metrics_port": None,
                                        "jobs": [_job().model_dump()]})
    source = ArraySource(synthetic_samples(4, max_len=64, seed=0))
    with pytest.raises(UserError, match=r"job 'sdo-cfg': organization\.kind sdo needs a job "
                                        r"preprocessed by Ray Data"):
        start_service(cfg, sample_sources={"sdo-cfg": source})
