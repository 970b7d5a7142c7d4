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

Ranks may end an epoch at different steps: inside the context a rank that reached its END
shadows the gradient all-reduces of the ranks still training (torch's `Join`, dividing by the
full world size as `causal_lm_loss` assumes), and leaves the context when every rank has
finished the epoch. Leaving the loop early (`break`) is fine; raising inside skips the join.
Only the DDP all-reduce is shadowed: do no other collective inside the context.

`join_uneven_inputs` enables the join only with `even_batches=False` (its default assumes
dataloaders that accelerate evened out, which a stream is not), so that is passed. Accelerate
joins on accelerator devices only; on CPU ranks (gloo) it would silently skip the join, so torch's
`Join` is entered directly there. `accelerate` is imported by the caller, never by this module.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from trainer_client.batch_stream import BatchStream
from trainer_client.decode import ModelInputs


@contextmanager
def joined_epoch(accelerator: Any, stream: BatchStream, joinables: Sequence[Any], *,
                 dtype: Any = None) -> Iterator[Iterator[ModelInputs]]:
    """One epoch of this rank's batches as model inputs on the accelerator's device, under
    `accelerator.join_uneven_inputs(joinables)`; pixel values in `dtype` (default float32)."""
    if accelerator.num_processes > 1 and not getattr(accelerator, "multi_device", True):
        from torch.distributed.algorithms.join import Join

        join = Join(list(joinables), throw_on_early_termination=False)
    else:
        join = accelerator.join_uneven_inputs(list(joinables), even_batches=False)
    with join:
        yield (batch.to_model_inputs(accelerator.device, dtype) for batch in stream)
