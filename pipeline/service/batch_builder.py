"""One rank's batch of one step as the messages the rank receives (`chunk_framing.WireBatch`:
one serialized `ServerMessage`, or a BatchHeader and chunks for a batch over `chunk_bytes`).
Of a global step, one micro-batch of the rank at a time (one wire Batch each, carrying its
`micro_index`, the rank's `micro_count` and the step's `optimizer_step`), from the payloads of
all the rank's micro-batches (fetched once per step and rank).

Everything a rank needs comes from its own batch and the step's all-rank totals (published with
the plan), so building it never touches another rank's payloads. Pure: the same step, rank and
payloads give the same bytes (restarts redeliver byte-identical batches).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pipeline.planner.types import Step
from pipeline.preprocess.sample import ProcessedSample
from pipeline.service import collate as col
from pipeline.service.chunk_framing import DEFAULT_CHUNK_BYTES, WireBatch, wire_batch
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

log = logging.getLogger(__name__)


def build_batch(step: Step, rank: int, samples: Sequence[ProcessedSample], *,
                collate: str, pad_id: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                micro: int = 0, pad_to_multiple: int | None = None) -> WireBatch:
    """`samples`: the payloads of all the rank's batches in the step, in order (of every
    micro-batch of a global step); the message is of micro-batch `micro`, every sequence
    padded to `pad_to_multiple` (the job's `batching.pad_to_multiple`)."""
    micros = step.micros_for(rank)
    if not micros:
        raise LookupError(f"step {step.step} has no batch for rank {rank}")
    if not 0 <= micro < len(micros):
        raise LookupError(f"step {step.step} has {len(micros)} micro-batch(es) for rank {rank}, "
                          f"not a micro-batch {micro}")
    batch = micros[micro]
    start = sum(len(b.samples) for b in micros[:micro])
    mine = samples[start:start + len(batch.samples)]
    pieces = [col.Piece(p, batch.truncated_to.get(s.sample_id))
              for p, s in zip(mine, batch.samples, strict=True)]
    # The pixel patches stay in the samples' arrays: the chunks are framed from there.
    arrays = col.collate(pieces, collate, pad_id, pixel_rows=True,
                         pad_to_multiple=pad_to_multiple)
    loss = col.loss_tokens(arrays)
    if loss != batch.loss_tokens and not (batch.truncated_to or batch.filler):
        log.error("step %d rank %d: %d loss tokens in the payload, %d in the plan (metadata and "
                  "payload disagree)", step.step, rank, loss, batch.loss_tokens)
    out = pb.Batch(step=step.step, epoch=step.epoch, rank=rank,
                   sample_ids=[str(i) for i in batch.sample_ids], collate=collate,
                   over_budget=batch.over_budget, filler=batch.filler)
    info = out.info
    info.step_samples = step.info.step_samples
    info.step_tokens = step.info.step_tokens
    info.step_loss_tokens = step.info.step_loss_tokens
    if not batch.filler:  # a filler keeps the step aligned and weighs nothing
        info.rank_samples = len(batch.samples)
        info.rank_tokens = batch.num_tokens
        info.rank_loss_tokens = loss
    info.world_size = step.world.size  # the world that runs the step
    if step.info.optimizer_step is not None:  # a global step (else the fields stay unset)
        info.micro_index = micro
        info.micro_count = len(micros)
        info.optimizer_step = step.info.optimizer_step
    return wire_batch(out, arrays, chunk_bytes)
