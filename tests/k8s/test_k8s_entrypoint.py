"""The container entry point (deploy/docker/entrypoint.sh) turns `serve` into
`odb-pipeline serve --config FILE` with FILE from the ConfigMap mount or PIPELINE_CONFIG_FILE,
and passes other commands through. Run here with stub odb-pipeline/torchrun on PATH."""

from __future__ import annotations

import os
import subprocess

import pytest
from k8s_support import REPO

ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"


@pytest.fixture
def run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("odb-pipeline", "torchrun"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\necho {tool} "$@"\n')
        stub.chmod(0o755)

    def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
        full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
        return subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True,
                              env=full_env, timeout=30)

    return _run


def test_serve_reads_the_config_file_from_env(run, tmp_path):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("jobs: []\n")
    out = run("serve", "--log-level", "DEBUG", PIPELINE_CONFIG_FILE=str(cfg))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["odb-pipeline", "serve", "--config", str(cfg),
                                  "--log-level", "DEBUG"]


def test_explicit_config_is_passed_through(run):
    out = run("serve", "--config", "/elsewhere.yaml")
    assert out.stdout.split() == ["odb-pipeline", "serve", "--config", "/elsewhere.yaml"]


def test_missing_config_file_is_a_clear_error(run, tmp_path):
    out = run("serve", PIPELINE_CONFIG_FILE=str(tmp_path / "nope.yaml"))
    assert out.returncode == 2
    assert "nope.yaml not found" in out.stderr


def test_other_commands(run):
    assert run("status", "--json").stdout.split() == ["odb-pipeline", "status", "--json"]
    assert run("train", "--nnodes=2", "x.py").stdout.split() == ["torchrun", "--nnodes=2",
                                                                 "x.py"]
    assert run("echo", "hi").stdout.strip() == "hi"
