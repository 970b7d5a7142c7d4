"""Block-wise parallel decoding with a confidence threshold, one request at a time in spirit.

A request's response region (`generation_tokens` MASKs after its prompt) is decoded block by
block (semi-autoregressive, as LLaDA): each step predicts the current block's masked positions
and fills every one whose confidence (max softmax probability) is >= the request's threshold,
or else the single most confident one, so a block takes 1..block_size steps: how many depends on
how sure the model is, which is what makes members of a batch converge at different rates.

Batch-invariance (the same tokens per request whatever the batch): a request's sequence is padded
to its own bucket length (a function of the request alone), requests attend only to themselves,
and one forward runs per bucket, so a request's arithmetic has the same shapes in any batch.
`step` takes any set of requests: that is what lets the two schedulers share it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from mdlm.model import MaskedDiffusionLM
from mdlm.vocab import MASK, PAD

BLOCK = 32
BUCKET = 64


def threshold_for(request_id: str, spread: float, center: float = 0.3) -> float:
    """The request's confidence threshold: `center` +- spread * 0.28, placed by a hash of its
    id (deterministic, so both schedulers use the same one); spread 0 = homogeneous. A low
    threshold fills most of a block per step, a high one about a token per step (the tiny
    model's confidences are modest: the center sits where they fall)."""
    u = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")
    return center + spread * 0.28 * (2 * (u / 2**32) - 1)


@dataclass
class Decoding:
    request_id: str
    seq: np.ndarray          # local ids [prompt ; response], MASK where not decoded yet
    prompt_len: int
    gen: int
    threshold: float
    cost: int                # the service's cost (prompt + planned generation tokens)
    block: int = 0
    steps: int = 0
    bucket: int = field(init=False)

    def __post_init__(self) -> None:
        self.bucket = -(-len(self.seq) // BUCKET) * BUCKET

    @property
    def done(self) -> bool:
        return self.block * BLOCK >= self.gen

    def block_positions(self) -> np.ndarray:
        b = min(self.block, self.gen // BLOCK - 1)  # a finished one re-runs its last block
        start = self.prompt_len + b * BLOCK
        return np.arange(start, start + BLOCK)

    def output(self) -> list[int]:
        return self.seq[self.prompt_len:].tolist()


def start(request_id: str, prompt_local: np.ndarray, gen: int, cost: int, spread: float,
          max_prompt: int) -> Decoding:
    p = prompt_local[-max_prompt:]
    seq = np.concatenate([p, np.full(gen, MASK, dtype=np.int64)])
    return Decoding(request_id, seq, len(p), gen, threshold_for(request_id, spread), cost)


@torch.inference_mode()
def step(model: MaskedDiffusionLM, batch: list[Decoding]) -> int:
    """One denoising step of every unfinished member of `batch` (finished members are computed
    too and left unchanged: a static batch keeps its shape). Returns the tokens computed
    (padded positions included), the work measure of the step."""
    work = 0
    by_bucket: dict[int, list[Decoding]] = {}
    for d in batch:
        by_bucket.setdefault(d.bucket, []).append(d)
    for bucket, group in sorted(by_bucket.items()):
        ids = torch.full((len(group), bucket), PAD, dtype=torch.long)
        for i, d in enumerate(group):
            ids[i, : len(d.seq)] = torch.from_numpy(d.seq)
        pos = torch.from_numpy(np.stack([d.block_positions() for d in group]))
        probs = model.logits_at(ids, pos).float().softmax(-1)
        probs[..., MASK] = 0  # never "decode" a MASK
        probs[..., PAD] = 0
        conf, tok = probs.max(-1)
        work += len(group) * bucket
        for i, d in enumerate(group):
            if d.done:
                continue
            p = d.block_positions()
            masked = d.seq[p] == MASK
            c = conf[i].numpy().copy()
            c[~masked] = -1.0
            fill = (c >= d.threshold) & masked
            if not fill.any():
                fill[int(np.argmax(c))] = True
            d.seq[p[fill]] = tok[i].numpy()[fill]
            d.steps += 1
            if not (d.seq[p] == MASK).any():
                d.block += 1
    return work
