"""A tiny real transformers Qwen2 causal LM (config only, nothing from a hub) and the reference
the DDP adapter tests compare every rank's all-reduced gradient with."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pipeline.preprocess.sample import IGNORE_INDEX, ProcessedSample
from pipeline.service.collate import Piece, collate

VOCAB = 128
BUDGET = 32


def build_model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)  # every rank and the reference start from the same weights
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def flat_grad(model: torch.nn.Module) -> list[float]:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()]).tolist()


def samples(n: int, seed: int = 0) -> list[ProcessedSample]:
    """n samples that each fill the budget (one sample per batch, so with an odd count the last
    step of a join epoch has rank 0 only) with different numbers of loss tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for row in range(n):
        ids = rng.integers(1, VOCAB, size=BUDGET, dtype=np.int32)
        labels = ids.copy()
        labels[: 2 + (row * 7) % 25] = IGNORE_INDEX  # label 0 always masked (never predicted)
        out.append(ProcessedSample(f"ddp:{row}", "ddp", row, ids, labels, cost=BUDGET))
    return out


def reference_grad(model: torch.nn.Module, batches: Sequence[Sequence[ProcessedSample]]
                   ) -> tuple[list[float], int]:
    """Gradient of the mean next-token loss over every loss token of one step (all ranks'
    batches), and that token count: what exact loss scaling must reproduce."""
    model.zero_grad(set_to_none=True)
    total, n_tokens = 0.0, 0
    for batch in batches:
        arrays = collate([Piece(s) for s in batch], "padded")
        ids = torch.from_numpy(arrays["input_ids"]).long()
        labels = torch.from_numpy(arrays["labels"]).long()
        mask = torch.from_numpy(arrays["attention_mask"]).long()
        logits = model(input_ids=ids, attention_mask=mask).logits
        target = labels[:, 1:].reshape(-1)
        total = total + torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB).float(), target, ignore_index=IGNORE_INDEX,
            reduction="sum")
        n_tokens += int((target != IGNORE_INDEX).sum())
    (total / n_tokens).backward()
    return flat_grad(model), n_tokens
