"""Every adapter in join mode on 2 real gloo ranks whose epochs end at different steps:
no hang, every sample exactly once per epoch, and each step's all-reduced gradient equal to that
of the mean loss over all of the step's loss tokens (exact loss scale).

9 samples that each fill the budget make 5 steps an epoch; the 5th has rank 0 only. Aligned
adapters (loader, hf, lightning) give rank 1 a filler there; accelerate joins it (torch Join).
The learning rate is 0, so the test recomputes every step's gradient from the same weights.
Restarts: a run stopped mid-epoch resumes from its checkpoint (lightning: the rank-0 checkpoint
restores both ranks) and the two runs together still deliver every sample exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from service_helpers import job_dict, service_config, serving
from tiny_lm import BUDGET, build_model, reference_grad, samples

from pipeline.redis_server import free_port

pytestmark = pytest.mark.slow

RANK_SCRIPT = Path(__file__).resolve().parent / "ddp_rank.py"
SAMPLES = samples(9)
EPOCHS = 2
STEPS_PER_EPOCH = 5


def launch(adapter: str, address: str, tmp: Path, tag: str, *extra: str) -> dict[int, list]:
    """Both ranks as processes; a hang is a failure (no rank may wait forever)."""
    port = str(free_port())
    procs, logs = [], {}
    for rank in (0, 1):
        logs[rank] = tmp / f"{tag}-rank{rank}.jsonl"
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        err = open(tmp / f"{tag}-rank{rank}.err", "w")  # noqa: SIM115 (closed with the process)
        procs.append((subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), adapter, address, "j", str(logs[rank]),
             "--out-dir", str(tmp / "out"), *extra], env=env, stdout=err, stderr=err), err))
    try:
        for proc, _ in procs:
            proc.wait(timeout=420)
    except subprocess.TimeoutExpired:
        for proc, _ in procs:
            proc.kill()
        pytest.fail(f"{adapter}: a rank hung; stderr: {tail(tmp, tag)}")
    for rank, (proc, err) in enumerate(procs):
        err.close()
        assert proc.returncode == 0, f"{adapter} rank {rank} exited {proc.returncode}: " \
            f"{tail(tmp, tag)}"
    return {r: [json.loads(line) for line in p.read_text().splitlines()]
            for r, p in logs.items()}


def tail(tmp: Path, tag: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(tmp.glob(f"{tag}-rank*.err")))


def check(records: dict[int, list], *, aligned: bool) -> None:
    by_step: dict[int, dict[int, dict]] = defaultdict(dict)
    for rank, recs in records.items():
        for rec in recs:
            assert rec["step"] not in by_step or rank not in by_step[rec["step"]], \
                f"rank {rank} ran step {rec['step']} twice"
            by_step[rec["step"]][rank] = rec
    assert sorted(by_step) == list(range(EPOCHS * STEPS_PER_EPOCH))
    # Exactly once per epoch; and the epochs really end at different steps per rank.
    for epoch in range(EPOCHS):
        ids = [i for step, recs in by_step.items() for rec in recs.values()
               if rec["epoch"] == epoch for i in rec["sample_ids"]]
        assert sorted(ids) == sorted(s.sample_id for s in SAMPLES)
    last = by_step[STEPS_PER_EPOCH - 1]
    if aligned:  # every rank runs every step; rank 1's last one is a filler
        assert all(set(recs) == {0, 1} for recs in by_step.values())
        assert last[1]["filler"] and not last[1]["sample_ids"] and not last[0]["filler"]
    else:  # Join: rank 1 has no record at the step it shadowed
        assert set(last) == {0}
    # Exact loss scale: each rank's all-reduced gradient == the step's global mean-loss gradient.
    by_id = {s.sample_id: s for s in SAMPLES}
    model = build_model()
    for step, recs in sorted(by_step.items()):
        real = [rec for rec in recs.values() if not rec["filler"]]
        expected, n_tokens = reference_grad(model, [[by_id[i] for i in rec["sample_ids"]]
                                                    for rec in real])
        assert n_tokens == real[0]["step_loss_tokens"] == sum(r["rank_loss_tokens"] for r in real)
        for rank, rec in recs.items():
            assert rec["grad"] == pytest.approx(expected, rel=1e-4, abs=1e-6), \
                f"step {step} rank {rank}: gradient is not the step's mean-loss gradient"


def service(job: str = "j"):
    cfg = service_config(job_dict(job, world_size=2, epochs=EPOCHS,
                                  batching={"token_budget": BUDGET}))
    return serving(cfg, {job: SAMPLES})


@pytest.mark.parametrize(("adapter", "aligned"), [("loader", True), ("accelerate", False),
                                                  ("hf", True), ("lightning", True)])
def test_adapter_in_join_mode(tmp_path, adapter, aligned):
    with service() as svc:
        records = launch(adapter, svc.address, tmp_path, "run")
    check(records, aligned=aligned)


@pytest.mark.parametrize(("adapter", "stop"), [("loader", 4), ("hf", 4), ("lightning", 4),
                                               ("lightning", 2)])
def test_adapter_resumes_from_its_checkpoint_exactly_once(tmp_path, adapter, stop):
    """Stop after a step and resume in new processes: nothing redelivered, nothing lost. Step 4
    is the epoch's last (rank 1 on its filler, its END already taken: the resumed pass has
    nothing left of epoch 0); after step 2 Lightning has already fetched step 3's batch."""
    with service() as svc:
        if adapter == "loader":  # each rank saves its own state; both resume from rank 0's
            first = launch(adapter, svc.address, tmp_path, "first", "--stop-after", str(stop),
                           "--state-out", str(tmp_path / "state{rank}.json"))
            resume = ["--state-in", str(tmp_path / "state0.json")]
        elif adapter == "hf":  # each rank's position goes into the Trainer's checkpoint
            first = launch(adapter, svc.address, tmp_path, "first", "--stop-after", str(stop))
            resume = ["--state-in", str(tmp_path / "out" / f"checkpoint-{stop + 1}")]
        else:  # Lightning writes the rank-0 checkpoint (ModelCheckpoint); it restores both ranks
            ckpt = tmp_path / "stream.ckpt"
            first = launch(adapter, svc.address, tmp_path, "first", "--stop-after", str(stop),
                           "--state-out", str(ckpt))
            resume = ["--state-in", str(ckpt)]
        assert max(r["step"] for recs in first.values() for r in recs) == stop
        second = launch(adapter, svc.address, tmp_path, "second", *resume)
    assert min(r["step"] for recs in second.values() for r in recs) == stop + 1
    check({r: first[r] + second[r] for r in (0, 1)}, aligned=True)
