"""`odb-pipeline status` without an address finds a real `serve` process the way `serve`
configured itself (--config, the ODB_* environment, defaults), over TLS: right after it starts,
while a trainer consumes, and not once it stopped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.serve_process import REPO, ServeProcess

from pipeline.cli import main
from pipeline.sample_data import sample_chats_path
from trainer_client import BatchStream

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

JOB = "sft"
TOKEN_ENV = "ODB_TEST_STATUS_TOKEN"
TOKEN = "local-status-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A TLS `serve` on free ports with the embedded Redis, its state dir from ODB_STATE_DIR."""
    d = tmp_path_factory.mktemp("local")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem")], check=True, capture_output=True)
    chats = d / "chats.jsonl"
    chats.write_bytes(b"".join(Path(sample_chats_path()).read_bytes()
                               .splitlines(keepends=True)[:40]))
    config = d / "odb.json"
    config.write_text(json.dumps({
        "grpc": {"port": 0, "tls_cert": str(d / "cert.pem"), "tls_key": str(d / "key.pem")},
        "metrics_port": 0, "ray": {"num_cpus": 1, "object_store_mb": 128},
        "jobs": [{"job_id": JOB, "world_size": 1, "token_env": TOKEN_ENV,
                  "source": {"paths": [str(chats)]}, "batching": {"token_budget": 8192}}]}))
    env = {**os.environ, "ODB_STATE_DIR": str(d / "state"), TOKEN_ENV: TOKEN,
           "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    proc = ServeProcess([sys.executable, "-m", "pipeline.cli", "serve", "--config", str(config)],
                        env).start()
    proc.wait_for_ray()
    try:
        yield proc, config, d
    finally:
        proc.stop()


def _status(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["status", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["status", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def local_env(served, monkeypatch):
    _, _, d = served
    monkeypatch.setenv("ODB_STATE_DIR", str(d / "state"))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return served


def test_status_without_flags_finds_the_tls_service_and_its_ranks(local_env, capsys):
    proc, config, d = local_env
    out = _status(capsys)
    src = out["sources"]
    assert src["local_service"].startswith(f"serve (pid {proc.proc.pid},")
    assert src["endpoint"] == f"127.0.0.1:{proc.port}"
    assert src["metrics"] == f"127.0.0.1:{proc.metrics_port}"
    assert src["tls"] is True and "grpc_skipped" not in src
    # The embedded Redis, found, with its password (from the state dir) masked in the output.
    password = (d / "state" / "redis" / "password").read_text().strip()
    assert src["redis"].startswith("redis://:***@127.0.0.1:") and password not in str(out)
    (job,) = out["jobs"]
    assert job["job_id"] == JOB and job["world_size"] == 1
    assert job["replica"]["id"]  # GetJob answered, over TLS, with the job's token

    # A trainer takes the whole epoch (over TLS); status then shows its acknowledged steps.
    with BatchStream(f"127.0.0.1:{proc.port}", JOB, 0, 1, token=TOKEN,
                     root_certificates=(d / "cert.pem").read_bytes()) as stream:
        steps = [b.info.step for b in stream]
    assert steps
    job = _status(capsys)["jobs"][0]
    assert job["ranks"][0]["acked_step"] == steps[-1]
    assert job["redis"]["published_through"] == steps[-1]

    # --config names the same service; --watch refreshes; the text view names the job.
    assert _status(capsys, "--config", str(config))["sources"] == src
    capsys.readouterr()
    assert main(["status", "--json", "--watch", "0.2", "--count", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["jobs"][0]["throughput"]["basis"] == \
        "interval"
    assert main(["status"]) == 0
    text = capsys.readouterr().out
    assert f"job {JOB}" in text
    assert text.startswith(f"service: serve (pid {proc.proc.pid},") and "(tls)" in text


def test_a_job_whose_token_is_not_set_here_is_answered_without_grpc(local_env, capsys,
                                                                     monkeypatch):
    monkeypatch.delenv(TOKEN_ENV)
    out = _status(capsys)
    assert TOKEN_ENV in out["sources"]["grpc_skipped"][JOB]
    (job,) = out["jobs"]
    assert job["job_id"] == JOB
    assert job["redis"]["state"] and job["totals"]  # Redis and the metrics port answer
    capsys.readouterr()
    assert main(["status"]) == 0
    assert f"GetJob not asked for job {JOB}: its token variable {TOKEN_ENV}" in \
        capsys.readouterr().out


def test_a_wrong_tls_root_is_a_one_line_error(local_env, capsys, tmp_path):
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=other", "-keyout", str(tmp_path / "k.pem"), "-out",
                    str(other)], check=True, capture_output=True)
    err = _error(capsys, "--tls-ca", str(other), "--job", JOB)
    assert "cannot reach the service" in err and "--tls-ca" in err


def test_another_config_file_is_not_this_service(local_env, capsys, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"jobs": []}))
    err = _error(capsys, "--config", str(other))
    assert "no local service is running" in err and "give --endpoint" in err


def test_once_serve_stopped_status_says_nothing_runs(served, monkeypatch, capsys):
    """Last in this module: it stops the shared service."""
    proc, _, d = served
    assert proc.stop() == 0, proc.output()[-4000:]
    assert "stopped" in proc.output()
    assert not list((d / "state" / "services").glob("*.json"))  # its record is gone
    monkeypatch.setenv("ODB_STATE_DIR", str(d / "state"))
    err = _error(capsys)
    assert "no local service is running" in err and str(d / "state") in err
