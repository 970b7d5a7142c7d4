"""`mode: refill` in the one config model: defaults and clear messages."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config


def write(tmp_path, job: dict):
    import json

    p = tmp_path / "odb.json"
    p.write_text(json.dumps({"jobs": [{"job_id": "gen", "source": {"paths": ["x.jsonl"]},
                                       **job}]}))
    return p


def test_a_refill_job_needs_no_world_size_and_gets_default_options(tmp_path):
    job = load_config(write(tmp_path, {"mode": "refill"}), environ={}).jobs[0]
    assert job.mode == "refill" and job.world_size == 1
    assert job.refill is not None and job.refill.over_budget == "quarantine"
    assert job.refill.generation_tokens is None  # the reference answer's length


def test_refill_options_parse(tmp_path):
    job = load_config(write(tmp_path, {"mode": "refill", "refill": {
        "generation_tokens_field": "max_new_tokens", "max_request_tokens": 8192,
        "over_budget": "alone", "lease_seconds": 5}}), environ={}).jobs[0]
    assert job.refill.generation_tokens_field == "max_new_tokens"
    assert job.refill.max_request_tokens == 8192


@pytest.mark.parametrize("job,message", [
    ({"mode": "refill", "refill": {"generation_tokens": 64,
                                   "generation_tokens_field": "n"}},
     "give one of generation_tokens or generation_tokens_field"),
    ({"world_size": 2, "refill": {"generation_tokens": 64}},
     "refill options are for `mode: refill` jobs, this job has mode 'join'"),
    ({"mode": "refill", "organization": {"kind": "sdo"}}, "organization.kind must be none"),
    ({"mode": "refill", "refill": {"generation_tokens": 0}},
     "jobs[0].refill.generation_tokens = 0"),
    ({"mode": "refill", "refill": {"over_budget": "drop"}},
     "jobs[0].refill.over_budget = 'drop'"),
    ({"mode": "refill", "refill": {"lease_seconds": -1}}, "jobs[0].refill.lease_seconds"),
])
def test_bad_refill_configs_name_the_field(tmp_path, job, message):
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, job), environ={})
    assert message in str(exc.value)
