"""A real trainer rank in its own process (run by the tests, not collected by pytest).

    ddp:    torch.distributed (gloo) DDP on a tiny model inside Join, consuming one rank's stream
    resume: consume rank batches slowly, logging each batch digest and saving state_dict after
            every step (the test kills it with SIGKILL and restarts it from the saved state)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "trainer"))

import torch
from example_setup import exit_skipping_finalization

from trainer_client import BatchStream, loss_scale


def ddp(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                            init_method=f"tcp://127.0.0.1:{args.master_port}",
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    vocab = 1000
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Embedding(vocab, 8),
                                                        torch.nn.Linear(8, vocab)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    with BatchStream(args.address, args.job, args.rank, args.world) as stream, Join([model]):
        for batch in stream:
            inputs = batch.to_model_inputs()  # int64 ids and labels (the wire sends int32)
            logits = model(inputs["input_ids"])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab), inputs["labels"].reshape(-1), ignore_index=-100)
            (loss * loss_scale(batch)).backward()
            opt.step()
            opt.zero_grad()
            records.append({"step": batch.info.step, "ids": list(batch.info.sample_ids),
                            "filler": batch.info.filler})
        end = stream.last_end
    # All ranks agree on the weights afterwards: Join kept the all-reduces matched.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    total = flat.clone()
    dist.all_reduce(total)
    same = bool(torch.allclose(total / args.world, flat, atol=1e-6))
    Path(args.out).write_text(json.dumps({"records": records, "final_step": end.final_step,
                                          "mode": end.mode, "weights_equal": same}))
    # No rank tears gloo down while a peer is still in a collective (an exit-time abort).
    dist.barrier()
    dist.destroy_process_group()


def resume(args: argparse.Namespace) -> None:
    state_path = Path(args.state)
    stream = BatchStream(args.address, args.job, args.rank, args.world, prefetch=2)
    if state_path.exists():
        stream.load_state_dict(json.loads(state_path.read_text()))
    with open(args.out, "a") as log:
        for batch in stream:
            log.write(f"{batch.info.step} {batch.digest()}\n")
            log.flush()
            os.fsync(log.fileno())
            time.sleep(args.sleep)  # "training"
            tmp = state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stream.state_dict()))
            tmp.replace(state_path)  # atomic: a kill never leaves half a checkpoint
    stream.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["ddp", "resume"])
    p.add_argument("--address", required=True)
    p.add_argument("--job", default="j")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--state", default="")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    ddp(args) if args.kind == "ddp" else resume(args)


if __name__ == "__main__":
    main()
    exit_skipping_finalization(0)
