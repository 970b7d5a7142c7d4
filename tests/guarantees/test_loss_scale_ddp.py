"""Guarantee 6 proven on real DDP: with 2 gloo ranks and uneven batches, the all-reduced gradient
of `loss * loss_scale` equals the gradient of the token-mean loss over every sample of the step
computed in one process (float tolerance).

Real pieces throughout: samples from the real preprocessing (the shipped chats plus long-prompt,
short-answer chats so a rank can hold far fewer loss tokens), steps from the real planner, the
service's collate, the `BatchInfo` the service puts on each batch, `trainer_client.loss_scale`,
two processes with torch.distributed gloo and DistributedDataParallel on the demo's tiny
Qwen2-style model. The reference is one padded batch of all the step's samples in this process.
Each case also runs the plain (unscaled) loss, which must miss the reference, so a broken scale
cannot pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_loss_rank import flat_grad, tiny_model

from pipeline.config import TrainingJobConfig
from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.step_planner import StepPlanner
from pipeline.planner.types import Step
from pipeline.preprocess.process import Processor
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
from pipeline.redis_server import free_port
from pipeline.sample_data import sample_chats_path
from pipeline.service.collate import Piece, collate, loss_tokens
from trainer_client import BatchInfo

WORKER = Path(__file__).resolve().parent / "ddp_loss_rank.py"
ROOT = WORKER.parents[2]
BUDGET, W = 1024, 2
# float32 sums taken in another order (per rank, then all-reduced): ~1e-7 relative seen here.
RTOL = 1e-4
pytestmark = pytest.mark.slow


def _long_prompt_chats(path: Path) -> Path:
    """Chats whose question is a long real text and whose answer is two words: few loss tokens."""
    from pydoc_data.topics import topics

    lines = []
    for name in sorted(topics)[:60]:
        text = topics[name][:2400]
        if len(text) > 1200:
            lines.append(json.dumps({"messages": [
                {"role": "user", "content": f"Read this and say nothing else:\n{text}"},
                {"role": "assistant", "content": "Noted, thanks."}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _samples(paths: list[str], mode: str) -> dict[str, ProcessedSample]:
    job = TrainingJobConfig.model_validate({
        "job_id": "g6", "world_size": W, "source": {"paths": paths},
        "batching": {"token_budget": BUDGET, "collate": mode}})
    proc = Processor(job, 0)
    out = {}
    for chunk in plan_chunks(expand_sources(job.source), 256, 0, None):
        for item in proc.process(chunk.file, read_chunk(chunk)):
            if isinstance(item, ProcessedSample):
                out[item.sample_id] = item
    return out


def _steps(samples: dict[str, ProcessedSample], mode: str) -> list[Step]:
    policy = BatchingPolicy(BUDGET, mode, max_window_samples=64, over_budget="truncate")
    planner = StepPlanner(policy, W, seed=3, pool_steps=2)
    events = planner.feed_many(s.measured(mode) for s in samples.values()) + planner.end_epoch()
    return [e for e in events if isinstance(e, Step) and len(e.batches) == W]


def batch_infos(step: Step, samples: dict[str, ProcessedSample], mode: str) -> list[BatchInfo]:
    """What the service puts on each rank's batch of `step` (service/job_runtime.py)."""
    pieces = {b.rank: [Piece(samples[s.sample_id]) for s in b.samples] for b in step.batches}
    loss = {r: loss_tokens(collate(p, mode)) for r, p in pieces.items()}
    # The planner's metadata-only total is the one the payloads give (Guarantee 6's premise).
    assert step.info.step_loss_tokens == sum(loss.values())
    return [BatchInfo(step=step.step, epoch=step.epoch, rank=b.rank, world_size=W,
                      sample_ids=tuple(str(i) for i in b.sample_ids),
                      step_samples=step.info.step_samples, step_tokens=step.info.step_tokens,
                      rank_samples=len(b.samples), rank_tokens=b.num_tokens,
                      step_loss_tokens=sum(loss.values()), rank_loss_tokens=loss[b.rank],
                      collate=mode, over_budget=b.over_budget)
            for b in sorted(step.batches, key=lambda b: b.rank)]


def _tensors(pieces: list[Piece], mode: str) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in collate(pieces, mode).items()}


