"""Which tokens are trained on: assistant turns only (-100 everywhere else).

We work on the rendered text, not on token patterns: find each assistant turn's character span,
then label the tokens that overlap a span (fast tokenizers give offsets). This
survives BPE merges at turn boundaries that break token-id pattern matching.

ChatML templates (Qwen, ...): a span runs from after `<|im_start|>assistant\\n` up to and
including its `<|im_end|>` (the model must learn to stop), so Qwen3's `<think>` block of the
last turn is trained too. Other templates: each assistant message's content is searched in order
in the rendered text and its span extended over the tokenizer's eos token if that follows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

IGNORE = -100
CHATML_HEADER = "<|im_start|>assistant\n"
CHATML_END = "<|im_end|>"


def assistant_spans(text: str, assistant_contents: Sequence[str] = (),
                    eos_token: str | None = None) -> list[tuple[int, int]]:
    """Character [start, end) spans of the assistant turns in the rendered `text`."""
    spans: list[tuple[int, int]] = []
    if CHATML_HEADER in text:
        pos = 0
        while (h := text.find(CHATML_HEADER, pos)) >= 0:
            start = h + len(CHATML_HEADER)
            end = text.find(CHATML_END, start)
            end = len(text) if end < 0 else end + len(CHATML_END)
            spans.append((start, end))
            pos = end
        return spans
    pos = 0
    for content in assistant_contents:
        if not content:
            continue
        start = text.find(content, pos)
        if start < 0:
            continue
        end = start + len(content)
        if eos_token and text.startswith(eos_token, end):
            end += len(eos_token)
        spans.append((start, end))
        pos = end
    return spans


def label_tokens(input_ids: np.ndarray, offsets: np.ndarray,
                 spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """labels[i] = input_ids[i] if token i overlaps an assistant span, else -100.

    Overlap (not "starts inside") because byte-level BPE glues a leading space to the next word:
    " Hello" starts one character before a non-ChatML answer "Hello".
    """
    labels = np.full(input_ids.shape, IGNORE, dtype=np.int32)
    if not spans or input_ids.size == 0:
        return labels
    starts, ends = offsets[:, 0], offsets[:, 1]
    for s, e in spans:
        lo = int(np.searchsorted(ends, s, side="right"))  # first token ending after s
        hi = int(np.searchsorted(starts, e, side="left"))  # first token starting at/after e
        labels[lo:hi] = input_ids[lo:hi]
    return labels
