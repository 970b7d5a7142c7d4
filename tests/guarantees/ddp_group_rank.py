"""One member of a model-parallel group on gloo, for the groups' gradient test.

    python ddp_group_rank.py --cases CASES.pt --dp-rank D --dp-size W --member J
        --group-size K --master-port P --out OUT.pt

The W x K processes form one DDP world (gradients averaged over DP x group). Every member of DP
rank D gets D's batch (as the service sends it to each member of D's group) and takes its share
of every sequence as context parallelism would: chunks J and 2K-1-J of 2K equal chunks of each
padded sequence (the job's `pad_to_multiple` is 2K, so every sequence divides). Its loss is the
token mean over its share's loss tokens (the forward runs on the whole batch: the chunked
attention of real CP is not the point here), scaled by `n_share * W * K / step_loss_tokens`,
so that summed over the group, averaged over DP x K, it is the step's token mean. A global
step's micro-batches are accumulated with `optimizer_steps` (one all-reduce per step).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from ddp_loss_rank import flat_grad, tiny_model
from torch.nn.parallel import DistributedDataParallel

from trainer_client import BatchInfo, StreamBatch, optimizer_steps

IGNORE_INDEX = -100


def share(tensors: dict[str, torch.Tensor], member: int, group_size: int) -> torch.Tensor:
    """Labels with -100 outside member `member`'s chunks (padded: of each row; packed: of each
    segment between `cu_seqlens`), each sequence cut into 2 x group_size equal chunks."""
    labels = tensors["labels"].clone()
    parts = 2 * group_size
    keep = torch.zeros_like(labels, dtype=torch.bool)
    bounds = ([(0, labels.shape[1])] if "cu_seqlens" not in tensors else
              list(zip(tensors["cu_seqlens"][:-1].tolist(), tensors["cu_seqlens"][1:].tolist(),
                       strict=True)))
    for lo, hi in bounds:
        assert (hi - lo) % parts == 0, f"a sequence of {hi - lo} does not divide by {parts}"
        size = (hi - lo) // parts
        for c in (member, parts - 1 - member):
            keep[:, lo + c * size:lo + (c + 1) * size] = True
    labels[~keep] = IGNORE_INDEX
    return labels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--dp-rank", type=int, required=True)
    ap.add_argument("--dp-size", type=int, required=True)
    ap.add_argument("--member", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    k = args.group_size
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port))
    dist.init_process_group("gloo", rank=args.dp_rank * k + args.member,
                            world_size=args.dp_size * k)
    torch.set_num_threads(1)
    ddp = DistributedDataParallel(tiny_model())
    out = {}
    for case in torch.load(args.cases, weights_only=True):
        # A step: this DP rank's batch; a global step: its micro-batches, accumulated.
        batches = []
        for mine in case["micros"][args.dp_rank]:
            b = StreamBatch(mine["tensors"])
            b.info = BatchInfo(**mine["info"])
            batches.append(b)
        ddp.zero_grad(set_to_none=True)
        shares, steps = [], 0
        for step in optimizer_steps(batches, ddp):  # no_sync on all but the last micro-batch
            steps += 1
            for b in step:
                inputs = {**b, "labels": share(b, args.member, k)}
                for name in ("cu_seqlens", "cu_seqlens_unpadded", "max_seqlen"):
                    inputs.pop(name, None)  # (the tiny model isolates samples by position_ids)
                loss, n = ddp(**inputs)
                (loss * (n * b.info.world_size * k / b.info.step_loss_tokens)).backward()
                shares.append(n)
        assert steps == 1
        out[case["name"]] = {"grad": flat_grad(ddp.module).clone(), "share_loss_tokens": shares}
    torch.save(out, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":  # (imports here: the test imports this module too)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "trainer"))
    from example_setup import exit_skipping_finalization

    main()
    exit_skipping_finalization(0)
