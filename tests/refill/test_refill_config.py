"""`mode: refill` jobs in the config: their own type (`RefillJobConfig`), defaults and clear
messages; a training job's options on one are refused, and the reverse."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, RefillJobConfig, TrainingJobConfig, load_config
from pipeline.modes import JobMode, OverBudgetPolicy


def write(tmp_path, job: dict):
    import json

    p = tmp_path / "odb.json"
    p.write_text(json.dumps({"jobs": [{"job_id": "gen", "source": {"paths": ["x.jsonl"]},
                                       **job}]}))
    return p


def test_a_refill_job_needs_no_world_size_and_gets_default_options(tmp_path):
    job = load_config(write(tmp_path, {"mode": "refill"}), environ={}).jobs[0]
    assert isinstance(job, RefillJobConfig) and job.mode is JobMode.REFILL
    assert not hasattr(job, "world_size") and not hasattr(job, "batching")
    assert job.refill.over_budget is OverBudgetPolicy.QUARANTINE
    assert job.refill.generation_tokens is None  # the reference answer's length


def test_a_job_without_mode_is_a_join_training_job(tmp_path):
    job = load_config(write(tmp_path, {"world_size": 2}), environ={}).jobs[0]
    assert isinstance(job, TrainingJobConfig) and job.mode is JobMode.JOIN
    assert not hasattr(job, "refill")


def test_refill_options_parse(tmp_path):
    job = load_config(write(tmp_path, {"mode": "refill", "refill": {
        "generation_tokens_field": "max_new_tokens", "max_request_tokens": 8192,
        "over_budget": "alone", "lease_seconds": 5}}), environ={}).jobs[0]
    assert job.refill.generation_tokens_field == "max_new_tokens"
    assert job.refill.max_request_tokens == 8192
    assert job.refill.over_budget is OverBudgetPolicy.ALONE


@pytest.mark.parametrize("job,message", [
    ({"mode": "refill", "refill": {"generation_tokens": 64,
                                   "generation_tokens_field": "n"}},
     "give one of generation_tokens or generation_tokens_field"),
    ({"world_size": 2, "refill": {"generation_tokens": 64}},
     "jobs[0]: Value error, refill: options of `mode: refill` jobs, this job has mode 'join'"),
    ({"world_size": 2, "mode": "quota", "refill": {}}, "this job has mode 'quota'"),
    ({"mode": "refill", "organization": {"kind": "sdo"}},
     "organization: options of training jobs; a `mode: refill` job has consumers"),
    ({"mode": "refill", "world_size": 4, "elastic": True, "batching": {"token_budget": 64}},
     "world_size, elastic, batching: options of training jobs"),
    ({"mode": "refill", "refill": {"generation_tokens": 0}},
     "jobs[0].refill.generation_tokens = 0"),
    ({"mode": "refill", "refill": {"over_budget": "drop"}},
     "jobs[0].refill.over_budget = 'drop': Input should be 'truncate', 'alone' or 'quarantine'"),
    ({"mode": "refill", "refill": {"lease_seconds": -1}}, "jobs[0].refill.lease_seconds"),
    ({"mode": "infer", "world_size": 1}, "jobs[0].mode = 'infer': Input should be 'join', "
                                         "'quota' or 'refill'"),
])
def test_bad_refill_configs_name_the_field(tmp_path, job, message):
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, job), environ={})
    assert message in str(exc.value)


def test_a_training_job_type_refuses_the_refill_mode():
    with pytest.raises(ValueError, match="a training job's mode is join or quota, not 'refill'"):
        TrainingJobConfig(job_id="t", world_size=1, mode="refill", source={"paths": ["x"]})
