"""Hugging Face `Trainer` on an odb stream: the stream is the train dataloader.

    stream = BatchStream(endpoint, job, rank, world_size, token=...)
    trainer = StreamingTrainer(model=model, args=TrainingArguments(..., max_steps=N),
                               stream=stream)
    trainer.train()

The service already batches (token budget) and shards (one stream per rank), so the Trainer must
not re-batch or re-shard: `get_train_dataloader` returns `StreamDataLoader` unchanged. One pass
over it is one epoch of this rank (ends at the rank's END); the Trainer's next epoch is the
stream's next epoch. A stream has no length, so `max_steps` must be set. Step accounting: the
loader counts the samples and tokens it actually emitted (`samples_seen` / `tokens_seen` in the
logs), since batch sizes vary per step. Needs `accelerate` (a Trainer requirement).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainer_client.batch_stream import BatchStream
from trainer_client.decode import StreamBatch


def model_inputs(batch: StreamBatch) -> dict[str, torch.Tensor | int]:
    """The model's keyword arguments: packed batches get HF's flash-attention varlen names."""
    out: dict[str, Any] = dict(batch)
    if "cu_seqlens" in out:
        cu = out.pop("cu_seqlens")
        max_len = int(out.pop("max_seqlen"))
        out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len,
                   max_length_k=max_len)
    return out


class StreamDataLoader:
    """An iterable over one epoch per pass, counting what it emitted."""

    def __init__(self, stream: BatchStream) -> None:
        self.stream = stream
        self.samples_emitted = 0
        self.tokens_emitted = 0
        self.batches_emitted = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.stream:
            self.samples_emitted += batch.info.rank_samples
            self.tokens_emitted += batch.info.rank_tokens
            self.batches_emitted += 1
            yield model_inputs(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "samples": self.samples_emitted,
                "tokens": self.tokens_emitted, "batches": self.batches_emitted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.samples_emitted = state["samples"]
        self.tokens_emitted = state["tokens"]
        self.batches_emitted = state["batches"]


def _make_trainer_class() -> type:
    from transformers import Trainer  # heavy: imported only when StreamingTrainer is used

    class StreamingTrainer(Trainer):
        def __init__(self, *args: Any, stream: BatchStream, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.args.max_steps is None or self.args.max_steps <= 0:
                raise ValueError("StreamingTrainer needs TrainingArguments.max_steps > 0: "
                                 "a stream has no length")
            self.loader = StreamDataLoader(stream)

        def get_train_dataloader(self) -> StreamDataLoader:  # type: ignore[override]
            return self.loader

        def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            logs = {**logs, "samples_seen": self.loader.samples_emitted,
                    "tokens_seen": self.loader.tokens_emitted}
            super().log(logs, *args, **kwargs)

    return StreamingTrainer


def __getattr__(name: str) -> Any:
    """`StreamingTrainer` is built on first access (importing transformers.Trainer is slow)."""
    if name == "StreamingTrainer":
        cls = _make_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
