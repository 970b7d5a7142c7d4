"""The largest batch a job can send, from its config alone, and what `serve` says about it.

A batch's bytes on the wire are its tensors': text (per token of the batch's cost: int32
input_ids and labels and a bool attention_mask under padded collate, 9 bytes; int32 input_ids,
labels and position_ids plus a cu_seqlens entry per sample under packed collate, at most 16)
and, with images, pixel patches (4 patches of 3 x 2 x 14 x 14 values per visual token, 1 byte
each as uint8, 2 as bfloat16, 4 as float32) and an image_grid_thw row per image.

What bounds them: a batch costs at most `token_budget` tokens (padded `n * max_len`, packed
`sum(len)`), and at most `max_visual_tokens` of them are visual; under `over_budget: alone` one
sample over either limit goes alone, with at most `max_seq_len` tokens. Images come whole, each
of at most `image_max_pixels` (784 pixels per visual token) and at least `image_min_pixels`.
At the defaults (budget 16384, uint8 pixels) that is 77.3 MB: twelve 1024 x 1024 images
(grpcio's message limit is 64 MB; such batches travel in chunks, `chunk_framing`).

Pure: `largest_batch(job)` computes the bound, `batch_size_notice` says when it is far beyond
what a trainer's windows hold (None when it is not).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import PIXELS_PER_VISUAL_TOKEN, TrainingJobConfig
from pipeline.modes import OverBudgetPolicy
from pipeline.preprocess.vision import PATCH_VALUES, PATCHES_PER_VISUAL_TOKEN, PIXEL_BYTES

GRID_ROW_BYTES = 3 * 8  # image_grid_thw: int64 (t, h, w)
MB = 1e6
MiB = 1024 * 1024


@dataclass(frozen=True)
class BatchBound:
    """The most one batch of a job can carry, and its bytes."""

    tokens: int  # tokens of the batch's cost (padded: rows x width)
    visual_tokens: int  # of those, visual
    image_visual_tokens: int  # of one image at image_max_pixels
    images: int  # the most images (each of at least image_min_pixels)
    pixel_dtype: str
    text_bytes: int
    pixel_bytes: int  # pixel_values and image_grid_thw

    @property
    def nbytes(self) -> int:
        return self.text_bytes + self.pixel_bytes

    @property
    def full_size_images(self) -> int:
        """Images at image_max_pixels that fit in one batch."""
        return self.visual_tokens // self.image_visual_tokens if self.image_visual_tokens else 0


def largest_batch(job: TrainingJobConfig) -> BatchBound:
    b, p = job.batching, job.preprocess
    alone = b.over_budget is OverBudgetPolicy.ALONE
    # (max_sample_tokens as sent: rounded up to pad_to_multiple; the budget caps sent lengths)
    tokens = (max(b.token_budget, b.policy().cost_model.sent_length(job.max_sample_tokens()))
              if alone else b.token_budget)
    visual = min(b.token_budget, b.max_visual_tokens or b.token_budget)
    if alone:  # a sample over the visual cap goes alone: its images fit its own tokens
        visual = max(visual, job.max_sample_tokens())
    visual = min(visual, tokens)
    images = visual // p.min_image_visual_tokens
    if b.collate == "padded":
        text = 9 * tokens
    else:  # ids, labels, position_ids; cu_seqlens (a sample has >= 1 token), max_seqlen
        text = 12 * tokens + 4 * (tokens + 1) + 4
        if (b.pad_to_multiple or 1) > 1:  # cu_seqlens_unpadded
            text += 4 * (tokens + 1)
    pixels = visual * PATCHES_PER_VISUAL_TOKEN * PATCH_VALUES * PIXEL_BYTES[p.pixel_dtype]
    return BatchBound(
        tokens=tokens, visual_tokens=visual,
        image_visual_tokens=p.image_max_pixels // PIXELS_PER_VISUAL_TOKEN, images=images,
        pixel_dtype=p.pixel_dtype, text_bytes=text,
        pixel_bytes=pixels + GRID_ROW_BYTES * images if visual else 0)


def batch_size_notice(job: TrainingJobConfig, bound: BatchBound, *, prefetch_bytes: int,
                      prefetch_steps: int, max_message_bytes: int, chunk_bytes: int
                      ) -> str | None:
    """What an operator should know when the job's largest batch is beyond a message
    (`max_message_bytes`) or a trainer's default byte window (`prefetch_bytes`); else None."""
    if bound.nbytes <= min(max_message_bytes, prefetch_bytes):
        return None
    b, p = job.batching, job.preprocess
    chunks = -(-bound.nbytes // chunk_bytes)
    held = max(1, min(prefetch_steps, prefetch_bytes // bound.nbytes))
    return (
        f"job {job.job_id!r}: a batch of images may reach {bound.nbytes / MB:,.1f} MB "
        f"(token_budget {b.token_budget} with up to {bound.visual_tokens} visual tokens of "
        f"{bound.pixel_dtype} pixel patches: {bound.full_size_images} images at "
        f"image_max_pixels {p.image_max_pixels}); it travels in up to {chunks} chunks of "
        f"{chunk_bytes / MiB:g} MiB (grpc.max_message_mb is {max_message_bytes / MiB:g}). A "
        f"trainer with the default prefetch_bytes ({prefetch_bytes / MiB:g} MiB) holds "
        f"{held} such batch{'es' if held > 1 else ''} besides the one it trains on "
        f"({(held + 1) * bound.nbytes / MB:,.0f} MB); set BatchStream(prefetch_bytes=...) for "
        "its memory, or lower batching.token_budget, batching.max_visual_tokens or "
        "preprocess.image_max_pixels")
