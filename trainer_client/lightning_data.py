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

Lightning has no Join, and every rank must run the same number of steps (its own collectives,
DDP's all-reduce): the loader is aligned, so a rank that reached its END runs filler steps of
zero gradient until the epoch's last step (see trainer_client.loader). One Lightning epoch is
one epoch of the stream. Batches reach the device as `ModelInputs` (ids widened, pixels
normalized there) through the data module's `transfer_batch_to_device`.

Checkpoints: `state_dict()` is the loader's (torchdata conventions) as of the batch last moved
to the device (Lightning fetches one batch ahead), so every Lightning checkpoint carries the
stream's position under the data module's key; the aligned position is the same on every rank,
so the rank-0 checkpoint restores all ranks exactly once. Imports `lightning.pytorch` (or
`pytorch_lightning`) when `StreamDataModule` is first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

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
    the data module's — that of the batch trained, not of the one Lightning fetched ahead."""

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)


def _make_datamodule_class() -> type:
    pl = _lightning()

    class StreamDataModule(pl.LightningDataModule):
        def __init__(self, stream: BatchStream, *, dtype: Any = None) -> None:
            super().__init__()
            self.stream = stream
            self.dtype = dtype
            self.loader = StreamLoader(stream, align=True)
            self._trained_state: dict[str, Any] | None = None

        def train_dataloader(self) -> _Epochs:
            return _Epochs(self.loader)

        def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
            self._trained_state = batch.loader_state  # this batch is the one being trained
            return batch.to_model_inputs(device, self.dtype)

        def state_dict(self) -> dict[str, Any]:
            if self._trained_state is not None:
                return dict(self._trained_state)
            return self.loader.state_dict()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loader.load_state_dict(state_dict)

    return StreamDataModule


def __getattr__(name: str) -> Any:
    """`StreamDataModule` is built on first access (Lightning is imported then)."""
    if name == "StreamDataModule":
        cls = _make_datamodule_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
