"""`odb-pipeline plan --data`: the real preprocessing feeds the planner the served order (the plan
is the service's plan of the same job); --export-lengths
round-trips through --lengths; --config job settings are defaults that flags override; input
errors are one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.reference_plan import reference_plan

from pipeline.cli import main
from pipeline.planner.policy import LOOKAHEAD_BUDGETS, MAX_WINDOW_SAMPLES
from pipeline.sample_data import IMAGES_DIR, SAMPLE_CHATS

KEYS = {
    "samples", "emitted_samples", "steps", "padding_efficiency", "budget_violations",
    "over_budget_samples", "per_rank_steps", "rank_balance_p50", "rank_balance_p95",
    "carried_over", "mode", "world_size", "token_budget", "lookahead_tokens",
    "max_window_samples", "collate",
}
# Rows 50..89 of the shipped data: row 53 has no assistant turn, row 89 is not valid UTF-8.
FIRST, ROWS = 50, 40


@pytest.fixture
def chats_slice(tmp_path):
    lines = SAMPLE_CHATS.read_bytes().split(b"\n")[FIRST:FIRST + ROWS]
    path = tmp_path / "chats40.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "images").symlink_to(IMAGES_DIR)  # image refs are relative to the file
    return path


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", *argv], capture_output=True, text=True,
        timeout=180, env={**os.environ, "RAY_ADDRESS": ""},  # a private Ray, as a user gets
    )


def test_plan_data_reports_quarantine_and_exports_lengths(chats_slice, tmp_path):
    """Run as `plan --config FILE`: the job's own source is what is preprocessed (#42; `--data`
    replaces it: the README runs that)."""
    lengths = tmp_path / "lengths.jsonl"
    steps_out = tmp_path / "plan.jsonl"
    config = tmp_path / "odb.yaml"
    config.write_text(f"jobs:\n  - {{job_id: j, world_size: 2, source: {{paths: [{chats_slice}]}},"
                      "\n     batching: {token_budget: 4096}}\n")
    proc = _cli("--config", str(config), "--json", "--export-lengths", str(lengths),
                "--emit-plan", str(steps_out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert d.keys() >= KEYS | {"quarantined_records", "preprocess_epochs", "rows"}
    assert d["data"] == [str(chats_slice)]
    # Progress on stderr; preprocessing (Ray's start included) is not counted as planning.
    assert "odb-pipeline plan: starting a private Ray" in proc.stderr
    assert f"odb-pipeline plan: preprocessing {chats_slice}" in proc.stderr
    assert d["preprocess_seconds"] >= d["ray_start_seconds"] > 0
    assert 0 < d["planning_seconds"] < d["preprocess_seconds"]
    q = d["quarantined_records"]
    assert q["by_reason"] == {"bad_utf8": 1, "missing_roles": 1}
    assert q["total"] == 2 and sum(q["by_reason"].values()) == 2
    assert {e["sample_id"] for e in q["examples"]} == {f"{chats_slice}:3", f"{chats_slice}:39"}
    assert d["samples"] + q["total"] == ROWS == d["rows"]
    assert d["emitted_samples"] == d["samples"] and d["budget_violations"] == 0
    assert d["world_size"] == 2 and d["token_budget"] == 4096 and len(d["per_rank_steps"]) == 2

    exported = [json.loads(ln) for ln in lengths.read_text().splitlines()]
    assert len(exported) == d["samples"]
    assert all(set(e) == {"sample_id", "num_tokens", "num_visual_tokens"} for e in exported)
    assert any(e["num_visual_tokens"] > 0 for e in exported)
    ids = [b_id for ln in steps_out.read_text().splitlines()
           for b in json.loads(ln)["batches"] for b_id in b["samples"]]
    assert sorted(ids) == sorted(e["sample_id"] for e in exported)  # real string ids, once each
    # The plan is the one the service makes of the same job: its order, shuffled by default.
    served = reference_plan({"job_id": "plan", "world_size": 2, "source": {"paths": [
        str(chats_slice)]}, "batching": {"token_budget": 4096}})
    planned = {(s["epoch"], s["step"], b["rank"]): b["samples"] for s in map(
        json.loads, steps_out.read_text().splitlines()) for b in s["batches"]}
    assert planned == served

    again = _cli("--lengths", str(lengths), "--world-size", "2", "--token-budget", "4096",
                 "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    r = json.loads(again.stdout)
    assert (r["steps"], r["padding_efficiency"], r["per_rank_steps"]) == (
        d["steps"], d["padding_efficiency"], d["per_rank_steps"])


def test_plan_of_a_mixture_job_is_the_services_plan(chats_slice, tmp_path):
    """`plan --config` of a mixture job (one source repeated): the service's plan, the share
    of each source kept by the planner as the producer keeps it."""
    other = tmp_path / "other.jsonl"
    other.write_bytes(b"\n".join(SAMPLE_CHATS.read_bytes().split(b"\n")[:20]) + b"\n")
    job = {"job_id": "mixed", "world_size": 2, "batching": {"token_budget": 4096},
           "source": {"mixture": [{"name": "a", "paths": [str(chats_slice)]},
                                  {"name": "b", "paths": [str(other)], "repeat": 2}]}}
    cfg = tmp_path / "svc.json"
    cfg.write_text(json.dumps({"jobs": [job]}))
    steps_out = tmp_path / "plan.jsonl"
    proc = _cli("--config", str(cfg), "--emit-plan", str(steps_out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["samples"] + d["quarantined_records"]["total"] == ROWS + 2 * 20  # b twice
    planned = {(s["epoch"], s["step"], b["rank"]): b["samples"] for s in map(
        json.loads, steps_out.read_text().splitlines()) for b in s["batches"]}
    assert planned == reference_plan(job)


def test_config_job_gives_defaults_flags_override(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(100 + 7 * i) for i in range(200)) + "\n")
    cfg = tmp_path / "svc.yaml"
    cfg.write_text(
        "jobs:\n"
        "  - {job_id: a, world_size: 3, source: {paths: [x.jsonl]}}\n"
        "  - job_id: b\n"
        "    world_size: 4\n"
        "    mode: quota\n"
        "    source: {paths: [x.jsonl]}\n"
        "    batching: {token_budget: 2048, collate: packed, max_window_samples: 64,\n"
        "               lookahead_tokens: 4096}\n"
    )
    assert main(["plan", "--lengths", str(lengths), "--config", str(cfg), "--job", "b",
                 "--max-window-samples", "32", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["world_size"], d["mode"], d["token_budget"], d["collate"], d["max_window_samples"],
            d["lookahead_tokens"]) == (4, "quota", 2048, "packed", 32, 4096)
    assert main(["plan", "--lengths", str(lengths), "--config", str(cfg), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)  # first job; TrainingJobConfig's own batching defaults
    assert (d["world_size"], d["token_budget"], d["max_window_samples"], d["lookahead_tokens"]) \
        == (3, 16384, MAX_WINDOW_SAMPLES, LOOKAHEAD_BUDGETS * 16384)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--lengths", "L", "--data", "D"], "mutually exclusive"),
        ([], "one of --lengths FILE, --data FILE or --config FILE (its job's source) is "
             "required"),
        (["--data", "{missing}"], "source not found"),
        (["--lengths", "{missing}"], "lengths file not found"),
        (["--lengths", "L", "--export-lengths", "x.jsonl"], "--export-lengths needs --data"),
        (["--data", "D", "--job", "j"], "--job needs --config"),
    ],
)
def test_input_errors_are_one_line_exit_2(tmp_path, capsys, argv, needle):
    argv = [a.replace("{missing}", str(tmp_path / "missing.jsonl")) for a in argv]
    rc = main(["plan", *argv, "--world-size", "2", "--token-budget", "4096"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and needle in err, err


def test_world_size_required_without_config(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n20\n")
    rc = main(["plan", "--lengths", str(lengths), "--token-budget", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "--world-size is required" in err and err.strip().count("\n") == 0
