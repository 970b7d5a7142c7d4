"""`odb-pipeline plan`: exit codes, JSON keys, emit-plan format, error messages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main

REPO = Path(__file__).resolve().parents[2]
KEYS = {
    "samples",
    "steps",
    "padding_efficiency",
    "budget_violations",
    "over_budget_samples",
    "per_rank_steps",
    "rank_balance_p50",
    "rank_balance_p95",
    "carried_over",
    "filler_batches",
    "lookahead_tokens",
    "max_window_samples",
}


@pytest.fixture
def lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.5, 0.6, 3000).round(), 16, 8192).astype(int)
    lengths[17] = 20000  # one over the budget
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, lengths)) + "\n")
    return p


def run_json(capsys, *argv):
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    return json.loads(out)


def test_json_report(capsys, lengths_file):
    d = run_json(
        capsys, "--lengths", str(lengths_file), "--world-size", "4", "--token-budget", "16384"
    )
    assert d.keys() >= KEYS
    assert d["samples"] == 3000 and d["emitted_samples"] == 3000
    assert d["budget_violations"] == 0 and d["over_budget_samples"] == 1
    assert len(d["per_rank_steps"]) == 4
    assert d["padding_efficiency"] > 0.95
    assert 1.0 <= d["rank_balance_p50"] <= d["rank_balance_p95"]


def test_quota_multi_epoch_and_policies(capsys, lengths_file):
    d = run_json(
        capsys,
        *("--lengths", str(lengths_file), "--world-size", "8", "--token-budget", "16384"),
        *("--mode", "quota", "--epochs", "3", "--over-budget", "quarantine", "--shuffle"),
        *("--collate", "packed", "--max-window-samples", "256", "--attn-b", "0.0001"),
        *("--pool-steps", "3"),
    )
    assert d["epochs"] == 3 and len(set(d["per_rank_steps"])) == 1
    assert d["quarantined"] == 3 and d["over_budget_samples"] == 3
    # Quota, last epoch: nothing is carried out of the job; every sample of every epoch is
    # emitted (the closing step's fillers, if any, are not counted).
    assert d["carried_over"] == 0 and d["emitted_samples"] == 3 * (3000 - 1)
    assert d["padding_efficiency"] == 1.0  # packed: no padding


def test_emit_plan_format(capsys, tmp_path, lengths_file):
    out = tmp_path / "plan.jsonl"
    argv = ["--lengths", str(lengths_file), "--world-size", "3", "--token-budget", "16384"]
    d = run_json(capsys, *argv, "--emit-plan", str(out), "--over-budget", "truncate")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == d["steps"]
    seen = []
    for i, step in enumerate(lines):
        assert set(step) == {"epoch", "step", "batches"}
        assert step["step"] == i and step["epoch"] == 0
        ranks = [b["rank"] for b in step["batches"]]
        assert ranks == sorted(set(ranks)) and all(0 <= r < 3 for r in ranks)
        for b in step["batches"]:
            assert {"rank", "samples", "cost"} <= set(b)
            assert b["cost"] <= 16384
            seen.extend(b["samples"])
    assert sorted(seen) == list(range(3000))
    truncated = [b for s in lines for b in s["batches"] if "truncated_to" in b]
    assert truncated == [
        {
            "rank": truncated[0]["rank"],
            "samples": [17],
            "cost": 16384,
            "over_budget": True,
            "truncated_to": {"17": 16384},
        }
    ]


def test_defaults_are_the_services(capsys, lengths_file):
    """Without --config, `plan` uses the job config's batching defaults: it plans what `serve`
    would (one owner for the defaults, pipeline/config.py)."""
    from pipeline.config import BatchingConfig

    d = run_json(
        capsys, "--lengths", str(lengths_file), "--world-size", "2", "--token-budget", "16384"
    )
    served = BatchingConfig(token_budget=16384).policy()
    assert (d["lookahead_tokens"], d["max_window_samples"], d["collate"]) == (
        served.lookahead_tokens, served.max_window_samples, served.collate.value)
    assert served.over_budget.value == "truncate" and d["truncated"] == 1  # sample 17


def test_human_summary(capsys, lengths_file):
    rc = main(
        ["plan", "--lengths", str(lengths_file), "--world-size", "2", "--token-budget", "16384"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("padding efficiency", "budget violations", "rank balance", "steps"):
        assert word in out


def test_jsonl_input_with_visual_cap(capsys, tmp_path):
    p = tmp_path / "s.jsonl"
    rows = [
        {"sample_id": f"src:{i}", "num_tokens": 100, "num_visual_tokens": 40} for i in range(50)
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    d = run_json(
        capsys,
        *("--lengths", str(p), "--world-size", "2", "--token-budget", "10000"),
        *("--max-visual-tokens", "120"),
    )
    assert d["budget_violations"] == 0 and d["emitted_samples"] == 50
    assert d["batches"] >= 50 / 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Every bound is the config model's (a flag is the job field it sets), named by flag.
        (["--world-size", "0"], "--world-size = 0: Input should be greater than or equal to 1"),
        (["--token-budget", "-5"], "--token-budget = -5: Input should be greater than 0"),
        (["--max-window-samples", "0"], "--max-window-samples = 0: Input should be greater"),
        (["--lookahead-tokens", "99"], "lookahead_tokens must be an integer >= token_budget "
                                       "(100) or None, got 99"),
        (["--epochs", "0"], "--epochs = 0: Input should be greater than or equal to 1"),
        (["--pool-steps", "0"], "--pool-steps = 0: Input should be greater than 0"),
        (["--max-visual-tokens", "0"], "--max-visual-tokens = 0: Input should be greater than 0"),
        (["--max-visual-tokens", "3"], "below the 4 visual tokens of the smallest image"),
        (["--attn-a", "-1"], "--attn-a = -1.0: Input should be greater than or equal to 0"),
        (["--global-token-budget", "99"], "global_token_budget (99) is below token_budget (100)"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, lengths_file, argv, message):
    base = {"--lengths": str(lengths_file), "--world-size": "2", "--token-budget": "100"}
    for k, v in zip(argv[::2], argv[1::2], strict=True):
        base[k] = v
    rc = main(["plan", *[x for kv in base.items() for x in kv]])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1


def test_missing_file_and_bad_line(capsys, tmp_path):
    rc = main(
        ["plan", "--lengths", str(tmp_path / "x"), "--world-size", "1", "--token-budget", "9"]
    )
    assert rc == 2 and "lengths file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text("10\n20\nthirty\n")
    rc = main(["plan", "--lengths", str(bad), "--world-size", "1", "--token-budget", "9"])
    err = capsys.readouterr().err
    assert rc == 2 and "line 3" in err and "'thirty'" in err


def test_emit_plan_unwritable(capsys, lengths_file, tmp_path):
    rc = main(
        [
            *("plan", "--lengths", str(lengths_file), "--world-size", "1"),
            *("--token-budget", "9", "--emit-plan", str(tmp_path / "no" / "dir.jsonl")),
        ]
    )
    assert rc == 2 and "cannot write --emit-plan" in capsys.readouterr().err


def test_subprocess_entry_point(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text("\n".join(["100"] * 50 + ["abc"]))
    script = shutil.which("odb-pipeline", path=str(REPO / ".venv" / "bin"))
    cmd = [script] if script else [sys.executable, "-m", "pipeline.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = tmp_path / "ok.txt"
    ok.write_text("\n".join(["100"] * 50))
    r = subprocess.run(
        [
            *cmd,
            "plan",
            "--lengths",
            str(ok),
            "--world-size",
            "2",
            "--token-budget",
            "1000",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["steps"] == 3 and d["per_rank_steps"] == [3, 3]  # 5 batches of 10 -> split to 6
    r = subprocess.run(
        [*cmd, "plan", "--lengths", str(p), "--world-size", "2", "--token-budget", "1000"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().startswith("odb-pipeline plan: error:") and "line 51" in r.stderr


def test_global_steps_plan_the_same_steps_at_any_world_size(capsys, tmp_path, lengths_file):
    """`--global-token-budget` (docs/global-steps.md): the same steps at W = 2 and 3, each
    rank in every step, micro-batches within the budget; the emitted plan names them."""
    plans = {}
    for w in (2, 3):
        out = tmp_path / f"plan{w}.jsonl"
        d = run_json(capsys, "--lengths", str(lengths_file), "--world-size", str(w),
                     "--token-budget", "16384", "--global-token-budget", str(8 * 16384),
                     "--emit-plan", str(out))
        assert d["global_token_budget"] == 8 * 16384 and d["budget_violations"] == 0
        assert d["per_rank_steps"] == [d["steps"]] * w and d["partial_steps"] == 0
        assert d["micro_batches_per_rank_step_max"] >= d["micro_batches_per_rank_step_p50"] >= 1
        steps = [json.loads(line) for line in out.read_text().splitlines()]
        assert [s["optimizer_step"] for s in steps] == list(range(d["steps"]))
        plans[w] = [sorted(i for b in s["batches"] if not b.get("filler") for i in b["samples"])
                    for s in steps]
        for s in steps:
            for r in range(w):
                micros = [b["micro"] for b in s["batches"] if b["rank"] == r]
                assert micros == list(range(len(micros))) and micros
    assert plans[2] == plans[3]
    main(["plan", "--lengths", str(lengths_file), "--world-size", "2", "--token-budget", "16384",
          "--global-token-budget", str(8 * 16384)])
    assert "micro-batches of up to 16384, global steps of up to 131072" in capsys.readouterr().out
