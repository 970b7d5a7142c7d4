"""Every shell command in README.md's code blocks runs as written, from the repository root, and
what the README says survives a restart of `serve` does. Beside the served README: a second
`serve` on its port is refused before it starts anything, and neither the README's commands nor
a benchmark write into the checkout.

Not run here: `make demo` and `make test` (CI runs both from a fresh clone; `make test` would also
run this file inside itself; the demo has its own tests in test_demo.py). A `serve` command is
started in the background and serves the commands after it, as the README says ("leave it
running"). The environment moves the service off the default ports and state dir (through the
`ODB_*` variables the config reads, and `PIPELINE_ENDPOINT` for the example trainer), so other
services on the machine cannot collide with it; the commands themselves are the README's text.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.process_tree import comm, descendants, process_state
from support.serve_process import REPO, ServeProcess

from pipeline.redis_server import free_port

README = REPO / "README.md"
NOT_RUN = {"make demo", "make test"}
SERVE = ".venv/bin/odb-pipeline serve"


def shell_commands(markdown: str) -> list[str]:
    """The commands of the ```bash blocks, continuation lines joined, in order."""
    out = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", markdown, re.M | re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        out += [line.strip() for line in text.splitlines() if line.strip()
                and not line.lstrip().startswith("#")]
    return out


def _strip_comment(cmd: str) -> str:
    return re.sub(r"\s+#.*$", "", cmd)


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """Runs the README's commands once; yields (results, env, the serve command and process)."""
    tmp = tmp_path_factory.mktemp("readme")
    port, metrics = free_port(), free_port()
    env = {**os.environ, "ODB_STATE_DIR": str(tmp / "state"), "ODB_GRPC__PORT": str(port),
           "ODB_METRICS_PORT": str(metrics), "PIPELINE_ENDPOINT": f"127.0.0.1:{port}",
           "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(tmp / "cache")}
    checkout = _porcelain()
    results: dict[str, subprocess.CompletedProcess] = {}
    serve: ServeProcess | None = None
    serve_cmd = None
    try:
        for cmd in shell_commands(README.read_text()):
            bare = _strip_comment(cmd)
            if bare in NOT_RUN:
                continue
            if bare.startswith(SERVE):
                assert serve is None, "the README starts the service twice"
                serve_cmd = bare
                t0 = time.monotonic()
                serve = ServeProcess(["bash", "-c", f"exec {bare}"], env).start()
                print(f"{time.monotonic() - t0:6.1f} s  {bare} (until listening)")
                continue
            t0 = time.monotonic()
            results[cmd] = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, text=True,
                                          capture_output=True, timeout=600)
            print(f"{time.monotonic() - t0:6.1f} s  {bare}")
        yield results, env, serve_cmd, serve, checkout
    finally:
        if serve is not None:
            serve.stop()


def test_the_readme_shows_the_commands_this_test_runs():
    cmds = [_strip_comment(c) for c in shell_commands(README.read_text())]
    assert set(cmds) >= NOT_RUN  # the two commands the README leads with, run by CI
    assert sum(c.startswith(SERVE) for c in cmds) == 1
    assert any(c.startswith(".venv/bin/odb-pipeline status") for c in cmds)


def _porcelain() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                          text=True, capture_output=True, check=True).stdout


def test_every_readme_command_runs_as_written(readme_run):
    results, _, _, serve, _ = readme_run
    for cmd, proc in results.items():
        assert proc.returncode == 0, f"{cmd}\nexit {proc.returncode}\n{proc.stderr[-3000:]}"
        if "--json" in cmd and "--watch" not in cmd:
            json.loads(proc.stdout)
    bare_status = next(p for c, p in results.items()
                       if _strip_comment(c) == ".venv/bin/odb-pipeline status")
    assert "job sft-1" in bare_status.stdout
    # Before any trainer: waiting (for the plan, or for ranks), no raw -1 for "no step yet".
    assert "state=waiting" in bare_status.stdout, bare_status.stdout
    assert not re.search(r"(?<![\w.])-1\b", bare_status.stdout), bare_status.stdout
    # The trainer ran both ranks to the job's end; status --json then shows every rank there.
    trainer = next(p for c, p in results.items() if "train_example.py" in c)
    assert "rank 0:" in trainer.stdout and "rank 1:" in trainer.stdout, trainer.stdout
    job = _job(next(p for c, p in results.items() if _strip_comment(c).endswith("status --json")))
    assert job["state"] == "finished"  # every rank acknowledged its last step
    assert all(r["acked_step"] >= 0 for r in job["ranks"]) and len(job["ranks"]) == 2
    watch = next(p for c, p in results.items() if "--watch" in c)
    assert watch.stdout.count("job sft-1") == 3
    assert serve.proc.poll() is None, serve.output()


def _job(proc: subprocess.CompletedProcess) -> dict:
    (job,) = [j for j in json.loads(proc.stdout)["jobs"] if j["job_id"] == "sft-1"]
    return job


def _status_json(env: dict[str, str]) -> dict:
    proc = subprocess.run(["bash", "-c", ".venv/bin/odb-pipeline status --json"], cwd=REPO,
                          env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return _job(proc)


def test_a_second_serve_is_refused_and_nothing_is_written_into_the_checkout(readme_run, tmp_path):
    """#42: a second `serve` (another state dir) shared the first one's gRPC port (SO_REUSEPORT),
    so clients alternated between two services. It is refused before it starts anything.
    Neither the README's commands nor a benchmark run write into the checkout: git sees what
    it saw before them."""
    _, env, serve_cmd, serve, checkout = readme_run
    other = tmp_path / "other-state"
    t0 = time.monotonic()
    second = subprocess.run(["bash", "-c", serve_cmd], cwd=REPO, text=True, capture_output=True,
                            env={**env, "ODB_STATE_DIR": str(other)}, timeout=120)
    print(f"{time.monotonic() - t0:6.1f} s  the second serve's refusal")
    assert second.returncode == 2, second.stdout + second.stderr
    port = env["ODB_GRPC__PORT"]
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in second.stderr
    assert not other.exists()  # refused before its embedded Redis (or anything) started
    assert serve.proc.poll() is None, serve.output()
    assert "job sft-1" in _status_text(env)  # the first one still answers on its port

    t0 = time.monotonic()
    bench = subprocess.run([".venv/bin/python", "bench/wire_bench.py", "--quick"], cwd=REPO,
                           env=env, text=True, capture_output=True, timeout=600)
    print(f"{time.monotonic() - t0:6.1f} s  bench/wire_bench.py --quick")
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert list(Path(env["XDG_CACHE_HOME"], "odb-pipeline", "bench", "wire").glob("*.json"))
    assert _porcelain() == checkout


def _status_text(env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", "-c", ".venv/bin/odb-pipeline status"], cwd=REPO, env=env,
                          text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_what_survives_a_kill_9_of_serve(readme_run):
    """README, "What survives a restart": kill -9 `serve` (its embedded Redis goes with it),
    start it again on the same state dir: the job is where it was and does not start over."""
    results, env, serve_cmd, serve, _ = readme_run
    before = _status_json(env)
    redis_pids = [p for p in descendants(serve.proc.pid) if "redis" in comm(p)
                  or "valkey" in comm(p)]
    assert redis_pids, "no embedded Redis under serve"
    serve.proc.send_signal(signal.SIGKILL)
    serve.proc.wait(30)
    deadline = time.monotonic() + 30
    while any(process_state(p) not in ("", "Z") for p in redis_pids):
        assert time.monotonic() < deadline, "the embedded Redis outlived its serve"
        time.sleep(0.05)
    again = ServeProcess(["bash", "-c", f"exec {serve_cmd}"], env).start()
    try:
        assert "embedded Redis with its state in" in again.output()
        again.wait_for_ray()
        after = _status_json(env)
        assert after["state"] == "finished"
        assert [r["acked_step"] for r in after["ranks"]] == \
            [r["acked_step"] for r in before["ranks"]]
        assert after["redis"]["published_through"] == before["redis"]["published_through"]
        # The finished job stays finished: the trainer gets no step at all.
        trainer_cmd = next(c for c in results if "train_example.py" in c)
        rerun = subprocess.run(["bash", "-c", trainer_cmd], cwd=REPO, env=env, text=True,
                               capture_output=True, timeout=600)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert re.findall(r"rank \d: (\d+) steps", rerun.stdout) == ["0", "0"], rerun.stdout
        assert rerun.stderr.count("the job has finished") == 2, rerun.stderr[-3000:]
    finally:
        assert again.stop() == 0, again.output()

