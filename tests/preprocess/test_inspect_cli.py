"""`odb-pipeline inspect`: JSON shape on the shipped dataset, one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline import cli
from pipeline.sample_data import SAMPLE_CHATS


def test_inspect_json_shape_on_shipped_sample(ray_session, capsys):
    # Ray is already up (ray_session): inspect reuses it instead of starting its own.
    rc = cli.main(["inspect", str(SAMPLE_CHATS), "--json", "--limit", "60"])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) == {"samples", "quarantined", "counts"}
    assert set(doc["samples"][0]) >= {"sample_id", "row", "num_tokens", "num_visual_tokens",
                                      "cost"}
    assert [q["reason"] for q in doc["quarantined"]] == ["bad_json", "missing_roles"]
    assert [q["row"] for q in doc["quarantined"]] == [17, 53]
    rows = sorted([s["row"] for s in doc["samples"]] + [q["row"] for q in doc["quarantined"]])
    assert rows == list(range(60))
    c = doc["counts"]
    assert c["rows"] == 60 and c["samples"] == 58 and c["quarantined"] == 2
    assert c["quarantined_by_reason"] == {"bad_json": 1, "missing_roles": 1}
    assert c["num_tokens"] == sum(s["num_tokens"] for s in doc["samples"])
    assert any(s["num_visual_tokens"] > 0 for s in doc["samples"])


def test_inspect_missing_file_is_one_line_exit_2(tmp_path, capsys):
    rc = cli.main(["inspect", str(tmp_path / "missing.jsonl"), "--json"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and "source not found" in err


def test_inspect_bad_config_is_one_line_exit_2(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("preprocess:\n  max_seq_len: -1\n")
    rc = cli.main(["inspect", str(SAMPLE_CHATS), "--config", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2 and "preprocess.max_seq_len" in err and err.strip().count("\n") == 0


@pytest.mark.slow
def test_inspect_subprocess_private_ray_pure_json_stdout():
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "inspect", str(SAMPLE_CHATS), "--json",
         "--limit", "5"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["counts"]["rows"] == 5
