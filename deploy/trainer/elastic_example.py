"""Example torchrun elastic trainer that survives losing a node and gaining one (docs/elastic.md).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=$HOST:29400 --rdzv-id=sft-1 \
        deploy/trainer/elastic_example.py --checkpoint-dir /shared/ckpt

(The variable: with torch 2.13's default, a node that joins a running group waits forever for
the workers' master address; docs/elastic.md.)

The job must be `elastic: true` in the service config. When a node is lost, the surviving
workers' collectives fail, torchrun restarts the group with the nodes that are left and a new
WORLD_SIZE; when a node (re)joins, torchrun restarts the group with it. Either way every worker
of the new group loads the last checkpoint (model, optimizer and the stream position, saved by
the old group with `torch.distributed.checkpoint`, which reshards it onto the new world) and
opens `BatchStream(..., rank, WORLD_SIZE)`. Once the old group's leases lapsed, that Open moves
the rest of the epoch onto the new world: everything after the checkpoint is re-planned for it,
nothing before it repeats. An operator's `odb-pipeline scale` works the same way from the other
side: each rank gets its batches up to the boundary and an END whose reason is "reconfigure";
the worker checkpoints and exits so the launcher restarts the group at the new size.

With the job's `batching.global_token_budget` (docs/global-steps.md) an optimizer step holds the
same samples at any world size, and the example accumulates each step's micro-batches
(`optimizer_steps`): a run that loses and regains nodes trains the steps, and so the losses, of
a run that never did (tests/elastic/test_torchrun_example.py checks it in float64). Without it a
step is one batch per rank, trained under `Join` (join mode: ranks may end an epoch at
different steps).

Environment: PIPELINE_ENDPOINT, PIPELINE_JOB, PIPELINE_TOKEN, PIPELINE_TLS_CA (optional) as in
train_example.py; RANK/WORLD_SIZE/LOCAL_RANK and TORCHELASTIC_RESTART_COUNT from torchrun.
CPU/gloo or CUDA/nccl.
`--record` appends one JSON line per batch as its step starts (tests check exactly-once
from it, up to the checkpoint) and, with global steps, one per optimizer step with its loss.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from example_setup import ToyLM, exit_skipping_finalization, open_stream, toy_parser
from torch.distributed.algorithms.join import Join
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_client import BatchStream, StreamBatch, causal_lm_loss, optimizer_steps

RECONFIGURED = 3  # exit code after END(reconfigure): the launcher restarts at the new size


def parse_args() -> argparse.Namespace:
    p = toy_parser(__doc__.splitlines()[0], vocab=4096, dim=32)
    p.add_argument("--checkpoint-dir", type=Path, required=True,
                   help="shared by every node: the checkpoints, each one a directory")
    p.add_argument("--save-every", type=int, default=20,
                   help="checkpoint every N steps (optimizer steps with global steps), and "
                        "after each world's first")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="the model's. Runs at different world sizes sum a step's gradient in "
                        "different orders: their losses agree to ~1e-16 in float64, ~1e-7 in "
                        "float32")
    p.add_argument("--record", type=Path, default=None,
                   help="JSON line per batch, as its step starts")
    return p.parse_args()


class TrainState(Stateful):
    """What a checkpoint holds, for `torch.distributed.checkpoint`: the model and optimizer
    (their state dicts by parameter name, loadable into any world: DCP maps what the old world
    saved onto this one's ranks, into these very tensors) and the stream's position (any
    rank's: a position restores any rank of any world)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 stream: BatchStream) -> None:
        self.model, self.opt, self.stream = model, opt, stream

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim, "data": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.stream.load_state_dict(state["data"])


class Checkpoints:
    """One DCP directory per checkpoint under `root`, and `root/latest` naming the last
    complete one (replaced atomically once the save returned: a node killed mid-save never
    leaves a checkpoint that the next group would load half of)."""

    def __init__(self, root: Path, rank: int) -> None:
        self.root, self.rank = root, rank
        self.pointer = root / "latest"

    def load(self, state: TrainState) -> bool:
        if not self.pointer.exists():
            return False
        dcp.load({"train": state}, checkpoint_id=self.root / self.pointer.read_text())
        return True

    def save(self, state: TrainState, name: str, *, every_rank: bool) -> None:
        """`every_rank`: a collective save (each rank writes its share; every rank must call
        it at the same point). Otherwise rank 0 saves alone: DDP replicates the model and the
        optimizer, so its copy is the whole state (join mode: the other ranks may already be
        past the epoch's end, in no collective)."""
        if not every_rank and self.rank != 0:
            return
        dcp.save({"train": state}, checkpoint_id=self.root / name, no_dist=not every_rank)
        if self.rank == 0:
            previous = self.pointer.read_text() if self.pointer.exists() else None
            tmp = self.pointer.with_suffix(".tmp")
            tmp.write_text(name)
            tmp.replace(self.pointer)
            if previous not in (None, name):
                shutil.rmtree(self.root / previous, ignore_errors=True)


def epoch_batches(stream: BatchStream) -> tuple[bool, Iterator[StreamBatch]]:
    """This epoch's batches, and whether they are global steps' micro-batches (the job has
    `batching.global_token_budget`): its first batch says."""
    batches = iter(stream)
    first = next(batches, None)
    if first is None:
        return False, iter(())
    return first.info.optimizer_step is not None, itertools.chain([first], batches)


def main() -> NoReturn:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else None
    torch.manual_seed(0)
    model = ToyLM(args.vocab, args.dim).to(device or "cpu", getattr(torch, args.dtype))
    ddp = DDP(model, device_ids=[device.index] if device is not None else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    # A generous reconnect window: after a node loss the Open waits (FAILED_PRECONDITION,
    # retried) until the old group's leases lapse, then reconfigures the job.
    stream = open_stream(args, rank, world, reconnect_timeout=120)
    state, ckpts = TrainState(ddp, opt, stream), Checkpoints(args.checkpoint_dir, rank)
    if ckpts.load(state):  # every rank of the new world, whatever the old world's size
        print(f"rank {rank}/{world} (restart {restart}): resumed at step {stream.next_step}",
              flush=True)
    log = open(args.record or os.devnull, "a")  # noqa: SIM115 - closed with the stream below

    def record(**fields: Any) -> None:
        # Written before the step: its gradients are all-reduced inside backward(), so the
        # peers (and the next checkpoint) may count the step done before this rank got past it.
        log.write(json.dumps({"restart": restart, "world": world, "rank": rank, **fields}) + "\n")
        log.flush()

    def train(batch: StreamBatch) -> torch.Tensor:
        """Forward and backward of one batch (or micro-batch), scaled by its step's totals."""
        inputs = batch.to_model_inputs(device)
        labels = inputs["labels"]
        labels = torch.where(labels >= 0, labels % args.vocab, labels)
        loss = causal_lm_loss(ddp(inputs["input_ids"]), labels, batch)
        loss.backward()
        return loss.detach()

    steps, code = 0, 0
    with stream, log:
        while not stream.done:
            global_steps, batches = epoch_batches(stream)
            if global_steps:
                # Every rank runs every optimizer step (no Join: each rank accumulates its own
                # number of micro-batches, the all-reduce runs on its last one), so a collective
                # at a step's end (the loss for the log, a checkpoint) is safe on every rank.
                for step in optimizer_steps(batches, ddp):
                    loss = torch.zeros((), dtype=torch.float64, device=device)
                    for batch in step:
                        i = batch.info
                        record(step=i.step, opt=i.optimizer_step, micro=i.micro_index,
                               filler=i.filler, ids=list(i.sample_ids))
                        loss += train(batch)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    steps += 1
                    dist.all_reduce(loss)  # each rank's share is scaled by W: the step's mean
                    if rank == 0:
                        record(step=step.info.step, opt=step.info.optimizer_step,
                               loss=loss.item() / world)
                    # Also after this world's first step: the world that follows (a node lost
                    # or back) must find one of this world's checkpoints, its steps cannot be
                    # undone (docs/elastic.md).
                    if steps == 1 or step.info.optimizer_step % args.save_every == 0:
                        ckpts.save(state, f"step-{stream.next_step}", every_rank=True)
            else:
                with Join([ddp]):  # join mode: a rank that ends its epoch first shadows the rest
                    for batch in batches:
                        record(step=batch.info.step, ids=list(batch.info.sample_ids))
                        train(batch)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        steps += 1
                        if steps == 1 or batch.info.step % args.save_every == 0:
                            ckpts.save(state, f"step-{stream.next_step}", every_rank=False)
            end = stream.last_end
            if end is not None and end.reason == "reconfigure":
                # Every rank ran through the boundary: a consistent checkpoint.
                ckpts.save(state, f"step-{stream.next_step}", every_rank=True)
                print(f"rank {rank}: the world becomes {end.world_size} ranks after step "
                      f"{end.final_step}; exiting for the launcher to restart", flush=True)
                code = RECONFIGURED
                break
        if code == 0:
            ckpts.save(state, "final", every_rank=True)  # join mode: ranks end at other steps
            print(f"rank {rank}/{world} (restart {restart}): done after {steps} steps",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()
    exit_skipping_finalization(code)  # here, while `ddp` is referenced: see its docstring


if __name__ == "__main__":
    main()
