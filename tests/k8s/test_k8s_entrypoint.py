"""The container entry point (deploy/docker/entrypoint.sh) turns `serve` into
`odb-pipeline serve --config FILE` with FILE from the ConfigMap mount or PIPELINE_CONFIG_FILE,
first joining the Ray cluster as a node when RAY_JOIN_ADDRESS is set, and passes other commands
through. Run here with stub odb-pipeline/torchrun/ray on PATH."""

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
    # `ray start` fails $RAY_STUB_FAILS times (counted in a file), then succeeds.
    ray = bin_dir / "ray"
    ray.write_text('#!/bin/bash\nn=$(cat "$RAY_STUB_COUNT" 2>/dev/null || echo 0)\n'
                   'echo $((n + 1)) > "$RAY_STUB_COUNT"\n'
                   '[ "$n" -lt "${RAY_STUB_FAILS:-0}" ] && { echo "no GCS" >&2; exit 1; }\n'
                   'echo ray "$@"\n')
    ray.chmod(0o755)

    def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
        full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}",
                    "RAY_STUB_COUNT": str(tmp_path / "ray-calls"), **env}
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


def test_serve_joins_the_ray_cluster_first_when_asked(run, tmp_path):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("jobs: []\n")
    out = run("serve", PIPELINE_CONFIG_FILE=str(cfg), RAY_JOIN_ADDRESS="head:6379",
              RAY_START_ARGS="--num-cpus=0 --node-manager-port=6380", RAY_STUB_FAILS="2",
              RAY_JOIN_RETRY_SECONDS="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "ray start --address=head:6379 --num-cpus=0 --node-manager-port=6380 "
        "--disable-usage-stats",
        f"odb-pipeline serve --config {cfg}"]
    assert (tmp_path / "ray-calls").read_text().strip() == "3"  # retried while the head starts


def test_serve_gives_up_when_ray_never_answers(run, tmp_path):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("jobs: []\n")
    out = run("serve", PIPELINE_CONFIG_FILE=str(cfg), RAY_JOIN_ADDRESS="head:6379",
              RAY_STUB_FAILS="99", RAY_JOIN_TRIES="3", RAY_JOIN_RETRY_SECONDS="0")
    assert out.returncode == 3
    assert "could not join the Ray cluster at head:6379 (3 tries)" in out.stderr
    assert "odb-pipeline serve" not in out.stdout


def test_without_ray_join_serve_starts_no_ray_node(run, tmp_path):
    out = run("serve", "--config", "/x.yaml")
    assert not (tmp_path / "ray-calls").exists()
    assert out.stdout.split() == ["odb-pipeline", "serve", "--config", "/x.yaml"]
