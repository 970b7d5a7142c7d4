"""The failure table: each row's exceptions get its cause, transient or permanent as documented,
whatever wraps them (a Ray task error, `raise ... from`); anything unknown is permanent; the
backoff doubles and stays bounded."""

from __future__ import annotations

import errno

import pydantic
import pytest
import ray.exceptions as rx

from pipeline.config import TrainingJobConfig
from pipeline.errors import (
    CheckpointConflict,
    DurabilityTimeout,
    JobMismatch,
    StateUnavailable,
    StepConflict,
    StepGap,
)
from pipeline.preprocess.sources import SourceNotFound
from pipeline.producer.failures import (
    Backoff,
    Cause,
    LeaseUnconfirmed,
    StateRolledBack,
    classify,
    describe,
)


def _bad_config() -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as err:
        TrainingJobConfig.model_validate({"job_id": "x", "world_size": 0})
    return err.value


TABLE = [
    (StateUnavailable("redis at 127.0.0.1:1 unreachable"), Cause.STATE_UNAVAILABLE),
    (LeaseUnconfirmed("could not renew"), Cause.STATE_UNAVAILABLE),
    (DurabilityTimeout("WAITAOF: not fsynced within 5000 ms"), Cause.NOT_DURABLE),
    (StateRolledBack("the state holds steps through 3"), Cause.STATE_ROLLED_BACK),
    (StepGap("step 9, next is 4"), Cause.STATE_ROLLED_BACK),
    (CheckpointConflict("goes backwards"), Cause.STATE_ROLLED_BACK),
    (rx.ObjectLostError("ab" * 14, None, ""), Cause.RAY_UNAVAILABLE),
    (rx.GetTimeoutError("get timed out"), Cause.RAY_UNAVAILABLE),
    (rx.RaySystemError("gcs unreachable"), Cause.RAY_UNAVAILABLE),
    (OSError(errno.EIO, "Input/output error"), Cause.SOURCE_UNREADABLE),
    (TimeoutError("read timed out"), Cause.SOURCE_UNREADABLE),
    (ConnectionResetError("peer reset"), Cause.SOURCE_UNREADABLE),
    (SourceNotFound("source not found: data/a.jsonl"), Cause.SOURCE_MISSING),
    (FileNotFoundError(errno.ENOENT, "No such file", "a.jsonl"), Cause.SOURCE_MISSING),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "data"), Cause.SOURCE_MISSING),
    (PermissionError(errno.EACCES, "Permission denied", "a.jsonl"), Cause.SOURCE_FORBIDDEN),
    (JobMismatch("config hash differs"), Cause.CONFIG),
    (_bad_config(), Cause.CONFIG),
    (StepConflict("step 4 is already published with different content"), Cause.PLAN_CONFLICT),
    (ValueError("a bug"), Cause.INTERNAL),
    (KeyError("missing"), Cause.INTERNAL),
    (LookupError("step 3, returned by the end of world 0, is not in the state"),
     Cause.INTERNAL),
]


@pytest.mark.parametrize(("exc", "cause"), TABLE, ids=lambda x: type(x).__name__)
def test_every_row_of_the_table(exc, cause):
    assert classify(exc) is cause


def test_transient_and_permanent_are_as_documented():
    assert {c for c in Cause if c.transient} == {
        Cause.STATE_UNAVAILABLE, Cause.NOT_DURABLE, Cause.STATE_ROLLED_BACK,
        Cause.RAY_UNAVAILABLE, Cause.SOURCE_UNREADABLE}
    for c in Cause:  # every cause tells the operator what to do
        assert "restart the serve replicas" in c.advice or "new job_id" in c.advice


def test_a_ray_task_error_is_classified_by_what_it_wraps():
    missing = rx.RayTaskError("read", "tb", FileNotFoundError(2, "No such file", "a.jsonl"))
    assert classify(missing.as_instanceof_cause()) is Cause.SOURCE_MISSING
    assert classify(missing) is Cause.SOURCE_MISSING  # not subclassed: follows `.cause`
    bug = rx.RayTaskError("map", "tb", ZeroDivisionError("x")).as_instanceof_cause()
    assert classify(bug) is Cause.INTERNAL
    flaky = rx.RayTaskError("read", "tb", OSError(errno.EIO, "I/O error"))
    assert classify(flaky.as_instanceof_cause()) is Cause.SOURCE_UNREADABLE


def test_a_chained_exception_is_classified_by_its_cause():
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied", "a.jsonl")
        except PermissionError as inner:
            raise RuntimeError("reading the source failed") from inner
    except RuntimeError as outer:
        assert classify(outer) is Cause.SOURCE_FORBIDDEN
    loop = RuntimeError("self")
    loop.__cause__ = loop
    assert classify(loop) is Cause.INTERNAL  # a cycle ends


def test_describe_is_one_line():
    assert describe(ValueError("a\nb")) == "ValueError: a"
    assert describe(KeyError()) == "KeyError"


def test_backoff_doubles_and_is_bounded():
    b = Backoff(first=0.5, cap=4.0)
    assert [b.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.delay(10_000) == 4.0
