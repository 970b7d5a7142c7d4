"""PyTorch Lightning on an odb stream: a `LightningDataModule` whose train dataloader is the
rank's stream, aligned for join mode, checkpointed with the stream's position.

    stream = BatchStream(endpoint, job, trainer_rank, world_size, token=...)
    dm = StreamDataModule(stream)                        # dtype= for pixel values
    trainer = pl.Trainer(strategy="ddp", max_epochs=..., use_distributed_sampler=False)
    trainer.fit(module, datamodule=dm)                   # or ckpt_path=... to resume

    def training_step(self, batch, batch_idx):           # in the LightningModule
        labels = batch["labels"]
        logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return causal_lm_loss(logits, labels, batch)     # exact cross-rank scaling

Global steps (a job with `batching.global_token_budget`, docs/global-steps.md): each item the
data module yields is one optimizer step, this rank's micro-batches of a global step
(`accumulate.MicroBatches` of `ModelInputs`; a rank may have more than another). Lightning's
own `accumulate_grad_batches` counts batches and cannot follow that, so leave it at 1 and let
`accumulate_loss` run them in training_step: the gradient of each but the last micro-batch is
taken there (no all-reduce, nothing left in `.grad` for Lightning's zero_grad to clear) and
carried into the last one's loss, whose one backward by Lightning adds them all up and runs
DDP's one all-reduce of the step (automatic optimization, clipping and schedulers as usual):

    def training_step(self, batch, batch_idx):
        def loss(inputs):
            logits = self.model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
            return causal_lm_loss(logits, inputs["labels"], inputs)
        return accumulate_loss(self, batch, loss)          # a plain batch: loss(batch)

The same training_step serves a job without global steps (a batch is then passed to `loss`).

Lightning has no Join, and every rank must run the same number of steps (its own collectives,
DDP's all-reduce): the loader is aligned, so a rank that reached its END runs filler steps of
zero gradient until the epoch's last step (see trainer_client.loader). One Lightning epoch is
one epoch of the stream. Batches reach the device as `ModelInputs` (ids widened, pixels
normalized there) through the data module's `transfer_batch_to_device`.

Compute balancing (docs/compute-balancing.md): the data module reports each real step's compute
on the stream by itself, no callback to add: from the forward of the model Lightning wrapped
(`trainer.strategy.model`, DDP's inner module) to the end of this rank's backward, without the
wait in DDP's gradient all-reduce (trainer_client.compute_clock). The clock starts when the batch
moves to the device and stops when Lightning fetches its next batch; filler steps are not timed.
Lightning fetches one batch ahead, so the job's final END reaches the stream before each rank's
last step is trained: that one step's compute is not sent (the stream's side is closed by then).
`report_compute=False` turns reporting off. Timed on DDP or a single device; a strategy that
replaces the parameters (FSDP, DeepSpeed) is not timed.

Checkpoints: `state_dict()` is the loader's (torchdata conventions) as of the batch last moved
to the device (Lightning fetches one batch ahead), so every Lightning checkpoint carries the
stream's position under the data module's key; the aligned position is the same on every rank,
so the rank-0 checkpoint restores all ranks exactly once. Imports `lightning.pytorch` (or
`pytorch_lightning`) when `StreamDataModule` is first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

from trainer_client.accumulate import MicroBatches, group_steps
from trainer_client.batch_stream import BatchStream
from trainer_client.loader import StreamLoader


def _lightning() -> Any:
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("StreamDataModule needs `lightning` or `pytorch-lightning` installed")


class _Epochs:
    """What Lightning iterates: deliberately not stateful, so the only position checkpointed is
    the data module's — that of the batch trained, not of the one Lightning fetched ahead.
    Lightning asks for a batch once the step before is over: the clock stops first, so that
    step's compute rides on the ack of this take (`stopping_before_each`)."""

    def __init__(self, loader: StreamLoader, clock: Any) -> None:
        self.loader = loader
        self.clock = clock  # a ComputeClock, or None: not timed

    def __iter__(self) -> Iterator[Any]:
        if self.clock is None:
            return group_steps(self.loader)
        from trainer_client.compute_clock import stopping_before_each

        return group_steps(stopping_before_each(self.loader, self.clock))


def accumulate_loss(module: Any, batch: Any, loss: Callable[[Any], Any]) -> Any:
    """The loss `training_step` returns for `batch` (a LightningModule's, under automatic
    optimization): `loss(batch)`, or for a global step's micro-batches (`MicroBatches`) the last
    one's loss plus a term worth 0 whose gradient is the sum of the earlier ones' gradients
    (each taken here with `torch.autograd.grad` as it comes, its graph freed at once), so
    Lightning's one backward leaves the step's accumulated gradient, all-reduced once. Its
    value is the sum of all their losses. (Under 16-bit mixed precision the earlier gradients
    are taken unscaled: prefer bf16 or full precision.)"""
    if not isinstance(batch, MicroBatches):
        return loss(batch)
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    carried: list[Any] = [None] * len(params)
    earlier = None
    for micro in batch[:-1]:
        value = loss(micro)
        grads = torch.autograd.grad(value, params, allow_unused=True)
        carried = [g if c is None else c if g is None else c + g
                   for c, g in zip(carried, grads, strict=True)]
        earlier = value.detach() if earlier is None else earlier + value.detach()
    last = loss(batch[-1])
    if earlier is None:
        return last
    carry = sum((p * g).sum() for p, g in zip(params, carried, strict=True) if g is not None)
    return last + (carry - carry.detach()) + earlier


def _make_datamodule_class() -> type:
    pl = _lightning()
    from trainer_client.compute_clock import ComputeClock

    class StreamDataModule(pl.LightningDataModule):
        def __init__(self, stream: BatchStream, *, dtype: Any = None,
                     report_compute: bool = True) -> None:
            super().__init__()
            self.stream = stream
            self.dtype = dtype
            self.loader = StreamLoader(stream, align=True)
            self.compute_clock = ComputeClock(stream.report_compute) if report_compute else None
            self._trained_state: dict[str, Any] | None = None

        def train_dataloader(self) -> _Epochs:
            return _Epochs(self.loader, self.compute_clock)

        def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
            self._trained_state = batch.loader_state  # this batch is the one being trained
            clock = self.compute_clock
            if clock is not None and not batch.info.filler and self.trainer is not None:
                clock.attach(self.trainer.strategy.model)  # wrapped (DDP) by now
                clock.start(batch)
            if isinstance(batch, MicroBatches):  # a global step: its micro-batches, in order
                out = MicroBatches(b.to_model_inputs(device, self.dtype) for b in batch)
                out.info, out.loader_state = batch.info, batch.loader_state
                return out
            return batch.to_model_inputs(device, self.dtype)

        def teardown(self, stage: str) -> None:
            if self.compute_clock is not None:
                self.compute_clock.flush()

        def state_dict(self) -> dict[str, Any]:
            if self._trained_state is not None:
                return dict(self._trained_state)
            return self.loader.state_dict()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loader.load_state_dict(state_dict)

    return StreamDataModule


def __getattr__(name: str) -> Any:
    """`StreamDataModule` is built on first access (Lightning is imported then);
    `accumulate_loss` imports nothing."""
    if name == "StreamDataModule":
        cls = _make_datamodule_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
