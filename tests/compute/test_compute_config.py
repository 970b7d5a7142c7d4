"""`batching.compute_balancing`: off by default, and at its default it leaves a job's config
hash as earlier builds stored it; turning it on is a different plan."""

from __future__ import annotations

import pytest

from pipeline.config import parse_job
from pipeline.coordinator import registry

# In file order, as the builds that stored these hashes read every job (source.shuffle came
# later; tests/coordinator/test_registry.py covers it).
JOB = {"job_id": "d", "world_size": 1, "source": {"paths": ["a.jsonl"], "shuffle": False}}


def test_off_by_default_and_the_default_keeps_the_stored_hash():
    job = parse_job(JOB)
    assert not job.batching.compute_balancing.enabled
    assert registry.config_hash(job) == "af91497357320800"  # as registered before the option
    explicit = parse_job({**JOB, "batching": {"compute_balancing": {"enabled": False}}})
    assert registry.config_hash(explicit) == "af91497357320800"


def test_enabled_is_another_plan_and_bad_settings_are_refused():
    on = parse_job({**JOB, "batching": {"compute_balancing": {"enabled": True}}})
    assert registry.config_hash(on) != registry.config_hash(parse_job(JOB))
    assert on.batching.compute_balancing.fit_settings().max_error == 0.10
    for bad in ({"max_error": 1.5}, {"min_reports": 4}, {"min_reports": 64, "window": 32},
                {"surprise": 1}):
        with pytest.raises(Exception, match="compute_balancing"):
            parse_job({**JOB, "batching": {"compute_balancing": bad}})
