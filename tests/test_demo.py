"""`odb-pipeline demo` end to end at a small size: real Redis, Ray, gRPC and 2 gloo DDP ranks;
Ctrl-C at start-up and mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.process_tree import cmdline, comm, descendants, process_state
from support.waiting import wait_for

from pipeline.demo.report import figure
from pipeline.sample_data import sample_chats_path

ROWS = 90
RANK_MODULE = "pipeline.demo.train_rank"


def _small_dataset(tmp_path: Path) -> Path:
    # Bytes: the shipped data holds a deliberately non-UTF-8 record.
    lines = Path(sample_chats_path()).read_bytes().splitlines(keepends=True)[:ROWS]
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b"".join(lines))
    return path


def _demo(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "demo", "--data", str(_small_dataset(tmp_path)),
            "--out", str(tmp_path / "out"), "--token-budget", "4096", *extra]


def _env(tmp_path: Path) -> dict[str, str]:
    # A state dir of its own: the demo records itself there for `odb-pipeline status`.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "ODB_STATE_DIR": str(tmp_path / "state")}


def test_demo_trains_every_sample_exactly_once(tmp_path):
    proc = subprocess.run(_demo(tmp_path, "--json", "--standard"), capture_output=True,
                          text=True, timeout=600, env=_env(tmp_path))
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
    # The progress names every phase, in order.
    phases = ["demo: starting Redis", "demo: starting Ray", "demo: starting the service",
              "preprocessing (odb)", "training (odb)", "preprocessing for fixed-size batches",
              "training (standard", "demo: writing the report"]
    at = [proc.stderr.find(p) for p in phases]
    assert -1 not in at and at == sorted(at), dict(zip(phases, at, strict=True))
    assert f"{ROWS}/{ROWS}" in proc.stderr  # the preprocessing bar ends at every row
    # The service's record for `status` is gone with the demo.
    assert not list((tmp_path / "state" / "services").glob("*.json"))


def test_demo_plot_compares_with_standard_on_integer_steps(tmp_path):
    # Rank logs of two short runs, as train_rank writes them.
    runs = {}
    for name, steps in (("odb", 3), ("standard", 5)):
        logs = tmp_path / name
        logs.mkdir()
        for rank in range(2):
            rows = [{"step": s, "sample_ids": [f"x:{rank}{s}"], "real_tokens": 50 + s,
                     "padded_tokens": 64, "t": 10.0 + s, "wait_s": 0.1, "compute_s": 0.2,
                     "loss": 1.0} for s in range(steps)]
            (logs / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[name] = {"logs": logs, "batch_size": 4}
    fig = figure(runs)
    fig.canvas.draw()
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 6
    assert "odb-pipeline vs standard: samples trained" in titles
    assert "odb-pipeline vs standard: padding efficiency per step" in titles
    compare = fig.axes[titles.index("odb-pipeline vs standard: padding efficiency per step")]
    assert [line.get_label() for line in compare.get_lines()] == ["odb-pipeline",
                                                                   "standard (B=4)"]
    for ax in fig.axes:
        if ax.get_xlabel() == "step":
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    assert len(figure({"odb": runs["odb"]}).axes) == 2  # no comparison without --standard


# --- Ctrl-C ------------------------------------------------------------------------------------

def _running(pids: set[int]) -> set[int]:
    return {p for p in pids if process_state(p) not in ("", "Z")}


def _interrupt_and_check(proc: subprocess.Popen, kids: set[int],
                         group_sigterm: bool = False) -> str:
    """SIGINT the demo (or SIGTERM its whole process group): it exits 130 (interrupted) and
    everything it started is gone."""
    if group_sigterm:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"demo exited {proc.returncode} after the signal\n{err[-3000:]}"
    assert "interrupted" in err
    # Orphans are reaped by init; wait for that with a deadline, then name any survivor.
    try:
        wait_for(lambda: not _running(kids), 30, "the demo's processes to end")
    except AssertionError:
        alive = {p: cmdline(p)[:120] for p in _running(kids)}
        raise AssertionError(f"left running after Ctrl-C: {alive}\n{err[-2000:]}") from None
    return err


def _start_with_frozen_ranks(run_dir: Path) -> tuple[subprocess.Popen, set[int]] | None:
    """Start the demo and freeze (SIGSTOP) its trainer ranks the moment both exist; None when a
    rank ended before it could be frozen (the run then is killed)."""
    proc = subprocess.Popen(_demo(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(run_dir))
    try:
        kids: set[int] = set()
        ranks: list[int] = []

        def ranks_started() -> bool:
            kids.update(set(descendants(proc.pid)))
            ranks[:] = [k for k in kids if RANK_MODULE in cmdline(k)]
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            return len(ranks) == 2

        wait_for(ranks_started, 300, "the demo's trainer ranks")
        for r in ranks:
            os.kill(r, signal.SIGSTOP)
        # The stop takes effect when the kernel next runs the rank: wait for it to show.
        states = lambda: [process_state(r) or "Z" for r in ranks]  # noqa: E731
        wait_for(lambda: all(st in "TZX" for st in states()), 30, "the ranks to stop")
        if all(st == "T" for st in states()):
            return proc, kids
    except BaseException:
        proc.kill()
        raise
    proc.kill()
    proc.communicate()
    return None


def test_ctrl_c_stops_everything_the_demo_started(tmp_path):
    """Mid-run: the trainer ranks are frozen (SIGSTOP) the moment they exist, so the demo cannot
    finish before the SIGINT lands (under load a 90-row demo can end in the time a poll takes,
    which once made this test see exit 0). While frozen, `odb-pipeline status` finds the demo."""
    for attempt in range(3):  # a rank that ended before it was frozen: the end is unknown, rerun
        run_dir = tmp_path / f"run{attempt}"
        run_dir.mkdir()
        started = _start_with_frozen_ranks(run_dir)
        if started is not None:
            break
    else:
        pytest.fail("the trainer ranks always ended before they could be frozen")
    proc, kids = started
    try:
        comms = {comm(k) for k in kids}
        assert comms & {"redis-server", "valkey-server"}, comms
        assert {"gcs_server", "raylet"} <= comms, comms

        status = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--json"],
                                capture_output=True, text=True, timeout=60, env=_env(run_dir))
        assert status.returncode == 0, status.stderr
        out = json.loads(status.stdout)
        assert out["sources"]["local_service"].startswith(f"demo (pid {proc.pid}")
        assert [j["job_id"] for j in out["jobs"]] == ["demo"]
        assert out["jobs"][0]["world_size"] == 2
        # Its token lives only in the demo's process: GetJob is skipped, saying why.
        assert "ODB_DEMO_TOKEN" in out["sources"]["grpc_skipped"]["demo"]

        _interrupt_and_check(proc, kids | set(descendants(proc.pid)))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list((run_dir / "state" / "services").glob("*.json"))


@pytest.mark.parametrize("group_sigterm", [False, True], ids=["sigint", "group-sigterm"])
def test_ctrl_c_during_start_up_stops_everything(tmp_path, group_sigterm):
    """SIGINT, or SIGTERM to the demo's whole process group (its Redis and Ray run in sessions
    of their own, so the demo stops them itself), while Ray starts (its GCS is up, the rest may
    not be): nothing survives either."""
    proc = subprocess.Popen(_demo(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(tmp_path), start_new_session=True)
    try:
        kids: set[int] = set()

        def gcs_started() -> bool:
            kids.update(set(descendants(proc.pid)))
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            return any(comm(k) == "gcs_server" for k in kids)

        wait_for(gcs_started, 300, "Ray's GCS")
        _interrupt_and_check(proc, kids | set(descendants(proc.pid)), group_sigterm)
    finally:
        if proc.poll() is None:
            proc.kill()
