"""One trainer rank of the demo: gloo DDP on the tiny model, fed by `trainer_client`.

    python -m pipeline.demo.train_rank --rank R --world-size W --master-port P --log FILE \
        (--endpoint HOST:PORT --job ID | --fixed-batches FILE)

Stream mode is what a user's training loop looks like: `BatchStream` + `Join` (ranks may end at
different steps) + exact loss scaling from the step info. Fixed mode replays pre-collated
fixed-size batches (the "Standard" baseline) through the very same model and loop.
Writes one JSON line per step: step, sample ids, real/padded tokens, wait and compute seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from pipeline.demo.tiny_model import TinyCausalLM

Batches = Iterator[tuple[dict, dict]]


def _stream_epochs(args: argparse.Namespace) -> Iterator[Batches]:
    """One iterator per epoch: each ends at this rank's in-band END for that epoch."""
    from trainer_client import BatchStream, loss_scale

    token = os.environ.get(args.token_env) if args.token_env else None

    def epoch_batches(stream: BatchStream) -> Batches:
        for batch in stream:
            info = batch.info
            yield dict(batch), {
                "epoch": info.epoch, "step": info.step, "sample_ids": list(info.sample_ids),
                "scale": loss_scale(batch), "step_samples": info.step_samples,
            }

    with BatchStream(args.endpoint, args.job, args.rank, args.world_size, token=token,
                     prefetch=args.prefetch) as stream:
        while not stream.done:
            yield epoch_batches(stream)


def _fixed_epochs(args: argparse.Namespace) -> Iterator[Batches]:
    plan = torch.load(args.fixed_batches, weights_only=False)

    def batches() -> Batches:
        for step, batch in enumerate(plan["ranks"][args.rank]):
            tensors = {k: torch.as_tensor(v) for k, v in batch["tensors"].items()}
            yield tensors, {"epoch": 0, "step": step, "sample_ids": batch["sample_ids"],
                            "scale": 1.0, "step_samples": batch["step_samples"]}

    yield batches()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--endpoint")
    p.add_argument("--job")
    p.add_argument("--token-env")
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--fixed-batches")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # W ranks share the machine's cores
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.master_port)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    model = DistributedDataParallel(TinyCausalLM())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    epochs = _fixed_epochs(args) if args.fixed_batches else _stream_epochs(args)

    with open(args.log, "w") as log:
        for batches in epochs:
            # Join per epoch: a rank that got fewer steps shadows the others' all-reduces.
            with Join([model]):
                _train_epoch(args, model, opt, batches, log)
    # No rank tears gloo down while a peer is still in a collective (an exit-time abort).
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _train_epoch(args, model, opt, batches: Batches, log) -> None:
    while True:
        t0 = time.perf_counter()
        try:
            tensors, meta = next(batches)
        except StopIteration:
            return
        t1 = time.perf_counter()
        loss, n = model(**tensors)
        (loss * meta["scale"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        ids = tensors["input_ids"]
        real = int(tensors["attention_mask"].sum()) if "attention_mask" in tensors \
            else int(ids.numel())
        log.write(json.dumps({
            **meta, "rank": args.rank, "loss": float(loss), "loss_tokens": n,
            "real_tokens": real, "padded_tokens": int(ids.numel()),
            "wait_s": t1 - t0, "compute_s": t2 - t1, "t": time.time(),
        }) + "\n")
        log.flush()


if __name__ == "__main__":
    raise SystemExit(main())
