"""`odb-pipeline serve`: config errors are one line; a real run serves and drains on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from service_helpers import consume_all

from pipeline import cli
from pipeline.coordinator import RedisJobState
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


def test_a_taken_metrics_port_is_a_one_line_error(tmp_path, capsys):
    path = _config(tmp_path)
    cfg = json.loads(path.read_text())
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        cfg["metrics_port"] = taken.getsockname()[1]
        path.write_text(json.dumps(cfg))
        assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{cfg['metrics_port']}: the port is in use" in err
    assert "ODB_METRICS_PORT" in err  # how to pick another one
    assert "Traceback" not in err
    assert not (tmp_path / "state").exists()  # refused before the embedded Redis started


def test_a_source_that_cannot_be_read_is_refused_before_anything_starts(
        tmp_path, capsys, monkeypatch):
    """#42: a misspelt path was found by the producer after `serve` said it listens. Checked at
    start: a missing path (named as resolved against the working directory, the usual
    mistake), a first row that does not parse; nothing started (no state dir)."""
    monkeypatch.chdir(tmp_path)
    path = _config(tmp_path)
    cfg = json.loads(path.read_text())
    cfg["jobs"][0]["source"]["paths"] = ["data/chat.jsonl"]
    path.write_text(json.dumps(cfg))
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert (f"job 'sft': source not found: data/chat.jsonl (relative to the working directory "
            f"{tmp_path}: {tmp_path / 'data' / 'chat.jsonl'})") in err, err
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text("\nrole,content\nuser,hi\n")  # a CSV
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "job 'sft': source data/chat.jsonl: the first row of data/chat.jsonl does not " \
           "parse as jsonl" in err, err
    # A mixture's source is named by its name and its field.
    (tmp_path / "data" / "ok.jsonl").write_text('{"messages": []}\n')
    cfg["jobs"][0]["source"] = {"mixture": [{"name": "a", "paths": ["data/ok.jsonl"]},
                                            {"name": "b", "paths": ["data/chat.jsonl"]}]}
    path.write_text(json.dumps(cfg))
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "job 'sft': source 'b': data/chat.jsonl: the first row of data/chat.jsonl does " \
           "not parse as jsonl" in err and "source.mixture[1].format" in err, err
    assert not (tmp_path / "state").exists()


def test_a_changed_config_names_its_fields_and_job_reset_starts_the_job_over(tmp_path, capsys):
    """#42: after an edit of token_budget, `serve` refused the job with two hashes and no way
    forward. It names the field and both values, where the embedded default keeps the job and
    the command that starts it over; `job reset` does (the next serve of the config takes the
    job as its own), `job delete` forgets it."""
    from pipeline.config import load_config
    from pipeline.coordinator import RedisJobState, list_jobs
    from pipeline.redis_client import connect
    from pipeline.redis_server import LocalRedis

    state = tmp_path / "state"
    path = _config(tmp_path, batching={"token_budget": 1024})
    with LocalRedis.durable(state) as r:  # as a serve of this config left it
        RedisJobState.connect(r.url, load_config(path).jobs[0]).close()
    cfg = json.loads(path.read_text())
    cfg["jobs"][0]["batching"]["token_budget"] = 2048
    path.write_text(json.dumps(cfg))
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "job 'sft' exists in Redis with another config: batching.token_budget (1024 in " \
           "Redis, 2048 here)" in err, err
    assert f"To start 'sft' over with this config (its state is in {state}): `odb-pipeline " \
           f"job reset sft --config {path}`" in err, err

    assert cli.main(["job", "reset", "sft", "--config", str(path)]) == 0
    assert f"job sft: reset in the embedded state in {state}" in capsys.readouterr().out
    with LocalRedis.durable(state) as r:
        again = RedisJobState.connect(r.url, load_config(path).jobs[0])  # no refusal now
        assert not again.created and again.published_through() == -1
        again.close()
    assert cli.main(["job", "delete", "sft", "--config", str(path)]) == 0
    assert cli.main(["job", "delete", "sft", "--config", str(path)]) == 2
    assert f"no job 'sft' in the embedded state in {state} (no jobs)" in capsys.readouterr().err
    with LocalRedis.durable(state) as r:
        assert list_jobs(connect(r.url)) == []


def test_job_delete_on_a_redis_url_refuses_a_job_in_use(redis_url, redis_client, capsys):
    from pipeline.config import parse_job
    from pipeline.coordinator import RedisJobState, list_jobs

    job = parse_job({"job_id": "sft", "world_size": 2, "source": {"paths": ["a.jsonl"]}})
    st = RedisJobState.connect(redis_url, job)
    st.claim_rank(1, "c1", 30.0)
    assert cli.main(["job", "delete", "sft", "--redis-url", redis_url]) == 2
    assert "job 'sft' in the Redis at" in capsys.readouterr().err
    st.release_rank(1, "c1")
    assert cli.main(["job", "delete", "sft", "--redis-url", redis_url]) == 0
    assert list_jobs(redis_client) == []
    st.close()


def test_a_grpc_port_held_by_another_server_is_refused_before_any_state_is_touched(
        redis_url, redis_client):
    """gRPC turns SO_REUSEPORT on by default: a second replica would have shared the port with
    the first (clients alternating between two services). It is refused, before the job is
    registered or a lease taken."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pipeline.config import ServiceConfig
    from pipeline.service.server import start_service

    first = grpc.server(ThreadPoolExecutor(1), options=[("grpc.so_reuseport", 1)])
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    try:
        cfg = ServiceConfig.model_validate({
            "redis_url": redis_url, "metrics_port": None, "grpc": {"port": port},
            "jobs": [{"job_id": "sft", "world_size": 1, "source": {"paths": [str(CHATS)]}}]})
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: the port is in "
                                          "use.*ODB_GRPC__PORT"):
            start_service(cfg)
        assert redis_client.keys("*") == []
    finally:
        first.stop(None)


