"""One gloo DDP trainer rank for the adapter tests: the tiny Qwen2 model fed through one adapter.

    python ddp_rank.py ADAPTER ENDPOINT JOB LOG [--stop-after STEP] [--state-out F] [--state-in F]
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment)

ADAPTER: loader (plain DDP loop over an aligned StreamLoader, timed with a ComputeClock by
hand), accelerate (joined_epoch), hf (StreamingTrainer), lightning (StreamDataModule); the last
three report compute by themselves. The learning rate is 0, so the weights never change and the
test can recompute every step's exact gradient; each step writes one JSON line: step, epoch,
filler, sample ids, the loss-token counts and the rank's all-reduced gradient (loader: also the
clock's compute seconds and the step's naive wall time, forward start to backward return).
`--slow-rank-sleep S` (loader): rank 1 sleeps S seconds inside each forward. `--no-compute`:
the adapter is built with `report_compute=False`.
`--stop-after STEP` ends the run after that global step (a checkpoint goes to --state-out, or
for lightning/hf to the given folder); `--state-in` resumes from it.
`--steps` (a job with global steps, docs/global-steps.md): each adapter's accumulating loop
(accelerate `joined_steps`, hf and lightning one item of micro-batches per optimizer step); one
line per optimizer step, its sample ids those of all this rank's micro-batches (`micros`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "trainer"))

from example_setup import exit_skipping_finalization
from tiny_lm import build_model, flat_grad

from trainer_client import BatchStream, StreamLoader, causal_lm_loss


class StepLog:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a")  # noqa: SIM115 (open for the life of the process)

    def write(self, info, model: torch.nn.Module, **timing: float | None) -> None:
        self.f.write(json.dumps({
            "step": info.step, "epoch": info.epoch, "filler": info.filler,
            "sample_ids": list(info.sample_ids), "rank_loss_tokens": info.rank_loss_tokens,
            "step_loss_tokens": info.step_loss_tokens, "grad": flat_grad(model),
            **timing}) + "\n")
        self.f.flush()

    def write_step(self, infos: list, model: torch.nn.Module) -> None:
        """One optimizer step of a global job: this rank's micro-batches together."""
        first = infos[0]
        assert [i.micro_index for i in infos] == list(range(first.micro_count))
        self.f.write(json.dumps({
            "step": first.step, "epoch": first.epoch, "opt": first.optimizer_step,
            "micros": len(infos), "filler": all(i.filler for i in infos),
            "sample_ids": [s for i in infos if not i.filler for s in i.sample_ids],
            "rank_loss_tokens": sum(i.rank_loss_tokens for i in infos),
            "step_loss_tokens": first.step_loss_tokens, "grad": flat_grad(model)}) + "\n")
        self.f.flush()


def forward_loss(model: torch.nn.Module, inputs) -> torch.Tensor:
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    return causal_lm_loss(logits, inputs["labels"], inputs)


def run_loader(args, stream: BatchStream, log: StepLog) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from trainer_client.compute_clock import ComputeClock

    dist.init_process_group("gloo")
    model = build_model()
    if args.slow_rank_sleep and dist.get_rank() == 1:  # inside the forward: its compute
        model.model.embed_tokens.register_forward_pre_hook(
            lambda *_: time.sleep(args.slow_rank_sleep))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    loader = StreamLoader(stream, align=True)
    if args.state_in:
        loader.load_state_dict(json.loads(Path(args.state_in).read_text()))
    measured: dict[int, float] = {}

    def report(batch, seconds: float) -> None:
        measured[batch.info.step] = seconds
        stream.report_compute(batch, seconds)

    clock = ComputeClock(report)
    clock.attach(ddp)
    while not stream.done:
        for batch in loader:
            if not batch.info.filler:
                clock.start(batch)
            began = time.perf_counter()
            loss = forward_loss(ddp, batch.to_model_inputs())
            loss.backward()
            wall = time.perf_counter() - began  # what timing the step naively gives
            clock.stop()
            log.write(batch.info, model, compute=measured.get(batch.info.step), wall=wall)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if batch.info.step == args.stop_after:
                out = Path(args.state_out.format(rank=dist.get_rank()))
                out.write_text(json.dumps(loader.state_dict()))
                dist.destroy_process_group()
                return
    dist.destroy_process_group()


