"""Hugging Face `Trainer` on an odb stream: the stream is the train dataloader.

    stream = BatchStream(endpoint, job, rank, world_size, token=...)
    trainer = StreamingTrainer(model=model, args=TrainingArguments(..., max_steps=N),
                               stream=stream)
    trainer.train()                     # or train(resume_from_checkpoint=dir)

The service already batches (token budget) and shards (one stream per rank), so the Trainer must
not re-batch or re-shard: `get_train_dataloader` returns a `StreamLoader` as it is. One pass over
it is one epoch of the stream. A stream has no length, so `max_steps` must be set.

Join mode without Join: the Trainer runs collectives of its own (gradient all-reduce, logging
gathers), so a rank that reached its END cannot just stop. The loader is aligned: such a rank
runs filler steps of zero gradient until the epoch's last step, and every rank runs the same
number of optimizer steps (see trainer_client.loader).

Exact loss: `compute_loss` is this rank's token-sum cross-entropy * world_size /
step_loss_tokens (`causal_lm_loss`), from the step info every batch carries: after DDP's average
the gradient is that of the mean over all loss tokens of the step, with no extra collective.
The model must return `.logits` of a causal LM.

Gradient accumulation comes from the stream, not from `gradient_accumulation_steps` (leave it
at 1): with the job's `batching.global_token_budget` (docs/global-steps.md) each optimizer step
is one global step, whose micro-batches this rank may have more or fewer of than another. The
dataloader yields each step's micro-batches as one item (`accumulate.MicroBatches`) and
`training_step` runs them in order, all but the last under the accelerator's `no_sync`, so
DDP's all-reduce runs once per step on every rank; `max_steps` counts global steps.

Compute balancing (docs/compute-balancing.md): each real step's compute (from the model's forward
to the end of this rank's backward, without the wait in DDP's gradient all-reduce; see
trainer_client.compute_clock) is reported on the stream by itself; filler steps are not.
`report_compute=False` turns that off (for a trainer that reports by hand). Timed on DDP or a
single device; a strategy that replaces the parameters (FSDP, DeepSpeed ZeRO-3) is not timed.

Checkpoints: each rank writes its loader state next to the Trainer's checkpoint
(`odb_stream_rank<r>.json`); `train(resume_from_checkpoint=...)` restores it and turns off the
Trainer's data skipping (which would consume and lose batches). Needs transformers + accelerate,
imported only when `StreamingTrainer` is first used.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from trainer_client.accumulate import MicroBatches, group_steps
from trainer_client.batch_stream import BatchStream
from trainer_client.loader import StreamLoader
from trainer_client.loss import causal_lm_loss

STATE_FILE = "odb_stream_rank{rank}.json"


class _Steps:
    """The Trainer's dataloader: one item per optimizer step (a batch, or a global step's
    micro-batches as one `MicroBatches`), one pass per epoch of the loader."""

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return group_steps(self.loader)


def _make_trainer_class() -> type:
    from transformers import Trainer  # heavy: imported only when StreamingTrainer is used
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    from trainer_client.compute_clock import ComputeClock

    class StreamingTrainer(Trainer):
        def __init__(self, *args: Any, stream: BatchStream, report_compute: bool = True,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.args.max_steps is None or self.args.max_steps <= 0:
                raise ValueError("StreamingTrainer needs TrainingArguments.max_steps > 0: "
                                 "a stream has no length")
            if self.args.gradient_accumulation_steps != 1:
                raise ValueError(
                    "StreamingTrainer takes gradient accumulation from the stream: leave "
                    "gradient_accumulation_steps at 1 and give the job a "
                    "batching.global_token_budget (each optimizer step is then one global step, "
                    "accumulated over this rank's micro-batches; docs/global-steps.md)")
            self.stream = stream
            self.loader = StreamLoader(stream, align=True)
            self.compute_clock = ComputeClock(stream.report_compute) if report_compute else None
            self._trained_state: dict[str, Any] | None = None
            self.samples_seen = 0
            self.tokens_seen = 0
            # Our loss is already normalized: no token count gathered across ranks, no
            # division by the accumulation steps.
            self.model_accepts_loss_kwargs = False
            self.loss_is_scaled_for_ga = True

        def get_train_dataloader(self) -> _Steps:  # type: ignore[override]
            return _Steps(self.loader)

        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            clock = self.compute_clock
            if clock is None or inputs.info.filler:
                return self._accumulated(model, inputs, *args, **kwargs)
            clock.attach(model)  # the model as wrapped (DDP), known from the first step on
            clock.start(inputs)
            loss = self._accumulated(model, inputs, *args, **kwargs)
            clock.stop()  # reported now: it rides on the ack of the next batch taken
            return loss

        def _accumulated(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            """One optimizer step: a batch, or a global step's micro-batches in order with the
            gradient all-reduce on the last only."""
            if not isinstance(inputs, MicroBatches):
                return super().training_step(model, inputs, *args, **kwargs)
            total = None
            for i, micro in enumerate(inputs):
                sync = i == len(inputs) - 1
                with (contextlib.nullcontext() if sync else self.accelerator.no_sync(model)):
                    loss = super().training_step(model, micro, *args, **kwargs)
                total = loss if total is None else total + loss
            return total

        def _prepare_inputs(self, inputs: Any) -> Any:
            if inputs.info.last_micro:  # (a step's last micro-batch: its position is a step's)
                self._trained_state = inputs.loader_state  # the position to checkpoint
            dtype = getattr(self.model, "dtype", None)
            if not inputs.info.filler:
                self.samples_seen += inputs.info.rank_samples
                self.tokens_seen += inputs.info.rank_tokens
            return inputs.to_model_inputs(self.args.device,
                                          dtype if getattr(dtype, "is_floating_point", False)
                                          else None)

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            labels = inputs["labels"]
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
            loss = causal_lm_loss(logits, labels, inputs.info)
            return (loss, outputs) if return_outputs else loss

        def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            logs = {**logs, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen}
            super().log(logs, *args, **kwargs)

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            super()._save_checkpoint(model, trial)
            folder = os.path.join(self._get_output_dir(trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, STATE_FILE.format(rank=self.stream.rank))
            with open(path + ".tmp", "w") as f:
                json.dump(self._trained_state or self.loader.state_dict(), f)
            os.replace(path + ".tmp", path)

        def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
                  **kwargs: Any) -> Any:
            if resume_from_checkpoint is True:
                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
                if resume_from_checkpoint is None:
                    raise ValueError(f"no checkpoint in {self.args.output_dir} to resume from")
            if isinstance(resume_from_checkpoint, str):
                path = os.path.join(resume_from_checkpoint,
                                    STATE_FILE.format(rank=self.stream.rank))
                if not os.path.exists(path):
                    raise FileNotFoundError(f"{path}: no stream position in the checkpoint "
                                            "(was it written by StreamingTrainer?)")
                with open(path) as f:
                    self.loader.load_state_dict(json.load(f))
                self.args.ignore_data_skip = True  # skipping would consume the stream
            out = super().train(resume_from_checkpoint, *args, **kwargs)
            if self.compute_clock is not None:
                self.compute_clock.flush()
            return out

    return StreamingTrainer


def __getattr__(name: str) -> Any:
    """`StreamingTrainer` is built on first access (importing transformers.Trainer is slow)."""
    if name == "StreamingTrainer":
        cls = _make_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
