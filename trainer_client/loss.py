"""Exact loss scaling across ranks from the step info every batch carries (no collective).

Each rank computes its loss as the mean over its own loss tokens (labels != -100). DDP averages
gradients over the W ranks, so multiplying rank r's mean loss by

    loss_scale = rank_loss_tokens * world_size / step_loss_tokens

makes the averaged gradient that of the mean over *all* loss tokens of the step:
    (1/W) * sum_r mean_r * n_r * W / N  =  sum_r sum_r_loss / N.
Without scaling, a rank with 10 loss tokens weighs as much as one with 10,000.
"""

from __future__ import annotations

from trainer_client.decode import BatchInfo, StreamBatch


def loss_scale(batch: StreamBatch | BatchInfo, *, by: str = "loss_tokens") -> float:
    """Factor for this rank's mean loss; `by` = "loss_tokens" | "tokens" | "samples"."""
    info = batch.info if isinstance(batch, StreamBatch) else batch
    if by == "loss_tokens":
        num, den = info.rank_loss_tokens, info.step_loss_tokens
    elif by == "tokens":
        num, den = info.rank_tokens, info.step_tokens
    elif by == "samples":
        num, den = info.rank_samples, info.step_samples
    else:
        raise ValueError(f"by must be 'loss_tokens', 'tokens' or 'samples', got {by!r}")
    return 0.0 if den == 0 else num * info.world_size / den
