"""A mixture's config: every bad input refused at start with an error naming the field, and
the counts an epoch holds (Streaming's stream semantics: repeat, choose, weight, epoch_samples).
An empty source fails its job once, naming the source."""

from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError, ServiceConfig, TrainingJobConfig, load_config
from pipeline.jobstate import MemoryJobState
from pipeline.order.job_order import JobOrder
from pipeline.order.mixture import MixtureError, apportion, check_weights, parse_weights
from pipeline.producer.local_feed import LocalFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings


def _load(tmp_path, source: dict, **job) -> ServiceConfig:
    path = tmp_path / "odb.json"
    path.write_text(json.dumps({"jobs": [{"job_id": "m", "world_size": 1, "source": source,
                                          **job}]}))
    return load_config(path, environ={})


def _src(**over) -> list[dict]:
    a, b = {"name": "a", "paths": ["a.jsonl"]}, {"name": "b", "paths": ["b.jsonl"]}
    return [{**a, **over.get("a", {})}, {**b, **over.get("b", {})}]


@pytest.mark.parametrize(("source", "needle"), [
    ({"mixture": _src(a={"weight": 0}, b={"weight": 0})},
     "jobs[0].source: Value error, mixture: the weights must sum to a positive number"),
    ({"mixture": _src(a={"repeat": 2, "weight": 1})},
     "mixture[0] (a): give at most one of repeat, choose, weight (got repeat and weight)"),
    ({"mixture": _src(a={"weight": 1})}, "give every source a weight or none (no weight on: b)"),
    ({"mixture": _src(a={"weight": -1}, b={"weight": 1})}, "mixture[0].weight"),
    ({"mixture": _src(b={"name": "a"})}, "mixture[1] (a): the name 'a' is given twice"),
    ({"mixture": _src(b={"name": "no spaces"})}, "mixture[1].name"),
    ({"mixture": _src(a={"repeat": 2}), "epoch_samples": 10},
     "epoch_samples sets the size of a weighted epoch: it cannot go with repeat or choose"),
    ({"mixture": _src(), "schedule": [{"from_step": 5, "weights": {"a": 1, "c": 1}}]},
     "schedule[0].weights: unknown source 'c' (the mixture has a, b)"),
    ({"mixture": _src(), "schedule": [{"from_step": 5, "weights": {"a": 1}}]},
     "schedule[0].weights: give every source a weight (missing: b)"),
    ({"mixture": _src(), "schedule": [{"from_step": 9, "weights": {"a": 1, "b": 1}},
                                      {"from_step": 5, "weights": {"a": 1, "b": 1}}]},
     "schedule: from_step must increase"),
    ({"paths": ["a.jsonl"], "mix_by": "loss_tokens"}, "mix_by loss_tokens needs a mixture"),
    ({"paths": ["a.jsonl"], "mixture": _src()}, "give exactly one of paths"),
    ({"paths": ["a.jsonl"], "read_unit_rows": 100}, "source.read_unit_rows"),
])
def test_a_bad_mixture_is_refused_at_start_naming_the_field(tmp_path, source, needle):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, source)
    assert needle in str(err.value), str(err.value)


def test_sdo_and_refill_jobs_refuse_a_mixture(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot go with organization\.kind sdo"):
        _load(tmp_path, {"mixture": _src()}, organization={"kind": "sdo"})
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"jobs": [{"job_id": "r", "mode": "refill",
                                          "source": {"mixture": _src()}}]}))
    with pytest.raises(ConfigError, match=r"source\.mixture and source\.epoch_samples are for "
                                          "training jobs"):
        load_config(path, environ={})


def _files(tmp_path, rows: dict[str, int]) -> dict[str, str]:
    out = {}
    for name, n in rows.items():
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}"}]}) + "\n" for i in range(n)))
        out[name] = str(p)
    return out


def _job(mixture: list[dict], **source) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({"job_id": "m", "world_size": 1, "source": {
        "mixture": mixture, **source}})


def test_counts_per_epoch_follow_streams_semantics(tmp_path):
    f = _files(tmp_path, {"a": 100, "b": 40, "c": 7})

    def counts(mixture, **source):
        return JobOrder(_job(mixture, **source).source, 0).base_counts

    one = [{"name": "a", "paths": [f["a"]]}, {"name": "b", "paths": [f["b"]]}]
    assert counts(one) == [100, 40]  # no spec: every row once
    assert counts(one, epoch_samples=70) == [50, 20]  # no spec + epoch_samples: by size
    assert counts([{**one[0], "repeat": 1.5}, {**one[1], "choose": 100}]) == [150, 100]
    assert counts([{**one[0], "repeat": 0.25}, one[1]]) == [25, 40]  # a source without: once
    assert counts([{**one[0], "weight": 3}, {**one[1], "weight": 1}]) == [105, 35]
    assert counts([{**one[0], "weight": 3}, {**one[1], "weight": 1}],
                  epoch_samples=10) == [8, 2]
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]  # largest remainder, ties to the first
    with pytest.raises(MixtureError, match="is also in source 'a'"):
        counts([one[0], {"name": "b", "paths": [f["a"]]}])


def test_an_empty_source_is_refused_naming_it_and_fails_its_job_once(tmp_path):
    f = _files(tmp_path, {"a": 20, "empty": 0})
    job = _job([{"name": "a", "paths": [f["a"]]}, {"name": "e", "paths": [f["empty"]]}])
    with pytest.raises(MixtureError, match=r"source 'e' holds no rows \(.*empty.jsonl\)"):
        JobOrder(job.source, 0)
    st = MemoryJobState("m", 1)
    settings = ProducerSettings(lease_seconds=5.0, max_ahead=10**6, linger_seconds=0.0,
                                poll_seconds=0.01, retry_first_seconds=0.02)
    assert Producer(job, st, LocalFeed(job), holder="p", settings=settings).run() \
        is Outcome.FAILED
    failure = st.producer_failure()
    assert failure.cause == "config" and "source 'e' holds no rows" in failure.message


def test_mix_weights_are_parsed_and_checked_naming_the_problem():
    assert parse_weights("a=0.5, b=1") == {"a": 0.5, "b": 1.0}
    for text, needle in (("a", "'a' is not name=weight"), ("a=x", "not a number"),
                         ("", "give name=weight")):
        with pytest.raises(MixtureError, match=needle):
            parse_weights(text)
    for weights, needle in (({"a": 1, "c": 1}, "unknown source 'c'"),
                            ({"a": 1}, "missing: b"), ({"a": 0, "b": 0}, "positive number"),
                            ({"a": float("nan"), "b": 1}, "finite number >= 0")):
        with pytest.raises(MixtureError, match=needle):
            check_weights(("a", "b"), weights, "weights")
