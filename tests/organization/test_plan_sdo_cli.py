"""`odb-pipeline plan --data F --organization sdo`: real preprocessing, real model, real Ray.
The JSON adds locality (sdo vs none on the same data), exposure and the organization; --emit-plan
carries each epoch's visits, and the steps deliver every visit exactly once; a second run (in
this process) reads the embeddings from the cache and plans the same; bad settings are one
line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from pipeline.cli import main
from pipeline.sample_data import IMAGES_DIR, SAMPLE_CHATS

FIRST, ROWS = 50, 40  # row 53 has no assistant turn, row 89 is not valid UTF-8


@pytest.fixture
def chats(tmp_path):
    lines = SAMPLE_CHATS.read_bytes().split(b"\n")[FIRST:FIRST + ROWS]
    path = tmp_path / "chats40.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "images").symlink_to(IMAGES_DIR)
    return path


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", *argv], capture_output=True, text=True,
        timeout=300, env={**os.environ, "RAY_ADDRESS": ""})


def test_sdo_plan_reports_locality_exposure_and_emits_visits(chats, tmp_path, capsys,
                                                            ray_session, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # (both runs: env and here)
    out = tmp_path / "plan.jsonl"
    flags = ["--data", str(chats), "--world-size", "2", "--token-budget", "2048",
             "--organization", "sdo", "--epochs", "3", "--coverage-epochs", "2",
             "--locality", "1", "--knn-k", "4", "--json"]
    proc = _cli(*flags, "--emit-plan", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(proc.stdout)
    o = d["organization"]
    assert o["kind"] == "sdo" and o["graph"]["nodes"] == ROWS - 2 and o["graph"]["k"] == 4
    assert o["embedding"]["dim"] == 384 and not o["embedding"]["cached"]
    assert o["embedding"]["quarantined"]["by_reason"] == {"bad_utf8": 1, "missing_roles": 1}
    assert o["visits_per_epoch"] == ROWS - 2 and o["none"]["steps"] > 0
    loc = d["locality"]
    assert set(loc) >= {"sdo", "none", "random_pairs"}
    assert all(-1.0 <= loc[k] <= 1.0 for k in ("sdo", "none", "random_pairs"))
    ex = d["exposure"]
    assert ex["epochs"] == 3 and ex["min"] <= ex["p50"] <= ex["max"]
    assert ex["min"] >= 1 and ex["max_epochs_unseen"] <= 1  # floor: once in every 2 epochs
    assert d["budget_violations"] == 0 and 0 < d["padding_efficiency"] <= 1

    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    visits = {ln["epoch"]: ln["visits"] for ln in lines if "visits" in ln}
    assert sorted(visits) == [0, 1, 2]
    exposure: Counter = Counter()
    for epoch, vids in visits.items():
        assert len(vids) == ROWS - 2 and len(set(vids)) == len(vids)
        got = [v for ln in lines if ln.get("step") is not None and ln["epoch"] == epoch
               for b in ln["batches"] for v in b["samples"]]
        assert sorted(got) == sorted(vids), "every visit of the epoch exactly once"
        exposure.update(v.rpartition("#")[0] for v in vids)
    assert (min(exposure.values()), max(exposure.values())) == (ex["min"], ex["max"])
    assert d["emitted_samples"] == sum(len(v) for v in visits.values())

    # The second run in this process, on the test session's Ray (a second private Ray would
    # add its start-up, not coverage): it reads the embeddings from the first run's cache.
    capsys.readouterr()
    assert main(["plan", *flags]) == 0
    d2 = json.loads(capsys.readouterr().out)
    assert d2["organization"]["embedding"]["cached"]
    assert (d2["locality"], d2["exposure"], d2["steps"]) == (loc, ex, d["steps"])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--lengths", "L", "--organization", "sdo"], "--organization sdo needs --data"),
    (["--data", "D", "--organization", "sdo", "--knn-k", "0"], "--knn-k = 0"),
    (["--data", "D", "--organization", "sdo", "--locality", "2"], "--locality = 2.0"),
    (["--data", "D", "--organization", "sdo", "--embedding-model", "x",
      "--embedding-column", "c"], "one of model or column"),
])
def test_bad_organization_settings_are_one_line_exit_2(tmp_path, capsys, argv, needle):
    (tmp_path / "L").write_text("10\n20\n")
    (tmp_path / "D").write_text("{}\n")
    argv = [str(tmp_path / a) if a in ("L", "D") else a for a in argv]
    rc = main(["plan", *argv, "--world-size", "2", "--token-budget", "4096"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and needle in err, err
