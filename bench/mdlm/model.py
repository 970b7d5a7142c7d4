"""A tiny masked-diffusion LM (MDLM/LLaDA style) built from a config, and its training loop.

Bidirectional transformer over `[prompt ; response]`; training masks a random fraction t ~ U(0,1)
of the response tokens and predicts them (cross-entropy on the masked positions), so at decode
time a block of MASK tokens is filled in parallel, most confident first. Prompts are cut from the
left to `max_prompt` tokens, responses to `max_response` (the model's positions).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from mdlm.vocab import MASK, PAD


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int = 96
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_prompt: int = 128
    max_response: int = 256

    @property
    def max_len(self) -> int:
        return self.max_prompt + self.max_response


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.out = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.ff = nn.Sequential(nn.Linear(c.d_model, c.d_ff), nn.GELU(),
                                nn.Linear(c.d_ff, c.d_model))

    def forward(self, x: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.n_heads)
        att = att.masked_fill(key_pad[:, None, None, :], float("-inf")).softmax(-1)
        x = x + self.out((att @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.ff(self.ln2(x))


class MaskedDiffusionLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.max_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])
        x = self.tok(ids) + self.pos(pos)[None]
        pad = ids == PAD
        for blk in self.blocks:
            x = blk(x, pad)
        return self.ln(x)

    def logits_at(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits at `positions` [b, k] only (the head is the widest layer)."""
        h = self.hidden(ids)
        picked = torch.gather(h, 1, positions[..., None].expand(-1, -1, h.shape[-1]))
        return self.head(picked)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def train(model: MaskedDiffusionLM, pairs: list[tuple[np.ndarray, np.ndarray]], seconds: float,
          seed: int = 0, batch: int = 16) -> dict:
    """Masked-diffusion training on (prompt, response) local-id pairs for `seconds` of wall time."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    model.train()
    t0, steps, losses = time.monotonic(), 0, []
    while time.monotonic() - t0 < seconds:
        idx = rng.integers(0, len(pairs), size=batch)
        rows, targets = [], []
        for i in idx:
            p, r = pairs[i]
            p, r = p[-c.max_prompt:], r[: c.max_response]
            rows.append(np.concatenate([p, r]))
            targets.append((len(p), len(r)))
        n = max(len(x) for x in rows)
        ids = torch.full((batch, n), PAD, dtype=torch.long)
        is_resp = torch.zeros((batch, n), dtype=torch.bool)
        for j, (x, (lp, lr)) in enumerate(zip(rows, targets, strict=True)):
            ids[j, : len(x)] = torch.from_numpy(x)
            is_resp[j, lp: lp + lr] = True
        t = torch.rand((batch, 1), generator=g).clamp(min=0.05)
        masked = is_resp & (torch.rand(ids.shape, generator=g) < t)
        noisy = ids.masked_fill(masked, MASK)
        h = model.hidden(noisy)
        logits = model.head(h[masked])
        loss = nn.functional.cross_entropy(logits, ids[masked])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        steps += 1
    model.eval()
    tail = losses[-20:] if losses else [float("nan")]
    return {"steps": steps, "seconds": time.monotonic() - t0, "first_loss": losses[0],
            "final_loss": float(np.mean(tail)), "params": model.num_params(),
            "config": asdict(c)}
