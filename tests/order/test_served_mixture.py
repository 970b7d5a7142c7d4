"""A mixture served for real (Ray preprocessing, the job's state in Redis, gRPC ranks): the
`mix` command moves every rank at one step boundary and is refused precisely (an unknown or
missing source, weights that do not sum to a positive number, a job without a mixture, an
unknown job); the epoch stays exactly once across the change; each source's part of the plan
shows on every status surface (GetJob, JSON, text, the page, Prometheus)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest
from support.waiting import wait_for

from pipeline.cli import main
from pipeline.config import ServiceConfig
from pipeline.observability.job_status import ServiceStatus
from pipeline.observability.metrics import OdbCollector
from pipeline.observability.status_json import job_to_dict
from pipeline.observability.status_page import render
from pipeline.observability.status_proto import from_proto
from pipeline.observability.status_view import training_job_status
from pipeline.producer.actor import stop_producer
from pipeline.service.server import start_service
from pipeline.status.text import _job as text_lines
from trainer_client import BatchStream
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
ROWS = 400


def _chats(path: Path, tag: str) -> str:
    lines = [json.dumps({"messages": [
        {"role": "user", "content": f"{tag} question {i}"},
        {"role": "assistant", "content": f"{tag} answer {i} " + "word " * (20 + i % 60)}]})
        for i in range(ROWS)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _mix(address: str, job: str, weights: str, capsys) -> tuple[int, str, str]:
    """The CLI's exit code, stdout and its own stderr lines (the ranks' streams in threads of
    this process log to the same stderr: a rank held at the gate says it waits)."""
    rc = main(["mix", "--endpoint", address, "--job", job, "--weights", weights, "--json"])
    out = capsys.readouterr()
    own = "".join(line for line in out.err.splitlines(keepends=True)
                  if line.startswith("odb-pipeline"))
    return rc, out.out, own


def test_mix_moves_every_rank_at_one_step_and_every_surface_shows_the_sources(
        ray_session, tmp_path, redis_url, redis_client, capsys):
    a, b = _chats(tmp_path / "a.jsonl", "a"), _chats(tmp_path / "b.jsonl", "b")
    cfg = ServiceConfig.model_validate({
        "grpc": {"port": 0, "prefetch_steps": 2}, "lease_seconds": 5.0, "metrics_port": None,
        "redis_url": redis_url,
        "jobs": [{"job_id": "m", "world_size": 2, "seed": 4,
                  "batching": {"token_budget": 1024, "lookahead_tokens": 8192,
                               "pool_steps": 2},
                  "source": {"mixture": [{"name": "a", "paths": [a]},
                                         {"name": "b", "paths": [b], "repeat": 2}]}},
                 {"job_id": "plain", "world_size": 1, "source": {"paths": [a]}}]})
    svc = start_service(cfg)
    gate = threading.Event()
    got: dict[int, list] = {0: [], 1: []}

    def rank(r: int) -> None:
        with BatchStream(svc.address, "m", r, 2) as stream:
            for batch in stream:
                got[r].append(batch.info)
                if len(got[r]) == 5:
                    gate.wait(120)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: min(len(g) for g in got.values()) >= 5, 120, "the first steps")
        # Refused precisely, nothing recorded.
        for weights, needle in (("a=1,c=1", "unknown source 'c'"),
                                ("a=1", "give every source a weight (missing: b)"),
                                ("a=0,b=0", "must sum to a positive number"),
                                ("a=-1,b=2", "finite number >= 0"),
                                ("a=x", "not a number")):
            rc, _, err = _mix(svc.address, "m", weights, capsys)
            assert rc == 2 and needle in err and err.count("\n") == 1, err
        rc, _, err = _mix(svc.address, "plain", "a=1", capsys)
        assert rc == 2 and "FAILED_PRECONDITION" in err and "no source.mixture" in err, err
        rc, _, err = _mix(svc.address, "nope", "a=1,b=1", capsys)
        assert rc == 2 and "NOT_FOUND" in err, err
        state = svc.runtimes["m"].state
        assert state.mix_request() is None
        rc, out, err = _mix(svc.address, "m", "a=3,b=1", capsys)
        assert rc == 0, err
        assert json.loads(out) == {"job_id": "m", "seq": 1,
                                               "weights": {"a": 3.0, "b": 1.0}}
        gate.set()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads)
        with grpc.insecure_channel(svc.address) as ch:
            reply = pb_grpc.DataServiceStub(ch).GetJob(pb.GetJobRequest(job_id="m"), timeout=10)
    finally:
        gate.set()
        svc.stop(grace=0.5)
        stop_producer("m")
        stop_producer("plain")

    # Exactly once, the epoch's size kept; the change at one step boundary for every rank.
    ids = [i for r in got for info in got[r] for i in info.sample_ids]
    assert len(ids) == len(set(ids)) == 3 * ROWS
    status = state.source_status()
    ((step, by, weights),) = status.changes
    assert (by, dict(weights)) == ("mix 1", {"a": 3.0, "b": 1.0})
    assert all(info.step < step for r in got for info in got[r][:5])  # after what was held
    late = [i for r in got for info in got[r] if info.step >= step + 5 for i in info.sample_ids]
    share_a = sum(Path(i.split(":")[0]).name == "a.jsonl" for i in late) / len(late)
    assert share_a > 0.5, share_a  # 1/3 before, 3/4 asked
    assert [s.samples for s in status.sources] == [
        sum(Path(i.split(":")[0]).name == n for i in ids) for n in ("a.jsonl", "b.jsonl")]

    # Every surface: GetJob's reply, the JSON, the text, the page, the metrics.
    job = training_job_status("m", state, job=cfg.jobs[0])
    assert from_proto(reply).sources == job.sources
    assert [x.name for x in job.sources.sources] == ["a", "b"]
    assert job_to_dict(job)["sources"]["changes"][0]["by"] == "mix 1"
    text = "\n".join(text_lines(job, False))
    assert "sources (epoch 0, shares of samples)" in text and "mix 1 from step" in text
    page = render(ServiceStatus(0.0, 0.0, "r", (job,)))
    assert 'table class="sources"' in page and 'data-source="b"' in page
    metrics = {m.name: m for m in OdbCollector(_View(job)).collect()}
    shares = {s.labels["source"]: s.value for s in metrics["odb_source_share"].samples}
    assert shares == {x.name: x.share for x in job.sources.sources}


class _View:
    """The metrics collector's view of one job's status."""

    def __init__(self, job) -> None:
        self.job, self.started_at = job, 0.0

    def status(self):
        return ServiceStatus(0.0, 0.0, "r", (self.job,))
