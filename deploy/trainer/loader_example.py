"""Plain PyTorch DDP on an odb stream through `StreamLoader`, checkpointed like torchdata's
`StatefulDataLoader` (the same state_dict conventions), no Join needed.

    torchrun --nproc-per-node=2 deploy/trainer/loader_example.py --max-steps 200 \
        --checkpoint ckpt.pt      # resumes from it when it exists

`StreamLoader(stream, align=True)`: a rank whose epoch ends first gets filler steps, so every
rank runs the same steps; its `state_dict()` goes into the checkpoint beside the model and the
optimizer, and `load_state_dict()` resumes every sample exactly once.
"""

from __future__ import annotations

import os
from pathlib import Path

from example_setup import causal_lm, exit_skipping_finalization, open_stream, parser, rank_and_world


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--save-steps", type=int, default=50)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainer_client import StreamLoader, causal_lm_loss

    rank, world = rank_and_world()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    model = causal_lm(args.model_dir).to(device or "cpu")
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    with open_stream(args, rank, world) as stream:
        loader = StreamLoader(stream, align=True)
        if args.checkpoint is not None and args.checkpoint.exists():
            state = torch.load(args.checkpoint, weights_only=False)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            loader.load_state_dict(state["data"])  # any rank's: aligned positions agree
        step = -1
        while not stream.done and step + 1 < args.max_steps:
            for batch in loader:
                inputs = batch.to_model_inputs(device, torch.bfloat16 if cuda else None)
                labels = inputs.pop("labels")
                loss = causal_lm_loss(ddp(**inputs).logits, labels, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step = batch.info.step  # global: the same on every rank
                if rank == 0 and step % 10 == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
                if args.checkpoint is not None and (step + 1) % args.save_steps == 0 \
                        and rank == 0:
                    torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                                "data": loader.state_dict()}, args.checkpoint)
                if step + 1 >= args.max_steps:
                    break
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_skipping_finalization(main())
