"""Cost-changing augmentation, exactly reproducible from (job seed, epoch, sample_id).

The RNG seed is a blake2b hash of f"{seed}:{epoch}:{sample_id}" (never Python's salted `hash`),
so any process - a Ray worker, a restarted server's `SampleStore` - draws the same choices.
Draws happen in a fixed order whatever is enabled, so turning one option on does not reshuffle
the others.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pipeline.config import AugmentConfig
from pipeline.preprocess.records import Conversation, Segment, Turn


def rng_for(seed: int, epoch: int, sample_id: str) -> np.random.Generator:
    digest = hashlib.blake2b(f"{seed}:{epoch}:{sample_id}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


@dataclass(frozen=True)
class AugmentPlan:
    system_prompt: str | None = None  # replaces/sets the system turn
    keep_assistant_turns: int | None = None  # keep the conversation up to this assistant turn
    image_scales: tuple[float, ...] = ()


def plan(cfg: AugmentConfig, conv: Conversation, seed: int, epoch: int,
         sample_id: str) -> AugmentPlan:
    if not cfg.enabled:
        return AugmentPlan()
    rng = rng_for(seed, epoch, sample_id)
    u_sys, u_turn, u_keep = rng.random(3)
    sys_idx = int(rng.integers(0, max(1, len(cfg.system_prompts))))
    n_images = len(conv.images)
    scales = rng.uniform(cfg.image_scale_min, cfg.image_scale_max, size=n_images)

    system = None
    if cfg.system_prompts and u_sys < cfg.system_prompt_prob:
        system = cfg.system_prompts[sys_idx]
    keep = None
    n_asst = sum(1 for t in conv.turns if t.role == "assistant")
    if n_asst > 1 and u_turn < cfg.turn_subsample_prob:
        keep = 1 + int(u_keep * n_asst)  # 1..n_asst, uniform
        keep = None if keep >= n_asst else keep
    if cfg.image_scale_min == cfg.image_scale_max == 1.0:
        image_scales: tuple[float, ...] = ()
    else:
        # Rounded so the value is the same on every platform's float formatting.
        image_scales = tuple(round(float(s), 6) for s in scales)
    return AugmentPlan(system, keep, image_scales)


def apply(conv: Conversation, p: AugmentPlan) -> tuple[Conversation, tuple[float, ...]]:
    """-> (augmented conversation, scale per remaining image in order)."""
    turns = list(conv.turns)
    scales = list(p.image_scales) if p.image_scales else [1.0] * len(conv.images)
    if p.keep_assistant_turns is not None:
        seen = 0
        cut = len(turns)
        for i, t in enumerate(turns):
            if t.role == "assistant":
                seen += 1
                if seen == p.keep_assistant_turns:
                    cut = i + 1
                    break
        kept_images = sum(t.num_images for t in turns[:cut])
        turns = turns[:cut]
        scales = scales[:kept_images]
    if p.system_prompt is not None:
        sys_turn = Turn("system", (Segment(text=p.system_prompt),))
        if turns and turns[0].role == "system":
            turns[0] = sys_turn
        else:
            turns.insert(0, sys_turn)
    return Conversation(tuple(turns)), tuple(scales)
