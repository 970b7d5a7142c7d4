"""`odb-pipeline serve` with a refill job (embedded Redis, no Ray), consumed by `RefillStream`:
the job is on every status path (`status --config` text and JSON, `--job`, `/status.json`, the
status page, `/metrics`, the Redis registry); SIGTERM drains."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from refill_helpers import ROOT, chats_slice

from trainer_client import RefillStream

JOB = "rf-1"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def test_serve_a_refill_job_and_see_it_on_every_status_path(tmp_path):
    src = chats_slice(tmp_path, 30)
    cfg = {"grpc": {"port": 0}, "state_dir": str(tmp_path / "state"), "metrics_port": 0,
           "jobs": [{"job_id": JOB, "mode": "refill", "source": {"paths": [str(src)]},
                     "refill": {"generation_tokens": 64, "lease_seconds": 300}}]}
    path = tmp_path / "odb.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ODB_STATE_DIR", None)
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

    def status(*argv: str) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--config",
                              str(path), *argv], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(120), "".join(lines)
        started = "".join(lines)
        port = re.search(r"listening on \S+:(\d+)", started).group(1)  # type: ignore[union-attr]
        mport = re.search(r"metrics on :(\d+)", started).group(1)  # type: ignore[union-attr]
        n = 0
        with RefillStream(f"127.0.0.1:{port}", JOB, consumer_id="cli") as s:
            held: list[str] = []
            while not s.exhausted:
                got = s.refill(4096, held)
                assert all(r.generation_tokens == 64 for r in got)
                held = [r.id for r in got]
                n += len(got)
        assert n > 0
        # The local service, found from its config: the job is listed (it was "no jobs").
        job = json.loads(status("--json").stdout)["jobs"][0]
        assert (job["job_id"], job["mode"], job["state"], job["open"]) == (JOB, "refill", "done",
                                                                           True)
        rf = job["refill"]
        assert (rf["completed"], rf["in_flight"], rf["waiting"], rf["enqueued"]) == (n, 0, 0, n)
        assert rf["admitted"] == n and rf["lease_lapses"] == 0 and rf["exhausted"]
        assert rf["rates"]["admissions_per_s"] > 0 and job["ranks"] is None
        assert job["redis"] is None  # a refill job has no plan to retain
        # --job finds it (it was "unknown job"); the text has no rank table.
        text = status("--job", JOB).stdout
        assert f"refill: in_flight=0  completed={n}  readmitted=0" in text
        assert "admissions/s" in text and "OPEN (served without a credential)" in text
        assert "delivered*" not in text and "rank " not in text
        # The metrics port: /status.json, the page and Prometheus.
        base = f"http://127.0.0.1:{mport}"
        (one,) = json.loads(_get(f"{base}/status.json?job={JOB}"))["jobs"]
        assert one["refill"]["completed"] == n
        assert f'<table class="refill" data-job="{JOB}">' in _get(f"{base}/status")
        fams = {f.name: f for f in text_string_to_metric_families(_get(f"{base}/metrics"))}

        def value(family: str) -> float:
            (sample,) = [x for x in fams[family].samples if x.labels.get("job_id") == JOB
                         and not x.name.endswith("_created")]
            return sample.value

        assert value("odb_refill_completed") == value("odb_refill_admitted") == n
        assert value("odb_refill_enqueued") == n
        assert (value("odb_refill_waiting"), value("odb_refill_in_flight")) == (0, 0)
        assert value("odb_refill_consumers") == 1  # its lease outlives the asks
        assert value("odb_refill_lease_lapses") == value("odb_refill_readmitted") == 0
        assert value("odb_job_info") == 1 and value("odb_job_open") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
        assert not any("Ray" in ln and "start" in ln.lower() for ln in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
