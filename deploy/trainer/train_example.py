"""Example trainer for Kubernetes: torchrun ranks that read batches from the odb-pipeline service.

Run by k8s/trainer-example (an Indexed Job, one torchrun node per pod):

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=$IDX --master-addr=... \
        /opt/odb/trainer/train_example.py --max-steps=200

Environment: PIPELINE_ENDPOINT (host:port of the service), PIPELINE_JOB (job id),
PIPELINE_TOKEN (the job's bearer token, from a Secret), PIPELINE_TLS_CA (the CA the service's
certificate is checked against, when it speaks TLS); RANK/WORLD_SIZE/LOCAL_RANK from torchrun.

The model is a toy (token embedding + linear head over token ids folded into a small vocabulary);
what the example shows is the data-plane wiring: one BatchStream per rank, DDP under
`torch.distributed.algorithms.Join` so ranks may end an epoch at different steps (join mode),
exact cross-rank loss scaling (`causal_lm_loss`), model inputs widened on the device
(`to_model_inputs`), and the stream position in checkpoints so a restarted pod resumes at its
first unacknowledged step. The other examples here do the same through the HF Trainer,
Accelerate, Lightning and a torchdata-style loader.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from example_setup import ToyLM, exit_skipping_finalization, open_stream, toy_parser
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_client import causal_lm_loss


def parse_args() -> argparse.Namespace:
    p = toy_parser(__doc__.splitlines()[0], vocab=8192, dim=64)
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after global step N (0 = run the job to its end)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="file for model + stream position (per rank); resumed from if present")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)

    model = ToyLM(args.vocab, args.dim).to(device or "cpu")
    ddp = DDP(model, device_ids=[device.index] if device is not None else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    stream = open_stream(args, rank, world)

    ckpt = args.checkpoint.with_suffix(f".rank{rank}.pt") if args.checkpoint else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        stream.load_state_dict(state["data"])
        print(f"rank {rank}: resumed at step {state['data']['next_step']}", flush=True)

    steps, t0 = 0, time.monotonic()
    with stream:
        while not stream.done:
            seen_end = stream.last_end
            # Join: a rank that runs out of batches first shadows the others' all-reduces.
            with Join([ddp]):
                for batch in stream:
                    inputs = batch.to_model_inputs(device)
                    labels = inputs["labels"]  # folded like the toy model folds its inputs
                    labels = torch.where(labels >= 0, labels % args.vocab, labels)
                    loss = causal_lm_loss(ddp(inputs["input_ids"]), labels, batch)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    steps += 1
                    if steps % 20 == 0:
                        print(f"rank {rank} epoch {batch.info.epoch} step {batch.info.step} "
                              f"loss {loss.item():.4f} tokens {batch.info.rank_tokens}",
                              flush=True)
                    if ckpt is not None and steps % 50 == 0:
                        torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                                    "data": stream.state_dict()}, ckpt)
                    if args.max_steps and batch.info.step + 1 >= args.max_steps:
                        break  # global step index: the same cut on every rank
            end = stream.last_end
            if end is not None and end is not seen_end:
                print(f"rank {rank}: epoch {end.epoch} ended at step {end.final_step}",
                      flush=True)
            # Outside Join all ranks are in step again: agree on stopping, so no rank starts
            # another epoch's collectives alone.
            next_step = stream.state_dict()["next_step"]
            stop = torch.tensor([int(bool(args.max_steps) and next_step >= args.max_steps)],
                                device=device)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
    print(f"rank {rank}: {steps} steps in {time.monotonic() - t0:.1f}s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_skipping_finalization(main())
