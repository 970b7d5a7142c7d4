"""`odb-pipeline serve` with a refill job (embedded Redis, no Ray), consumed by `RefillStream`,
then `odb-pipeline status` shows its counters; SIGTERM drains."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

from refill_helpers import ROOT, chats_slice

from trainer_client import RefillStream


def test_serve_a_refill_job_and_see_it_in_status(tmp_path):
    src = chats_slice(tmp_path, 30)
    cfg = {"grpc": {"port": 0}, "state_dir": str(tmp_path / "state"), "metrics_port": None,
           "jobs": [{"job_id": "gen", "mode": "refill", "source": {"paths": [str(src)]},
                     "refill": {"generation_tokens": 64}}]}
    path = tmp_path / "odb.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--config",
                             str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "listening on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(120), "".join(lines)
        port = re.search(r"listening on \S+:(\d+)", "".join(lines)).group(1)  # type: ignore
        endpoint = f"127.0.0.1:{port}"
        n = 0
        with RefillStream(endpoint, "gen", consumer_id="cli") as s:
            held: list[str] = []
            while not s.exhausted:
                got = s.refill(4096, held)
                assert all(r.generation_tokens == 64 for r in got)
                held = [r.id for r in got]
                n += len(got)
        assert n > 0
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--endpoint",
                              endpoint, "--job", "gen", "--json"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        job = json.loads(out.stdout)["jobs"][0]
        assert job["mode"] == "refill" and job["state"] == "done"
        assert job["refill"]["completed"] == n and job["refill"]["in_flight"] == 0
        text = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--endpoint",
                               endpoint, "--job", "gen"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60).stdout
        assert f"refill: in_flight=0  completed={n}  readmitted=0" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
        assert not any("Ray" in ln and "start" in ln.lower() for ln in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
