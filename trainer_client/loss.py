"""Exact loss scaling across ranks from the step info every batch carries (no collective).

Each rank computes its loss as the mean over its own loss tokens (labels != -100). DDP averages
gradients over the W ranks, so multiplying rank r's mean loss by

    loss_scale = rank_loss_tokens * world_size / step_loss_tokens

makes the averaged gradient that of the mean over *all* loss tokens of the step:
    (1/W) * sum_r mean_r * n_r * W / N  =  sum_r sum_r_loss / N.
Without scaling, a rank with 10 loss tokens weighs as much as one with 10,000.
A joined rank (torch Join) or a filler step contributes zero gradients and still counts in W,
which is what the formula assumes.

Global steps (docs/global-steps.md): a rank runs several micro-batches per step, each carrying
the totals of the whole step, so each is scaled the same way; the rank's accumulated gradient is
the sum over its micro-batches, and DDP's average over W gives the mean over every loss token of
the step, at any world size and however the step was split.
"""

from __future__ import annotations

from typing import Any

from trainer_client.decode import BatchInfo

IGNORE_INDEX = -100


def _info(batch: Any) -> BatchInfo:
    return batch if isinstance(batch, BatchInfo) else batch.info


def loss_scale(batch: Any, *, by: str = "loss_tokens") -> float:
    """Factor for this rank's mean loss (`batch`: a StreamBatch, ModelInputs or BatchInfo);
    `by` = "loss_tokens" | "tokens" | "samples"."""
    info = _info(batch)
    if by == "loss_tokens":
        num, den = info.rank_loss_tokens, info.step_loss_tokens
    elif by == "tokens":
        num, den = info.rank_tokens, info.step_tokens
    elif by == "samples":
        num, den = info.rank_samples, info.step_samples
    else:
        raise ValueError(f"by must be 'loss_tokens', 'tokens' or 'samples', got {by!r}")
    return 0.0 if den == 0 else num * info.world_size / den


def causal_lm_loss(logits: Any, labels: Any, batch: Any) -> Any:
    """Next-token cross-entropy of this rank, already scaled: sum over its loss tokens *
    world_size / step_loss_tokens. Equal to `mean loss * loss_scale(batch)` but finite when the
    rank has no loss tokens (a filler step: exactly zero, with gradients of zero)."""
    import torch
    import torch.nn.functional as F

    info = _info(batch)
    shifted = labels[..., 1:].reshape(-1)
    flat = logits[..., :-1, :].reshape(-1, logits.size(-1))
    # At least float32 (bf16/fp16 logits are upcast), never less than the logits' own.
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
    total = F.cross_entropy(flat, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
    if info.step_loss_tokens == 0:
        return total * 0.0
    return total * (info.world_size / info.step_loss_tokens)
