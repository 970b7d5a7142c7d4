"""`odb-pipeline serve`: config errors are one line; a real run serves and drains on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from service_helpers import consume_all

from pipeline import cli
from trainer_client import EpochEndInfo

ROOT = Path(__file__).resolve().parents[2]
CHATS = ROOT / "pipeline" / "sample_data" / "chats.jsonl"


def _config(tmp_path: Path, **job) -> Path:
    cfg = {"grpc": {"port": 0}, "ray": {"num_cpus": 1, "object_store_mb": 128},
           "state_dir": str(tmp_path / "state"), "metrics_port": None,
           "jobs": [{"job_id": "sft", "world_size": 2, "source": {"paths": [str(CHATS)]},
                     **job}]}
    path = tmp_path / "odb.json"
    path.write_text(json.dumps(cfg))
    return path


def test_serve_without_jobs_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"jobs": []}))
    assert cli.main(["serve", "--config", str(path)]) == 2
    assert "no jobs configured" in capsys.readouterr().err


def test_serve_names_a_missing_token_variable(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ODB_TEST_MISSING_TOKEN", raising=False)
    path = _config(tmp_path, token_env="ODB_TEST_MISSING_TOKEN")
    assert cli.main(["serve", "--config", str(path)]) == 2
    assert "ODB_TEST_MISSING_TOKEN is unset or empty" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_streams_a_job_then_drains_on_sigterm(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_bytes(b"".join(CHATS.read_bytes().splitlines(keepends=True)[:40]))
    path = _config(tmp_path, batching={"token_budget": 8192})
    cfg = json.loads(path.read_text())
    cfg["jobs"][0]["source"]["paths"] = [str(chats)]
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--config", str(path)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180), "".join(lines)
        port = re.search(r"listening on \S+:(\d+)", "".join(lines)).group(1)
        got = consume_all(f"127.0.0.1:{port}", "sft", 2)
        n = sum(len(b.info.sample_ids) for r in got for b in got[r]
                if not isinstance(b, EpochEndInfo))
        assert n > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
        assert any("stopped" in ln for ln in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
