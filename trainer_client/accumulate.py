"""Gradient accumulation over a global step's micro-batches, done one way that cannot go wrong.

With `batching.global_token_budget` (docs/global-steps.md) a step's samples are chosen for the
whole world and split over the ranks into micro-batches of up to `token_budget`; a rank may get
more micro-batches than another in the same step. Each rank accumulates its own into one
optimizer step. Under DDP the gradient all-reduce must then run exactly once per step on every
rank, on its last micro-batch, and never on the others:

    from trainer_client.accumulate import optimizer_steps

    for step in optimizer_steps(stream, ddp_model):    # one optimizer step at a time
        for batch in step:                             # under ddp_model.no_sync() but the last
            inputs = batch.to_model_inputs(device)
            labels = inputs.pop("labels")
            causal_lm_loss(ddp_model(**inputs).logits, labels, batch).backward()
        opt.step()
        opt.zero_grad()

`causal_lm_loss` (and `loss_scale`) scale each micro-batch by the totals of the whole step, so
the accumulated, all-reduced gradient is that of the mean over every loss token of the step,
whatever the world size and however the step was split (no extra collective). A rank whose
share of a step is a filler (a step with fewer samples than ranks) runs it like any batch: its
loss weight is zero and its backward keeps the all-reduce in step with the other ranks.

What the helper enforces: the micro-batches of a step come in order (a resumed stream restarts a
step at its first), the forward and backward of all but the last run under `no_sync` (the
context is entered before each of those batches is handed out and left when the loop asks for
the next), and a step left before its last micro-batch is an error at the next step, never a
silent optimizer step on part of a gradient. Without global steps every batch is a step of one:
the same loop is right for both kinds of job.

`MicroBatches` is one step's micro-batches as one value, for runtimes that take one "batch"
per optimizer step (the HF Trainer and Lightning adapters); `group_steps` makes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from trainer_client.decode import BatchInfo, StreamBatch

NoSync = Callable[[], AbstractContextManager[Any]]


class StepOutOfOrder(RuntimeError):
    """A step's micro-batches did not come whole and in order (or a step was left early)."""


def _check_next(info: BatchInfo, step: int, index: int) -> None:
    if info.step != step or info.micro_index != index:
        raise StepOutOfOrder(
            f"expected micro-batch {index} of step {step}, got micro-batch {info.micro_index} "
            f"of step {info.step}: a step's micro-batches accumulate whole and in order")


class MicroBatches(list):
    """One rank's micro-batches of one global step, in order (a list of `StreamBatch` or
    `ModelInputs`). `info` is its last micro-batch's (the step, its optimizer step, the
    rank's micro-batch count); `loader_state` the loader's state after it (set by
    `group_steps` from a `StreamLoader`)."""

    info: BatchInfo
    loader_state: dict[str, Any] | None = None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            raise TypeError(
                f"this is one optimizer step's {len(self)} micro-batch(es) (a job with global "
                f"steps), not a batch: no key {key!r}. Accumulate them: "
                "trainer_client.lightning_data.accumulate_loss, or iterate them in order")
        return super().__getitem__(key)


def group_steps(batches: Iterable[Any]) -> Iterator[Any]:
    """The batches of a stream or loader, each global step's micro-batches gathered into one
    `MicroBatches` (checked whole and in order); a batch of a job without global steps is
    passed on as it is."""
    it = iter(batches)
    for batch in it:
        info = batch.info
        if info.optimizer_step is None:
            yield batch
            continue
        _check_next(info, info.step, 0)
        group = MicroBatches([batch])
        for index in range(1, info.micro_count):
            nxt = next(it, None)
            if nxt is None:
                raise StepOutOfOrder(f"step {info.step} ended after {index} of its "
                                     f"{info.micro_count} micro-batches")
            _check_next(nxt.info, info.step, index)
            group.append(nxt)
        group.info = group[-1].info
        group.loader_state = getattr(group[-1], "loader_state", None)
        yield group


class AccumulationStep:
    """One optimizer step of this rank: iterate it once for its micro-batches (see the module
    docstring); `info` is its first micro-batch's."""

    def __init__(self, first: StreamBatch, rest: Iterator[StreamBatch], no_sync: NoSync) -> None:
        self.info = first.info
        self._first = first
        self._rest = rest
        self._no_sync = no_sync
        self.taken = 0  # micro-batches handed out so far
        self._iterated = False

    @property
    def micro_count(self) -> int:
        return self.info.micro_count

    @property
    def done(self) -> bool:
        return self.taken == self.micro_count

    def __iter__(self) -> Iterator[StreamBatch]:
        if self._iterated:
            raise StepOutOfOrder(f"step {self.info.step} is iterated once")
        self._iterated = True
        n = self.micro_count
        for index in range(n):
            if index == 0:
                batch = self._first
            else:
                batch = next(self._rest, None)
                if batch is None:
                    raise StepOutOfOrder(f"step {self.info.step} ended after {index} of its "
                                         f"{n} micro-batches")
                _check_next(batch.info, self.info.step, index)
            self.taken = index + 1
            if index < n - 1:
                with self._no_sync():  # forward and backward of this one: no all-reduce
                    yield batch
            else:
                yield batch  # the last: DDP's all-reduce runs in its backward


def _no_sync_of(model: Any) -> NoSync:
    no_sync = getattr(model, "no_sync", None) if model is not None else None
    return no_sync if no_sync is not None else contextlib.nullcontext


def optimizer_steps(batches: Iterable[StreamBatch], model: Any = None, *,
                    no_sync: NoSync | None = None) -> Iterator[AccumulationStep]:
    """This rank's batches (a `BatchStream`, a `StreamLoader`, or any iterable of them) as
    optimizer steps. Gradients are synchronized only on each step's last micro-batch:
    `no_sync` is the context that turns the all-reduce off (default: `model.no_sync`, which
    DDP and FSDP have; none for a model without it). Raises `StepOutOfOrder` when a step was
    left before its last micro-batch."""
    ctx = no_sync if no_sync is not None else _no_sync_of(model)
    it = iter(batches)
    prev: AccumulationStep | None = None
    for first in it:
        if prev is not None and not prev.done:
            raise StepOutOfOrder(
                f"step {prev.info.step} was left after {prev.taken} of its {prev.micro_count} "
                "micro-batches: its optimizer step would hold part of its gradient")
        _check_next(first.info, first.info.step, 0)
        prev = AccumulationStep(first, it, ctx)
        yield prev