def _skew(infos: list[BatchInfo]) -> float:
    lo, hi = sorted(i.rank_loss_tokens for i in infos)
    return hi / max(lo, 1)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[dict]:
    """Per collate: an uneven planned step (different sample counts and loss tokens) and the
    planned step whose ranks differ most in loss tokens; plus a step where rank 1's scale is 0."""
    extra = _long_prompt_chats(tmp_path_factory.mktemp("g6") / "long_prompts.jsonl")
    out = []
    for mode in ("padded", "packed"):
        samples = _samples([sample_chats_path(), str(extra)], mode)
        planned = [(s, batch_infos(s, samples, mode)) for s in _steps(samples, mode)]
        uneven = next((s, i) for s, i in planned
                      if len({x.rank_samples for x in i}) == W and _skew(i) > 1.2)
        skewed = max(planned, key=lambda p: _skew(p[1]))
        assert _skew(skewed[1]) >= 8, "the data should give a step with far fewer loss tokens"
        for name, (step, infos) in ((f"{mode}-uneven", uneven), (f"{mode}-skewed", skewed)):
            pieces = [[Piece(samples[s.sample_id]) for s in step.batch_for(r).samples]
                      for r in range(W)]
            out.append({"name": name, "mode": mode, "counted": [0, 1],
                        "ranks": [{"tensors": _tensors(pieces[r], mode),
                                   "info": dataclasses.asdict(infos[r])} for r in range(W)],
                        "pieces": pieces})
    # A rank whose batch is a filler (it runs only to take part in the all-reduce): the step's
    # loss tokens are rank 0's alone and rank 1's scale is 0, whatever its model loss is.
    base = next(c for c in out if c["name"] == "padded-uneven")
    infos = [BatchInfo(**r["info"]) for r in base["ranks"]]
    n0 = infos[0].rank_loss_tokens
    filler = [dataclasses.replace(infos[0], step_loss_tokens=n0),
              dataclasses.replace(infos[1], step_loss_tokens=n0, rank_loss_tokens=0)]
    out.append({**base, "name": "padded-filler", "counted": [0],
                "ranks": [{"tensors": r["tensors"], "info": dataclasses.asdict(i)}
                          for r, i in zip(base["ranks"], filler, strict=True)]})
    return out


def reference_grad(case: dict) -> tuple[torch.Tensor, int]:
    """Gradient of the token-mean loss over all counted samples, as ONE padded batch here."""
    model = tiny_model()
    pieces = [p for r in case["counted"] for p in case["pieces"][r]]
    loss, n = model(**_tensors(pieces, "padded"))
    loss.backward()
    return flat_grad(model), n


def _run_ranks(cases: list[dict], tmp_path: Path) -> list[dict]:
    path = tmp_path / "cases.pt"
    torch.save([{"name": c["name"], "ranks": c["ranks"]} for c in cases], path)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--cases", str(path), "--rank",
                               str(r), "--world-size", str(W), "--master-port", str(port),
                               "--out", str(tmp_path / f"rank{r}.pt")], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(W)]
    try:
        for p in procs:
            log, _ = p.communicate(timeout=300)
            assert p.returncode == 0, log.decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(W)]


def test_ddp_gradient_with_loss_scale_is_the_step_token_mean(cases, tmp_path):
    ranks = _run_ranks(cases, tmp_path)
    for case in cases:
        name = case["name"]
        infos = [BatchInfo(**r["info"]) for r in case["ranks"]]
        ref, n_ref = reference_grad(case)
        assert n_ref == infos[0].step_loss_tokens, name  # the model counts what the info says
        got = [ranks[r][name] for r in range(W)]
        for r in case["counted"]:
            assert got[r]["model_loss_tokens"] == infos[r].rank_loss_tokens, name
        assert torch.equal(got[0]["scaled"], got[1]["scaled"]), name  # DDP kept ranks in sync
        err = float((got[0]["scaled"] - ref).norm() / ref.norm())
        assert err < RTOL, f"{name}: relative gradient error {err:.2e}"
        torch.testing.assert_close(got[0]["scaled"], ref, rtol=RTOL, atol=RTOL * float(
            ref.abs().max()))
        # The control: averaging the ranks' plain means is not the step's token mean.
        miss = float((got[0]["unscaled"] - ref).norm() / ref.norm())
        assert miss > 100 * RTOL, f"{name}: the unscaled loss should miss ({miss:.2e})"
    filler = next(c for c in cases if c["name"] == "padded-filler")
    assert ranks[1]["padded-filler"]["scale"] == 0.0
    assert ranks[1]["padded-filler"]["model_loss_tokens"] > 0  # its loss was real, and ignored
    assert filler["counted"] == [0]
