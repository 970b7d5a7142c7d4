"""`odb-pipeline status` against a live service (real gRPC and HTTP over loopback) while two
trainer ranks consume and stop at known steps."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
from obs_helpers import (
    JOB,
    Rank,
    ranks_stopped_at_known_steps,
    samples,
    served,
)
from prometheus_client.parser import text_string_to_metric_families
from support.waiting import wait_for

from pipeline.cli import main
from pipeline.preprocess.array_source import synthetic_samples
from pipeline.preprocess.sample import QuarantinedRecord


def _status(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert main(["status", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_json_reports_each_ranks_steps_while_consuming(capsys) -> None:
    with served() as (svc, mport), ranks_stopped_at_known_steps(svc) as (ranks, acked,
                                                                         delivered):
        argv = ("--endpoint", svc.address, "--metrics-endpoint", f"127.0.0.1:{mport}",
                "--job", JOB)

        def settled() -> bool:
            got = _status(capsys, *argv)["jobs"][0]["ranks"]
            return ([r["acked_step"] for r in got] == acked
                    and [r["replica"]["delivered_step"] for r in got] == delivered)

        wait_for(settled, what="acks and deliveries to reach the server")
        out = _status(capsys, *argv)
        print(json.dumps(out, indent=1)[:3000])
        job = out["jobs"][0]
        assert job["job_id"] == JOB
        assert job["state"] == ("draining" if job["done"] else "running")
        assert job["world_size"] == 2 and job["mode"] == "join"
        plan = svc.runtimes[JOB].state
        for i, r in enumerate(job["ranks"]):
            assert r["rank"] == i and r["replica"]["connected"] is True
            assert (r["acked_step"], r["replica"]["delivered_step"]) == (acked[i], delivered[i])
            # Lag: this rank's published steps after its ack (the planner runs ahead).
            waiting = [n for n in range(acked[i] + 1, plan.published_through() + 1)
                       if plan.get_step(n).batch_for(i) is not None]
            assert r["lag_steps"] == len(waiting) >= 1
            assert r["stalled"] is False
            # Emitted = consumed (acknowledged): the batches taken, not the one in the client
            # queue; the same figure whichever replica served the rank.
            taken = sum(len(b.info.sample_ids) for b in ranks[i].batches)
            assert r["samples_emitted"] == taken
            assert r["batches_emitted"] == len(ranks[i].batches)
        assert job["totals"]["samples_emitted"] == sum(r["samples_emitted"]
                                                       for r in job["ranks"])
        assert 0 < job["padding_efficiency"] <= 1
        assert 0 < job["budget_utilisation"] <= 1
        assert job["throughput"]["basis"] == "uptime"
        assert job["throughput"]["samples_per_s"] > 0
        assert job["producer"]["live"] and job["producer"]["generation"] == 1
        assert job["planned"]["samples"] >= job["totals"]["samples_emitted"]

        # --watch: throughput over the interval, one JSON object per refresh.
        capsys.readouterr()
        assert main(["status", *argv, "--json", "--watch", "0.2", "--count", "2"]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 2
        second = json.loads(lines[1])["jobs"][0]["throughput"]
        assert second["basis"] == "interval" and second["samples_per_s"] == 0.0

        # The text view names every rank with its steps.
        capsys.readouterr()
        assert main(["status", *argv]) == 0
        text = capsys.readouterr().out
        assert f"job {JOB}" in text and "padding efficiency" in text


def test_status_quarantine_counts_and_lists_records(capsys) -> None:
    bad = [QuarantinedRecord("data.jsonl", 3, "bad_json", "Expecting value"),
           QuarantinedRecord("data.jsonl", 9, "missing_roles", "no assistant turn")]
    items = [*bad, *synthetic_samples(40, seed=1, max_len=128, vocab=100),
             *synthetic_samples(1, lengths=[5000], source="huge")]  # over the 1024 budget
    with served(items, jobs=[{"job_id": JOB, "world_size": 2, "source": {"paths": ["a"]},
                              "batching": {"token_budget": 1024, "max_window_samples": 8,
                                           "over_budget": "quarantine"}}]) as (svc, mport):
        wait_for(lambda: svc.runtimes[JOB].state.counters().quarantined == 3,
                 what="quarantine")
        out = _status(capsys, "--metrics-endpoint", f"127.0.0.1:{mport}", "--quarantine")
        q = out["jobs"][0]["quarantine"]
        assert q["total"] == 3
        assert q["by_reason"] == {"bad_json": 1, "missing_roles": 1, "over_budget": 1}
        assert {r["sample_id"] for r in q["records"]} == {"data.jsonl:3", "data.jsonl:9",
                                                          "huge:0"}
        # Without --quarantine only the counts are printed.
        out = _status(capsys, "--metrics-endpoint", f"127.0.0.1:{mport}")
        assert out["jobs"][0]["quarantine"]["records"] is None
        # The same counts on /metrics, one series per reason.
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as resp:
            fams = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
        got = {s.labels["reason"]: s.value for s in fams["odb_quarantined"].samples
               if s.name == "odb_quarantined_total"}
        assert got == {"bad_json": 1.0, "missing_roles": 1.0, "over_budget": 1.0}


def _one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_unreachable_endpoint_exits_2_with_one_line(capsys, monkeypatch, tmp_path) -> None:
    port = _free_port()
    err = _one_line_error(capsys, ["status", "--endpoint", f"127.0.0.1:{port}", "--job", "x"])
    assert f"cannot reach the service at 127.0.0.1:{port}" in err and "UNAVAILABLE" in err
    err = _one_line_error(capsys, ["status", "--metrics-endpoint", f"127.0.0.1:{port}"])
    assert f"cannot reach the metrics endpoint at http://127.0.0.1:{port}" in err
    err = _one_line_error(capsys, ["status", "--redis-url", f"redis://127.0.0.1:{port}/0"])
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in err
    # No flags and no local service running (an empty state dir, no redis_url): say so.
    monkeypatch.setenv("ODB_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("ODB_REDIS_URL", raising=False)
    err = _one_line_error(capsys, ["status"])
    assert "no local service is running" in err and "give --endpoint" in err


def test_unknown_job_and_bad_token_exit_2(capsys, monkeypatch) -> None:
    with served(tokens={JOB: "s3cret"}) as (svc, mport):
        err = _one_line_error(capsys, ["status", "--endpoint", svc.address, "--job", "nope"])
        assert "NOT_FOUND" in err and "unknown job 'nope'" in err
        err = _one_line_error(capsys, ["status", "--metrics-endpoint", f"127.0.0.1:{mport}",
                                       "--job", "nope"])
        assert "unknown job 'nope'" in err
        monkeypatch.delenv("ODB_NO_SUCH_TOKEN", raising=False)
        err = _one_line_error(capsys, ["status", "--endpoint", svc.address, "--job", JOB,
                                       "--token-env", "ODB_NO_SUCH_TOKEN"])
        assert "ODB_NO_SUCH_TOKEN is unset" in err
        err = _one_line_error(capsys, ["status", "--endpoint", svc.address, "--job", JOB])
        assert "UNAUTHENTICATED" in err
        monkeypatch.setenv("ODB_STATUS_TOKEN", "s3cret")
        out = _status(capsys, "--endpoint", svc.address, "--job", JOB,
                      "--token-env", "ODB_STATUS_TOKEN")
        assert out["jobs"][0]["job_id"] == JOB


def test_status_from_redis_lists_jobs_with_heartbeats(capsys, redis_url, redis_client) -> None:
    with served(samples(60), redis_url=redis_url) as (svc, mport):
        r0 = Rank(svc.address, 0, 2).start()
        try:
            r0.wait_taken()
            acked = r0.steps[-1]
            wait_for(lambda: svc.runtimes[JOB].state.acked(0) == acked, what="ack")
            out = _status(capsys, "--redis-url", redis_url, "--endpoint", svc.address,
                          "--metrics-endpoint", f"127.0.0.1:{mport}")
            job = next(j for j in out["jobs"] if j["job_id"] == JOB)
            assert job["ranks"][0]["acked_step"] == acked
            assert job["ranks"][0]["heartbeat_age_s"] is not None  # from Redis
            assert job["ranks"][0]["samples_emitted"] > 0  # from the metrics port
            assert job["redis"]["published_through"] >= acked
            # Redis alone (no server): the job is listed with its cursors.
            out = _status(capsys, "--redis-url", redis_url)
            job = next(j for j in out["jobs"] if j["job_id"] == JOB)
            assert job["ranks"][0]["acked_step"] == acked
            assert job["state"] == ("draining" if job["done"] else "running")
        finally:
            r0.release()
