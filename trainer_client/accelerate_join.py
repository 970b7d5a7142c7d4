"""Accelerate on an odb stream in join mode: `accelerator.join_uneven_inputs` around each epoch.

    accelerator = Accelerator()
    model, opt = accelerator.prepare(model, opt)       # never prepare the stream: it is sharded
    stream = BatchStream(endpoint, job, accelerator.process_index, accelerator.num_processes)
    while not stream.done:
        with joined_epoch(accelerator, stream, [model]) as batches:
            for inputs in batches:                       # ModelInputs on accelerator.device
                logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
                accelerator.backward(causal_lm_loss(logits, inputs["labels"], inputs))
                opt.step(); opt.zero_grad()

Global steps (a job with `batching.global_token_budget`, docs/global-steps.md): iterate
`joined_steps` instead, one optimizer step per item, each this rank's micro-batches of a global
step (all but the last under `accelerator.no_sync(model)`: one all-reduce per step):

    with joined_steps(accelerator, stream, [model]) as steps:
        for step in steps:
            for inputs in step:                          # ModelInputs, in micro-batch order
                logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
                accelerator.backward(causal_lm_loss(logits, inputs["labels"], inputs))
            opt.step(); opt.zero_grad()

(every batch of a job without global steps is a step of one, so this loop is right for both;
`joined_epoch` refuses a job with global steps, whose batches are not optimizer steps).

Ranks may end an epoch at different steps: inside the context a rank that reached its END
shadows the gradient all-reduces of the ranks still training (torch's `Join`, dividing by the
full world size as `causal_lm_loss` assumes), and leaves the context when every rank has
finished the epoch. Leaving the loop early (`break`) is fine; raising inside skips the join.
Only the DDP all-reduce is shadowed: do no other collective inside the context.

Compute balancing (docs/compute-balancing.md): the yielded batches are timed by themselves, no
user code: the clock (trainer_client.compute_clock) is armed when a batch is yielded, starts at
the forward of a model among `joinables` (for a DDP model, its inner module's forward, after
DDP's buffer broadcast) and ends when this rank's backward computed its last gradient, before
the wait in DDP's all-reduce; so the optimizer step, logging and anything else done between
backward and the next batch are not counted. The time is reported when the loop asks for the
next batch (or leaves the epoch), so it rides on that batch's ack. With gradient accumulation
each batch's own forward and backward are timed (`no_sync` steps too). `report_compute=False`
turns this off (for a loop that times by hand with `stream.timed`). Timed on DDP or a single
device; a strategy that replaces the parameters (FSDP, DeepSpeed) is not timed.

`join_uneven_inputs` enables the join only with `even_batches=False` (its default assumes
dataloaders that accelerate evened out, which a stream is not), so that is passed. Accelerate
joins on accelerator devices only; on CPU ranks (gloo) it would silently skip the join, so torch's
`Join` is entered directly there. `accelerate` is imported by the caller, never by this module.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from trainer_client.accumulate import AccumulationStep, optimizer_steps
from trainer_client.batch_stream import BatchStream
from trainer_client.decode import ModelInputs


@contextmanager
def joined_epoch(accelerator: Any, stream: BatchStream, joinables: Sequence[Any], *,
                 dtype: Any = None, report_compute: bool = True
                 ) -> Iterator[Iterator[ModelInputs]]:
    """One epoch of this rank's batches as model inputs on the accelerator's device, under
    `accelerator.join_uneven_inputs(joinables)`; pixel values in `dtype` (default float32).
    Each batch's compute is reported on the stream unless `report_compute=False`. A job with
    global steps is refused at its first batch: iterate `joined_steps`."""
    with _joined(accelerator, stream, joinables, dtype, report_compute, steps=False) as b:
        yield b


@contextmanager
def joined_steps(accelerator: Any, stream: BatchStream, joinables: Sequence[Any], *,
                 dtype: Any = None, report_compute: bool = True
                 ) -> Iterator[Iterator[AccumulationStep]]:
    """As `joined_epoch`, one optimizer step per item (`accumulate.AccumulationStep`: iterate
    it for its micro-batches as model inputs, all but the last under
    `accelerator.no_sync(model)`, the model being the first torch module of `joinables`).

    The join is entered only for a job without global steps (at its first batch, or at its
    END when the rank got none): with global steps every rank runs every step, and a join's
    per-forward collective cannot follow ranks running different numbers of micro-batches."""
    with _joined(accelerator, stream, joinables, dtype, report_compute, steps=True) as steps:
        yield steps


@contextmanager
def _joined(accelerator: Any, stream: BatchStream, joinables: Sequence[Any], dtype: Any,
            report_compute: bool, *, steps: bool) -> Iterator[Iterator[Any]]:
    def join() -> Any:  # (made when entered: a torch Join turns DDP's join hook on at once)
        if accelerator.num_processes > 1 and not getattr(accelerator, "multi_device", True):
            from torch.distributed.algorithms.join import Join

            return Join(list(joinables), throw_on_early_termination=False)
        return accelerator.join_uneven_inputs(list(joinables), even_batches=False)

    clock = _clock_for(stream, joinables) if report_compute else None
    lazy = contextlib.ExitStack()  # steps: the join, once the job is known to need it
    batches = _inputs(stream, clock, accelerator.device, dtype, steps=steps,
                      join=(lambda: lazy.enter_context(join())) if steps else None)
    try:
        with contextlib.nullcontext() if steps else join(), lazy:
            if steps:
                model = _model_of(joinables)
                yield optimizer_steps(batches, no_sync=(
                    (lambda: accelerator.no_sync(model)) if model is not None else None))
            else:
                yield batches
    finally:
        batches.close()  # a loop left early: its last batch is reported now
        if clock is not None:
            clock.close()


def _inputs(stream: BatchStream, clock: Any, device: Any, dtype: Any, *, steps: bool,
            join: Callable[[], Any] | None) -> Generator[ModelInputs, None, None]:
    """`join`: enter the join now (a job without global steps, found at its first batch or
    at the END of a rank that got none)."""
    batches: Any = stream
    if clock is not None:
        from trainer_client.compute_clock import stopping_before_each

        batches = stopping_before_each(stream, clock)
    first = True
    for batch in batches:
        if first and join is not None and batch.info.optimizer_step is None:
            join()
        first = False
        if not steps and batch.info.optimizer_step is not None:
            raise ValueError(
                f"job {stream.job!r} has global steps (batching.global_token_budget): its "
                "batches are micro-batches, not optimizer steps; iterate joined_steps(...) "
                "instead of joined_epoch(...)")
        if clock is not None:
            clock.start(batch)
        yield batch.to_model_inputs(device, dtype)
    if first and join is not None:
        join()


def _model_of(joinables: Sequence[Any]) -> Any:
    """The first torch module among `joinables` (what `no_sync` is entered for), or None."""
    import torch

    return next((j for j in joinables if isinstance(j, torch.nn.Module)), None)


def _clock_for(stream: BatchStream, joinables: Sequence[Any]) -> Any:
    """A clock attached to the models among `joinables`, or None (with a warning) if none is."""
    import torch

    from trainer_client.compute_clock import ComputeClock

    models = [j for j in joinables if isinstance(j, torch.nn.Module)]
    if not models:
        warnings.warn("joined_epoch: no torch module among joinables, so the batches' compute "
                      "is not timed (report it with stream.timed, or pass the model)",
                      stacklevel=4)
        return None
    clock = ComputeClock(stream.report_compute)
    for model in models:
        clock.attach(model)
    return clock
