"""Guarantee 6 proven on real DDP: with 2 gloo ranks and uneven batches, the all-reduced gradient
of `loss * loss_scale` equals the gradient of the token-mean loss over every sample of the step
computed in one process (float tolerance). With global steps (Guarantee 12) the same holds for
a step split over the ranks into micro-batches, a rank running more of them than the other,
accumulated with `trainer_client.optimizer_steps` (and at W=1, all of them on one rank), and
for a step with fewer samples than ranks (a filler on rank 1).

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
from trainer_client import BatchInfo, loss_scale

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


def _steps(samples: dict[str, ProcessedSample], mode: str, world: int = W,
           global_token_budget: int | None = None) -> list[Step]:
    policy = BatchingPolicy(BUDGET, mode, max_window_samples=64, over_budget="truncate",
                            global_token_budget=global_token_budget)
    planner = StepPlanner(policy, world, seed=3,
                          pool_steps=None if global_token_budget else 2)
    events = planner.feed_many(s.measured(mode) for s in samples.values()) + planner.end_epoch()
    steps = [e for e in events if isinstance(e, Step)]
    return steps if global_token_budget else [e for e in steps if len(e.batches) == world]


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
    torch.save([{k: c[k] for k in ("name", "ranks", "micros") if k in c} for c in cases], path)
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


@pytest.fixture(scope="module")
def ran(cases, global_cases, tmp_path_factory) -> list[dict]:
    """Every case on the two gloo ranks, in one pair of processes (each rank's results)."""
    wire = [{"name": c["name"], "micros": [
        [{"tensors": _tensors(p, "padded"), "info": dataclasses.asdict(i)} for i, p in m]
        for m in c["micros"]]} for c in global_cases]
    return _run_ranks(cases + wire, tmp_path_factory.mktemp("ddp"))


def test_ddp_gradient_with_loss_scale_is_the_step_token_mean(cases, ran):
    ranks = ran
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


def micro_infos(step: Step, samples: dict[str, ProcessedSample], mode: str, world: int
                ) -> list[list[tuple[BatchInfo, list[Piece]]]]:
    """What the service puts on each micro-batch of a global step (batch_builder.py), per rank:
    the whole step's totals, the micro-batch's own counts."""
    out = []
    for r in range(world):
        mine = []
        for b in step.micros_for(r):
            pieces = [Piece(samples[s.sample_id]) for s in b.samples]
            n = 0 if b.filler else loss_tokens(collate(pieces, mode))
            mine.append((BatchInfo(
                step=step.step, epoch=step.epoch, rank=r, world_size=world,
                sample_ids=tuple(str(i) for i in b.sample_ids),
                step_samples=step.info.step_samples, step_tokens=step.info.step_tokens,
                rank_samples=0 if b.filler else len(b.samples),
                rank_tokens=0 if b.filler else b.num_tokens,
                step_loss_tokens=step.info.step_loss_tokens, rank_loss_tokens=n,
                collate=mode, over_budget=b.over_budget, filler=b.filler,
                micro_index=b.micro, micro_count=len(step.micros_for(r)),
                optimizer_step=step.info.optimizer_step), pieces))
        out.append(mine)
    return out


@pytest.fixture(scope="module")
def global_cases(tmp_path_factory) -> list[dict]:
    """Planned global steps on the real samples: one whose ranks run different numbers of
    micro-batches (one of them three or more), and one with fewer samples than ranks."""
    extra = _long_prompt_chats(tmp_path_factory.mktemp("g12") / "long_prompts.jsonl")
    samples = _samples([sample_chats_path(), str(extra)], "padded")
    uneven = next(s for s in _steps(samples, "padded", W, 4 * BUDGET)
                  if max(len(s.micros_for(r)) for r in range(W)) >= 3
                  and len({len(s.micros_for(r)) for r in range(W)}) == W)
    lonely = next(s for s in _steps(samples, "padded", W, BUDGET)
                  if any(b.filler for b in s.batches))
    out = []
    for name, step in (("global-uneven", uneven), ("global-filler", lonely)):
        micros = micro_infos(step, samples, "padded", W)
        assert step.info.step_loss_tokens == sum(i.rank_loss_tokens for m in micros
                                                 for i, _ in m)
        pieces = [Piece(samples[s.sample_id]) for b in step.batches if not b.filler
                  for s in b.samples]
        model = tiny_model()  # the reference: the whole step as ONE padded batch here
        loss, n = model(**_tensors(pieces, "padded"))
        loss.backward()
        assert n == step.info.step_loss_tokens
        out.append({"name": name, "step": step, "micros": micros, "ref": flat_grad(model)})
    return out


def test_accumulated_micro_batches_of_a_global_step_give_the_whole_steps_gradient(
        global_cases, ran):
    ranks = ran
    for case in global_cases:
        name, ref = case["name"], case["ref"]
        got = [ranks[r][name] for r in range(W)]
        assert [g["micros"] for g in got] == [len(m) for m in case["micros"]]
        assert torch.equal(got[0]["scaled"], got[1]["scaled"]), name  # one all-reduce each
        err = float((got[0]["scaled"] - ref).norm() / ref.norm())
        assert err < RTOL, f"{name}: relative gradient error {err:.2e}"
        if name == "global-uneven":  # (a filler copies rank 0's one sample: plain means agree)
            miss = float((got[0]["unscaled"] - ref).norm() / ref.norm())
            assert miss > 100 * RTOL, f"{name}: the unscaled loss should miss ({miss:.2e})"
    uneven = global_cases[0]["micros"]
    assert len(uneven[0]) != len(uneven[1]) and max(map(len, uneven)) >= 3
    assert any(i.filler for m in global_cases[1]["micros"] for i, _ in m)


def test_one_rank_accumulating_a_whole_global_step_gets_its_gradient(global_cases):
    """W=1: the step's every micro-batch on one rank, accumulated in this process."""
    case = global_cases[0]
    step, ref = case["step"], case["ref"]
    one = Step(step.epoch, step.step, tuple(
        dataclasses.replace(b, rank=0, micro=i) for i, b in enumerate(
            b for b in step.batches if not b.filler)), step.info, step.world)
    samples = {p.sample.sample_id: p.sample for m in case["micros"] for _, ps in m
               for p in ps}
    model = tiny_model()
    for info, pieces in micro_infos(one, samples, "padded", 1)[0]:
        assert info.world_size == 1 and info.micro_count == len(one.batches)
        part, _ = model(**_tensors(pieces, "padded"))
        (part * loss_scale(info)).backward()
    err = float((flat_grad(model) - ref).norm() / ref.norm())
    assert err < RTOL, f"relative gradient error {err:.2e}"
