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
That needs one batch per optimizer step (`gradient_accumulation_steps=1`; raise the service's
token budget instead). The model must return `.logits` of a causal LM.

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

import json
import os
from typing import Any

from trainer_client.batch_stream import BatchStream
from trainer_client.loader import StreamLoader
from trainer_client.loss import causal_lm_loss

STATE_FILE = "odb_stream_rank{rank}.json"


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
                raise ValueError("StreamingTrainer needs gradient_accumulation_steps=1 (exact "
                                 "loss scaling is per step); raise the job's token budget")
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

        def get_train_dataloader(self) -> StreamLoader:  # type: ignore[override]
            return self.loader

        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            clock = self.compute_clock
            if clock is None or inputs.info.filler:
                return super().training_step(model, inputs, *args, **kwargs)
            clock.attach(model)  # the model as wrapped (DDP), known from the first step on
            clock.start(inputs)
            loss = super().training_step(model, inputs, *args, **kwargs)
            clock.stop()  # reported now: it rides on the ack of the next batch taken
            return loss

        def _prepare_inputs(self, inputs: Any) -> Any:
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