@pytest.mark.parametrize(("settings", "named", "fix"), [
    ({"grpc": {"port": 0, "min_client_ping_interval_s": 5.0}}, "grpc.min_client_ping_interval_s",
     "at most 4"),
    ({"lease_seconds": 2.0}, "lease_seconds", "above 2"),
    ({"state_timeout_seconds": 8.0}, "state_timeout_seconds = 8", "below 8"),
])
def test_settings_the_trainers_clients_cannot_work_with_are_refused_at_start(
        tmp_path, capsys, settings, named, fix):
    """#40 item 13: pings the service would answer with GOAWAY, a lease that lapses between two
    heartbeats, a state bound the client's outage clock takes for a live call: refused before
    anything starts (no state dir, no Redis), naming the fields and the fix."""
    path = _config(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert named in err and fix in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "state").exists()


def assert_every_row_once(ids: list[str], data: Path, rows: int, state: RedisJobState) -> None:
    """`ids` (one epoch's deliveries) hold every row of `data` once but the quarantined ones:
    measured against the input, not the service's own counters (a producer that skipped rows
    would lower those too)."""
    every = {f"{data}:{row}" for row in range(rows)}
    bad = {q.sample_id for q in state.quarantine()}
    assert bad < every and len(bad) == state.counters().quarantined
    assert Counter(ids) == Counter(every - bad)


