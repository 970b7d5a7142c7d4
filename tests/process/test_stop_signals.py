"""`pipeline.stop_signals` in a process of its own: a first signal only asks for a stop; a
second one, or the grace running out, runs every fast-stop action (newest first) and exits 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The child: a stop that never finishes (sleeps), fast-stop actions that write what ran.
CHILD = """
import sys, time
from pipeline.stop_signals import StopSignals
out = open(sys.argv[2], "a")
stop = StopSignals(float(sys.argv[1])).install()
stop.on_fast_stop(lambda: (out.write("redis\\n"), out.flush()))
stop.on_fast_stop(lambda: (out.write("ray\\n"), out.flush()))
print("ready", flush=True)
stop.requested.wait()
print("stopping", flush=True)
time.sleep(60)  # an orderly stop that hangs
"""


def _child(tmp_path: Path, grace_s: float) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "fast_stops.txt"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(grace_s), str(log)], cwd=ROOT,
                            env={"PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc, log


def test_a_second_signal_is_a_fast_stop(tmp_path):
    proc, log = _child(tmp_path, grace_s=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "stopping\n"  # the first one only asked
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "a second SIGINT: stopping at once" in err
    assert log.read_text().split() == ["ray", "redis"]  # newest first: Redis last


def test_a_stop_past_its_grace_is_a_fast_stop(tmp_path):
    proc, log = _child(tmp_path, grace_s=0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and time.monotonic() - t0 < 20
    assert "the stop took over 0.5 s: stopping at once" in err
    assert log.read_text().split() == ["ray", "redis"]
