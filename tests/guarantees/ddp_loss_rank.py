"""One gloo DDP rank for the Guarantee 6 test: gradients of loss * loss_scale, per case.

    python ddp_loss_rank.py --cases CASES.pt --rank R --world-size W --master-port P --out OUT.pt

For every case in CASES.pt (this rank's collated tensors and the BatchInfo the service would
send) it runs one DDP forward/backward of `loss * loss_scale(info)` and, as a control, of the
plain `loss`, and saves the synchronized (all-reduced) gradient of each. A case of a global
step (`micros`: this rank's micro-batches, as many as the planner gave it) is accumulated with
`trainer_client.optimizer_steps` (DDP's no_sync on all but the last micro-batch): ranks with
different micro-batch counts meet in exactly one all-reduce.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipeline.demo.tiny_model import TinyCausalLM
from trainer_client import BatchInfo, StreamBatch, loss_scale, optimizer_steps


def tiny_model() -> TinyCausalLM:
    """The demo's model with the same weights in every process. `use_cache=False` lets
    transformers isolate packed samples by their restarting position_ids (with a cache it
    would let them attend to each other), so a packed row computes what padded rows do."""
    model = TinyCausalLM(seed=0)
    model.lm.config.use_cache = False
    return model


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    torch.set_num_threads(1)
    ddp = DistributedDataParallel(tiny_model())
    out = {}
    for case in torch.load(args.cases, weights_only=True):
        if "micros" in case:
            out[case["name"]] = accumulate(ddp, case["micros"][args.rank])
            continue
        mine = case["ranks"][args.rank]
        info = BatchInfo(**mine["info"])
        res = {"scale": loss_scale(info)}
        for key, scale in (("scaled", res["scale"]), ("unscaled", 1.0)):
            ddp.zero_grad(set_to_none=True)
            loss, n = ddp(**mine["tensors"])
            (loss * scale).backward()  # DDP all-reduces (averages over ranks) here
            res[key] = flat_grad(ddp.module).clone()
            res["model_loss_tokens"] = n
        out[case["name"]] = res
    torch.save(out, args.out)
    dist.destroy_process_group()


def accumulate(ddp: DistributedDataParallel, micros: list[dict]) -> dict:
    """One optimizer step over this rank's micro-batches, scaled (and, as the control, not)."""
    res: dict = {"micros": len(micros)}
    for key, scaled in (("scaled", True), ("unscaled", False)):
        batches = []
        for m in micros:
            b = StreamBatch(m["tensors"])
            b.info = BatchInfo(**m["info"])
            batches.append(b)
        ddp.zero_grad(set_to_none=True)
        steps = 0
        for step in optimizer_steps(batches, ddp):
            steps += 1
            for b in step:
                loss, _ = ddp(**b)
                (loss * (loss_scale(b) if scaled else 1.0)).backward()
        assert steps == 1
        res[key] = flat_grad(ddp.module).clone()
    return res


if __name__ == "__main__":  # (imports here: the test imports this module too)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "trainer"))
    from example_setup import exit_skipping_finalization

    main()
    exit_skipping_finalization(0)
