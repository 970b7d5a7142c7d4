"""Guarantee 6 with model-parallel groups, on real gloo DDP: W=2 data-parallel ranks x a group
of 2 members each (4 processes, one DDP world). Every member of a rank gets the rank's batch,
padded to `pad_to_multiple` = 2 x group size by the service's collate (both layouts), and
computes the loss of its context-parallel share of every sequence; scaled by its share of the
step's loss tokens, the gradient averaged over DP x group is the gradient of the step's token
mean in one process (float tolerance). The members' shares partition the rank's loss tokens
exactly, which the padding to a multiple of 2 x group size is what makes possible. With global
steps the same holds for a step whose ranks run different numbers of micro-batches: every
member gets each of its rank's micro-batches and accumulates its shares (`optimizer_steps`).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_loss_scale_ddp import _long_prompt_chats, batch_infos, micro_infos, reference_grad

from pipeline.config import TrainingJobConfig
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Step
from pipeline.preprocess.process import Processor
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
from pipeline.redis_server import free_port
from pipeline.sample_data import sample_chats_path
from pipeline.service.collate import Piece, collate

WORKER = Path(__file__).resolve().parent / "ddp_group_rank.py"
ROOT = WORKER.parents[2]
BUDGET, W, K = 1024, 2, 2
MULTIPLE = 2 * K
RTOL = 1e-4
pytestmark = pytest.mark.slow


def _samples(paths: list[str], rows: int = 160) -> dict[str, ProcessedSample]:
    """The first `rows` rows of each source, really preprocessed (the same for both layouts:
    a sample's measure per collate is `ProcessedSample.measured`)."""
    job = TrainingJobConfig.model_validate({
        "job_id": "g6g", "world_size": W, "source": {"paths": paths},
        "batching": {"token_budget": BUDGET, "pad_to_multiple": MULTIPLE}})
    proc = Processor(job, 0)
    out: dict[str, ProcessedSample] = {}
    for path in paths:
        chunk = next(iter(plan_chunks(expand_sources(job.source.model_copy(
            update={"paths": [path]})), rows, 0, None)))
        for item in proc.process(chunk.file, read_chunk(chunk)):
            if isinstance(item, ProcessedSample):
                out[item.sample_id] = item
    return out


def _steps(samples: dict, mode: str, global_token_budget: int | None = None) -> list[Step]:
    policy = BatchingPolicy(BUDGET, mode, max_window_samples=64, over_budget="truncate",
                            pad_to_multiple=MULTIPLE, global_token_budget=global_token_budget)
    planner = StepPlanner(policy, W, seed=3, pool_steps=None if global_token_budget else 2)
    events = planner.feed_many(s.measured(mode) for s in samples.values()) + planner.end_epoch()
    steps = [e for e in events if isinstance(e, Step)]
    return steps if global_token_budget else [e for e in steps if len(e.batches) == W]


def _wire(pieces: list[Piece], mode: str, info) -> dict:
    """A batch as the service sends it to every member: padded to 2 x group size."""
    return {"tensors": {k: torch.from_numpy(v) for k, v in collate(
        pieces, mode, pad_to_multiple=MULTIPLE).items()}, "info": dataclasses.asdict(info)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[dict]:
    extra = _long_prompt_chats(tmp_path_factory.mktemp("g6g") / "long_prompts.jsonl")
    samples = _samples([sample_chats_path(), str(extra)])
    out = []
    for mode in ("padded", "packed"):
        step = next(s for s in _steps(samples, mode)
                    if len({len(b.samples) for b in s.batches}) == W)
        assert all(b.cost <= BUDGET for b in step.batches)  # the padding counted in the budget
        infos = batch_infos(step, samples, mode)
        pieces = [[Piece(samples[s.sample_id]) for s in step.batch_for(r).samples]
                  for r in range(W)]
        out.append({"name": f"{mode}-group", "counted": [0, 1], "pieces": pieces,
                    "micros": [[_wire(pieces[r], mode, infos[r])] for r in range(W)]})
    # A global step whose ranks run different numbers of micro-batches (packed): every member
    # of a rank gets each of them and accumulates its shares.
    step = next(s for s in _steps(samples, "packed", 3 * BUDGET)
                if len({len(s.micros_for(r)) for r in range(W)}) == W)
    micros = micro_infos(step, samples, "packed", W)
    out.append({"name": "packed-global-group", "counted": [0, 1],
                "pieces": [[p for _, ps in micros[r] for p in ps] for r in range(W)],
                "micros": [[_wire(ps, "packed", i) for i, ps in micros[r]] for r in range(W)]})
    return out


def test_groups_gradient_is_the_step_token_mean(cases, tmp_path):
    path = tmp_path / "cases.pt"
    torch.save([{"name": c["name"], "micros": c["micros"]} for c in cases], path)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    port = free_port()
    procs = {(d, j): subprocess.Popen(
        [sys.executable, str(WORKER), "--cases", str(path), "--dp-rank", str(d), "--dp-size",
         str(W), "--member", str(j), "--group-size", str(K), "--master-port", str(port),
         "--out", str(tmp_path / f"r{d}m{j}.pt")], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for d in range(W) for j in range(K)}
    try:
        for p in procs.values():
            log, _ = p.communicate(timeout=300)
            assert p.returncode == 0, log.decode()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    got = {key: torch.load(tmp_path / f"r{key[0]}m{key[1]}.pt", weights_only=True)
           for key in procs}
    for case in cases:
        name = case["name"]
        ref, n_ref = reference_grad(case)
        assert n_ref == case["micros"][0][0]["info"]["step_loss_tokens"], name
        for d in range(W):  # the members' shares partition each batch's loss tokens exactly
            shares = [got[(d, j)][name]["share_loss_tokens"] for j in range(K)]
            for i, m in enumerate(case["micros"][d]):
                assert all(s[i] > 0 for s in shares), (name, d, shares)
                assert sum(s[i] for s in shares) == m["info"]["rank_loss_tokens"], (name, d, i)
        grads = [got[key][name]["grad"] for key in procs]
        assert all(torch.equal(g, grads[0]) for g in grads), name  # DDP kept all in sync
        err = float((grads[0] - ref).norm() / ref.norm())
        assert err < RTOL, f"{name}: relative gradient error {err:.2e}"
    micro_counts = [len(m) for m in cases[-1]["micros"]]
    assert micro_counts[0] != micro_counts[1], "the global step's ranks differ in micro-batches"
