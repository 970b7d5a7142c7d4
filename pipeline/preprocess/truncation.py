"""Cutting one sample to the sample limit without ever splitting an image (pure, numpy-free).

The limit has one owner, `JobConfig.max_sample_tokens()` (and `max_sample_visual_tokens()`);
`Processor` applies it here. The cut keeps the longest prefix of the sample that
- holds at most `max_tokens` tokens,
- never ends inside an image's `<|vision_start|><|image_pad|>*n<|vision_end|>` span: an image
  whose span would be cut is dropped whole, with every image after it (the caller removes their
  pixel rows and grid rows, so `pixel_values` / `image_grid_thw` stay consistent with the ids),
- carries at most `max_visual` visual tokens (images are kept in order until the next would
  pass the cap).
So a kept sample holds exactly prod(grid_thw) / merge_size**2 `<|image_pad|>` tokens for each
image it carries, and every image it carries is whole. What to do when the prefix keeps nothing
to train on is the caller's policy (preprocessing quarantines it as `no_loss_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Cut:
    """Keep `input_ids[:tokens]`, `labels[:tokens]` and the first `images` images."""

    tokens: int
    images: int


def image_spans(placeholders: Sequence[int], visual: Sequence[int], ids: Sequence[int],
                start_id: int, end_id: int) -> list[tuple[int, int]]:
    """[start, end) of each image's span in the expanded `ids`.

    `placeholders`: position of each image's single `<|image_pad|>` before expansion;
    `visual`: its visual-token count (the run it was expanded to). The span takes in the
    vision markers around the run when the template put them there (it always does for Qwen).
    """
    spans: list[tuple[int, int]] = []
    shift = 0
    for p, n in zip(placeholders, visual, strict=True):
        a = int(p) + shift
        b = a + int(n)
        shift += int(n) - 1
        if a > 0 and ids[a - 1] == start_id:
            a -= 1
        if b < len(ids) and ids[b] == end_id:
            b += 1
        spans.append((a, b))
    return spans


def vision_safe_cut(num_tokens: int, spans: Sequence[tuple[int, int]], visual: Sequence[int],
                    max_tokens: int, max_visual: int | None = None) -> Cut:
    """The longest vision-safe prefix within the limits (see the module docstring)."""
    cut = min(num_tokens, max_tokens)
    kept = seen = 0
    for (a, b), v in zip(spans, visual, strict=True):
        if b > cut or (max_visual is not None and seen + v > max_visual):
            cut = min(cut, a)
            break
        kept += 1
        seen += v
    return Cut(cut, kept)
