"""Example torchrun elastic trainer that survives losing a node (docs/elastic.md).

    torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=$HOST:29400 --rdzv-id=sft-1 \
        deploy/trainer/elastic_example.py --checkpoint-dir /shared/ckpt

The job must be `elastic: true` in the service config. When a node is lost, the surviving
workers' collectives fail, torchrun restarts the group with the nodes that are left and a new
WORLD_SIZE, every worker restores the last checkpoint (model, optimizer and rank 0's stream
position: a position restores any rank of any world) and opens `BatchStream(..., rank,
WORLD_SIZE)`. Once the dead group's leases lapsed, that Open moves the rest of the epoch onto
the new world: everything after the checkpoint is re-planned for it, nothing before it repeats.
An operator's `odb-pipeline scale` works the same way from the other side: each rank gets its
batches up to the boundary and an END whose reason is "reconfigure"; the worker checkpoints and
exits so the launcher restarts the group at the new size.

Environment: PIPELINE_ENDPOINT, PIPELINE_JOB, PIPELINE_TOKEN, PIPELINE_TLS_CA (optional) as in
train_example.py; RANK/WORLD_SIZE/LOCAL_RANK and TORCHELASTIC_RESTART_COUNT from torchrun.
CPU/gloo or CUDA/nccl.
`--record` appends one JSON line per batch as its step starts (tests check exactly-once
from it, up to the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from example_setup import ToyLM, exit_skipping_finalization, open_stream, toy_parser
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_client import causal_lm_loss

RECONFIGURED = 3  # exit code after END(reconfigure): the launcher restarts at the new size


def parse_args() -> argparse.Namespace:
    p = toy_parser(__doc__.splitlines()[0], vocab=4096, dim=32)
    p.add_argument("--checkpoint-dir", type=Path, required=True,
                   help="shared by every node: rank 0 writes the checkpoint, every rank reads it")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--record", type=Path, default=None,
                   help="JSON line per batch, as its step starts")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else None
    torch.manual_seed(0)
    model = ToyLM(args.vocab, args.dim).to(device or "cpu")
    ddp = DDP(model, device_ids=[device.index] if device is not None else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    # A generous reconnect window: after a node loss the Open waits (FAILED_PRECONDITION,
    # retried) until the old group's leases lapse, then reconfigures the job.
    stream = open_stream(args, rank, world, reconnect_timeout=120)
    ckpt = args.checkpoint_dir / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        stream.load_state_dict(state["data"])  # rank 0's position restores every rank
        print(f"rank {rank}/{world} (restart {restart}): resumed at step "
              f"{state['data']['next_step']}", flush=True)
    log = args.record.open("a") if args.record else None

    def save() -> None:
        if rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                        "data": stream.state_dict()}, tmp)
            tmp.replace(ckpt)  # atomic: a killed node never leaves half a checkpoint

    steps = 0
    with stream, log if log is not None else open(os.devnull, "w"):
        while not stream.done:
            with Join([ddp]):  # join mode: a rank that ends its epoch first shadows the rest
                for batch in stream:
                    if log is not None:
                        # Written before the step: its gradients are all-reduced inside
                        # backward(), so the peers (and rank 0's next checkpoint) may count the
                        # step done before this rank got past it.
                        log.write(json.dumps({"restart": restart, "world": world, "rank": rank,
                                              "step": batch.info.step,
                                              "ids": list(batch.info.sample_ids)}) + "\n")
                        log.flush()
                    inputs = batch.to_model_inputs(device)
                    labels = inputs["labels"]
                    labels = torch.where(labels >= 0, labels % args.vocab, labels)
                    loss = causal_lm_loss(ddp(inputs["input_ids"]), labels, batch)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    steps += 1
                    if batch.info.step % args.save_every == 0:
                        save()
            end = stream.last_end
            if end is not None and end.reason == "reconfigure":
                save()  # every rank ran through the boundary: a consistent checkpoint
                print(f"rank {rank}: the world becomes {end.world_size} ranks after step "
                      f"{end.final_step}; exiting for the launcher to restart", flush=True)
                return RECONFIGURED
    save()
    print(f"rank {rank}/{world} (restart {restart}): done after {steps} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_skipping_finalization(main())
