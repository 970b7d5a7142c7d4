"""Structured logs: JSON lines with ts/level/logger/msg and job/rank/step when the record has
them (from `extra=` or the ambient `log_context`)."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from datetime import datetime

import pytest

from pipeline.observability import configure_logging, log_context


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_context_fields(restore_root) -> None:
    buf = io.StringIO()
    configure_logging("json", "DEBUG", stream=buf)
    log = logging.getLogger("pipeline.service.data_server")
    log.info("rank %d opened", 1, extra={"job": "sft", "rank": 1})
    with log_context(job="sft", rank=0):
        log.debug("sent step", extra={"step": 41})
        with log_context(step=42):
            log.warning("slow ack")

    def other_thread() -> None:  # contextvars do not leak into other threads
        log.error("no context here")

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("producer failed", extra={"job": "sft"})
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [ln["msg"] for ln in lines] == ["rank 1 opened", "sent step", "slow ack",
                                           "no context here", "producer failed"]
    for ln in lines:
        assert datetime.fromisoformat(ln["ts"].replace("Z", "+00:00")).tzinfo is not None
        assert ln["logger"] == "pipeline.service.data_server"
    assert [ln["level"] for ln in lines] == ["INFO", "DEBUG", "WARNING", "ERROR", "ERROR"]
    assert (lines[0]["job"], lines[0]["rank"]) == ("sft", 1) and "step" not in lines[0]
    assert (lines[1]["job"], lines[1]["rank"], lines[1]["step"]) == ("sft", 0, 41)
    assert (lines[2]["job"], lines[2]["rank"], lines[2]["step"]) == ("sft", 0, 42)
    assert not {"job", "rank", "step"} & lines[3].keys()
    assert "ValueError: boom" in lines[4]["exc"]


def test_text_format_and_reconfigure_replaces_handler(restore_root) -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("text", "INFO", stream=first)
    configure_logging("text", "WARNING", stream=second)  # replaces, does not stack
    log = logging.getLogger("odb.test")
    log.info("hidden")
    log.warning("visible", extra={"job": "j", "rank": 3})
    assert first.getvalue() == ""
    line = second.getvalue().strip()
    assert line.endswith("odb.test: visible [job=j rank=3]") and "WARNING" in line
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml", "INFO")  # type: ignore[arg-type]


def test_the_service_logs_job_rank_and_step_as_fields(restore_root) -> None:
    """A real stream open on a real server: its log line is JSON with job, rank and step."""
    from obs_helpers import JOB, served

    from trainer_client import BatchStream

    buf = io.StringIO()
    configure_logging("json", "INFO", stream=buf)
    with served() as (svc, _), BatchStream(svc.address, JOB, 1, 2, prefetch=1) as stream:
        next(iter(stream))
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    opened = [r for r in lines if "opened at step" in r["msg"]]
    assert opened, lines
    assert opened[0]["job"] == JOB and opened[0]["rank"] == 1 and opened[0]["step"] == 0