@pytest.mark.slow
def test_serve_streams_a_job_then_drains_on_sigterm(tmp_path, redis_url, redis_client):
    chats = tmp_path / "chats.jsonl"  # (its pictures are not copied: those rows are quarantined)
    chats.write_bytes(b"".join(CHATS.read_bytes().splitlines(keepends=True)[:40]))
    path = _config(tmp_path, batching={"token_budget": 8192})
    cfg = json.loads(path.read_text())
    cfg["jobs"][0]["source"]["paths"] = [str(chats)]
    path.write_text(json.dumps({**cfg, "redis_url": redis_url}))
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
        try:
            got = consume_all(f"127.0.0.1:{port}", "sft", 2)
        except Exception:
            print("SERVE LOG", "".join(lines)[-6000:], proc.poll())
            raise
        ids = [i for r in got for b in got[r] if not isinstance(b, EpochEndInfo)
               for i in b.info.sample_ids]
        assert_every_row_once(ids, chats, 40, RedisJobState.attach(redis_url, "sft"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
        assert any("stopped" in ln for ln in lines)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_serve_plans_the_first_steps_while_ray_starts_then_the_actor_takes_over(
        tmp_path, redis_url, redis_client):
    """Cold start (issue #15): the gRPC server listens before Ray is up and a bootstrap
    producer plans the first steps in the serve process, so the first batch does not wait for
    Ray; once Ray is up the job's producer actor takes the lease over at a publication boundary
    and the epoch is still delivered exactly once."""
    import time

    from pipeline.preprocess.pipeline import SampleStore
    from pipeline.sample_data.generate import generate
    from trainer_client import BatchStream

    # Far more rows than the few steps back-pressure lets the bootstrap plan ahead of ranks
    # that hold on after their first batches until the actor took over.
    data, rows = tmp_path / "chats.jsonl", 3000
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(rows, 2, mean_tokens=120,
                                                                    image_frac=0.0)))
    # A small balancing pool: the default one (128 steps at W=2) holds this whole epoch.
    path = _config(tmp_path, batching={"token_budget": 4096, "pool_steps": 4})
    cfg = json.loads(path.read_text())
    cfg["jobs"][0]["source"]["paths"] = [str(data)]
    path.write_text(json.dumps({**cfg, "redis_url": redis_url}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--config", str(path)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[tuple[float, str]] = []
    ready, handed_over = threading.Event(), threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
            if "listening on" in line:
                ready.set()
            if "producer actor takes over" in line:
                handed_over.set()

    threading.Thread(target=read, daemon=True).start()
    got: dict[int, list] = {0: [], 1: []}

    def rank(r: int) -> None:
        with BatchStream(address, "sft", r, 2) as s:
            for b in s:
                got[r].append((time.monotonic(), b))
                if len(got[r]) == 2:
                    handed_over.wait(120)

    try:
        assert ready.wait(180), "".join(ln for _, ln in lines)
        text = "".join(ln for _, ln in lines)
        port = re.search(r"listening on \S+:(\d+)", text).group(1)
        address = f"127.0.0.1:{port}"
        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        deadline = time.monotonic() + 120  # the bootstrap may plan the whole epoch first
        while not any("producer actor takes over" in ln for _, ln in lines):
            assert time.monotonic() < deadline, "".join(ln for _, ln in lines)[-3000:]
            time.sleep(0.2)
        log = "".join(ln for _, ln in lines)
        assert "planning in this process while Ray starts" in log, log[-3000:]
        took_over = next(t for t, ln in lines if "producer actor takes over" in ln)
        first = min(t for r in got for t, _ in got[r][:1])
        last = max(t for r in got for t, _ in got[r][-1:])
        # Batches from both producers, by construction rather than by Ray's speed: serve starts
        # Ray only once the bootstrap published its first step (no deadline races it), Ray runs
        # outside serve's process (deliveries are not stalled while it starts), and the actor
        # takes over only after Ray and the actor are up (seconds); the ranks hold after two
        # batches until it has, so later batches come after the takeover.
        assert first < took_over < last
        state = RedisJobState.attach(redis_url, "sft")
        lease = state.producer_lease()  # the actor's (released once it finished)
        assert state.is_done() and lease.holder.startswith("actor:") and lease.generation == 2
        assert state.error() is None
        assert_every_row_once([i for r in got for _, b in got[r] for i in b.info.sample_ids],
                              data, rows, state)
        # The same samples at every (epoch, step, rank) as a run on a fresh state in this
        # process: the bootstrap and the actor read one order (Guarantee 11).
        from support.reference_plan import assert_same_plan, reference_plan

        from pipeline.config import load_config

        plan = reference_plan(load_config(str(path)).jobs[0])
        assert assert_same_plan(plan, [(b.info.epoch, b.info.step, r, b.info.sample_ids)
                                       for r in got for _, b in got[r]]) == len(plan)
        # A batch the bootstrap planned holds exactly what Ray's preprocessing would give.
        _, b0 = got[0][0]
        sample = SampleStore(load_config(str(path)).jobs[0]).get(b0.info.sample_ids[0], 0)
        assert b0["input_ids"][0, : sample.num_tokens].tolist() == sample.input_ids.tolist()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