def run_accelerate(args, stream: BatchStream, log: StepLog) -> None:
    from accelerate import Accelerator

    from trainer_client.accelerate_join import joined_epoch

    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2, acc.state
    model = build_model()
    wrapped, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    if args.steps:
        from trainer_client.accelerate_join import joined_steps

        while not stream.done:
            with joined_steps(acc, stream, [wrapped], report_compute=args.compute) as steps:
                for step in steps:
                    infos = []
                    for inputs in step:
                        acc.backward(forward_loss(wrapped, inputs))
                        infos.append(inputs.info)
                    log.write_step(infos, model)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        acc.end_training()
        return
    while not stream.done:
        with joined_epoch(acc, stream, [wrapped], report_compute=args.compute) as batches:
            for inputs in batches:
                acc.backward(forward_loss(wrapped, inputs))
                log.write(inputs.info, model)
                opt.step()
                opt.zero_grad(set_to_none=True)
    acc.end_training()


def run_hf(args, stream: BatchStream, log: StepLog) -> None:
    from transformers import TrainingArguments

    from trainer_client.hf_trainer import StreamingTrainer

    class LoggingTrainer(StreamingTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            info = inputs.info
            loss = super().training_step(model, inputs, num_items_in_batch)
            if args.steps:  # one item: this rank's micro-batches of the step
                log.write_step([b.info for b in inputs], self.model)
            else:
                log.write(info, self.model)
            return loss

    stop = args.stop_after is not None
    targs = TrainingArguments(
        output_dir=args.out_dir, max_steps=args.stop_after + 1 if stop else 100,
        learning_rate=0.0, lr_scheduler_type="constant", use_cpu=True, ddp_backend="gloo",
        report_to=[], logging_steps=1, disable_tqdm=True, max_grad_norm=0.0,
        save_strategy="steps" if stop else "no", save_steps=args.stop_after + 1 if stop else 500)
    trainer = LoggingTrainer(model=build_model(), args=targs, stream=stream,
                             report_compute=args.compute)
    trainer.train(resume_from_checkpoint=args.state_in)


def run_lightning(args, stream: BatchStream, log: StepLog) -> None:
    import pytorch_lightning as pl

    from trainer_client.lightning_data import StreamDataModule

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model()
            self.info = None

        def training_step(self, batch, batch_idx):
            if args.steps:  # this rank's micro-batches of a global step
                from trainer_client.lightning_data import accumulate_loss

                self.info = [b.info for b in batch]
                return accumulate_loss(self, batch, lambda b: forward_loss(self.model, b))
            self.info = batch.info
            return forward_loss(self.model, batch)

        def on_after_backward(self) -> None:
            if not args.steps:
                log.write(self.info, self.model)

        def on_before_optimizer_step(self, optimizer) -> None:
            if args.steps:  # (after every micro-batch's backward and the one all-reduce)
                log.write_step(self.info, self.model)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    stop = args.stop_after is not None
    callbacks = []
    if stop:  # a checkpoint taken during training, as a user's ModelCheckpoint does
        from pytorch_lightning.callbacks import ModelCheckpoint

        out = Path(args.state_out)
        callbacks.append(ModelCheckpoint(dirpath=out.parent, filename=out.stem, save_top_k=-1,
                                         every_n_train_steps=args.stop_after + 1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp",
                         max_epochs=2, max_steps=args.stop_after + 1 if stop else -1,
                         logger=False, enable_checkpointing=stop, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(Module(), datamodule=StreamDataModule(stream, report_compute=args.compute),
                ckpt_path=args.state_in)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("adapter", choices=["loader", "accelerate", "hf", "lightning"])
    p.add_argument("endpoint")
    p.add_argument("job")
    p.add_argument("log")
    p.add_argument("--stop-after", type=int)
    p.add_argument("--state-out")
    p.add_argument("--state-in")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--slow-rank-sleep", type=float, default=0.0)
    p.add_argument("--no-compute", dest="compute", action="store_false")
    p.add_argument("--steps", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stream = BatchStream(args.endpoint, args.job, rank, world, prefetch=2)
    run = {"loader": run_loader, "accelerate": run_accelerate, "hf": run_hf,
           "lightning": run_lightning}[args.adapter]
    run(args, stream, StepLog(args.log))
    stream.close()
    return 0


if __name__ == "__main__":
    exit_skipping_finalization(main())
