"""`odb-pipeline demo` end to end at a small size: real Redis, Ray, gRPC and 2 gloo DDP ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.sample_data import sample_chats_path

ROWS = 90


def _small_dataset(tmp_path: Path) -> Path:
    # Bytes: the shipped data holds a deliberately non-UTF-8 record.
    lines = Path(sample_chats_path()).read_bytes().splitlines(keepends=True)[:ROWS]
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b"".join(lines))
    return path


def _demo(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "demo", "--data", str(_small_dataset(tmp_path)),
            "--out", str(tmp_path / "out"), "--token-budget", "4096", *extra]


def test_demo_trains_every_sample_exactly_once(tmp_path):
    proc = subprocess.run(_demo(tmp_path, "--json", "--standard"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    odb = report["runs"]["odb"]
    assert report["coverage_ok"] is True
    assert odb["duplicates"] == 0
    # Every source row is either trained on exactly once or quarantined with its reason.
    assert odb["unique_samples"] + odb["quarantined"] == ROWS
    assert all(":" in q for q in report["quarantine"])
    assert odb["padding_efficiency"] > 0.8
    assert len(odb["steps_per_rank"]) == 2
    std = report["runs"]["standard"]
    assert std["samples"] >= odb["unique_samples"]  # DistributedSampler-style padding repeats
    out = tmp_path / "out"
    assert (out / "demo.png").stat().st_size > 10_000
    assert "identity coverage: PASS" in (out / "summary.txt").read_text()


def _children(pid: int) -> set[int]:
    kids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry.name))
    return kids


def test_ctrl_c_stops_everything_the_demo_started(tmp_path):
    proc = subprocess.Popen(_demo(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        kids: set[int] = set()
        while time.monotonic() < deadline:
            kids |= _children(proc.pid)
            if (tmp_path / "out" / "odb" / "rank1.jsonl").exists():
                break
            time.sleep(0.2)
        else:
            raise AssertionError("demo never started its trainer ranks")
        kids |= _children(proc.pid)
        assert len(kids) >= 3  # redis-server, Ray, trainer ranks
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        time.sleep(1.0)
        alive = {k for k in kids if Path(f"/proc/{k}").exists()
                 and "zombie" not in Path(f"/proc/{k}/status").read_text()}
        assert not alive, f"left running after Ctrl-C: {alive}\n{err[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
