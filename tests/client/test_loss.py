"""`causal_lm_loss` computes in at least float32 and never in less than the logits' own
precision: a float64 model's loss stays float64 (the elastic example's exactness check relies on
it), bfloat16 logits are upcast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer_client import BatchInfo, causal_lm_loss


def info(loss_tokens: int, world_size: int = 2) -> BatchInfo:
    return BatchInfo(step=0, epoch=0, rank=0, world_size=world_size, sample_ids=("s:0",),
                     step_samples=2, step_tokens=40, rank_samples=1, rank_tokens=20,
                     step_loss_tokens=loss_tokens, rank_loss_tokens=loss_tokens // 2,
                     collate="padded", over_budget=False)


def test_the_loss_keeps_float64_and_upcasts_bfloat16():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 10, 50, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (2, 10), generator=g)
    labels[:, :3] = -100
    got = causal_lm_loss(logits, labels, info(31))
    assert got.dtype == torch.float64
    flat, target = logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1)
    want = F.cross_entropy(flat, target, ignore_index=-100, reduction="sum") * (2 / 31)
    assert got.item() == want.item()  # the same float64 operations, not a float32 rounding
    assert got.item() != (F.cross_entropy(flat.float(), target, ignore_index=-100,
                                          reduction="sum") * (2 / 31)).item()
    half = causal_lm_loss(logits.bfloat16(), labels, info(31))
    assert half.dtype == torch.float32
