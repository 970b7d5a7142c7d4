"""Which tokens are trained on: assistant turns only (-100 everywhere else).

Spans are found from the turns' real places in the rendered text (`RenderedChat.content`, put
there by the renderer), never by searching the text: a message that contains
`<|im_start|>assistant\\n` is content of its own turn and gets no label. Then the tokens that
overlap a span are labelled (fast tokenizers give offsets), which survives BPE merges at turn
boundaries that break token-id pattern matching.

Per assistant turn, only the template's own text around the turn's content is read:
- ChatML templates (Qwen, ...): when the template text before the content ends with
  `<|im_start|>assistant\\n...` the span starts right after that header, so what the template
  puts between header and content (Qwen3's empty `<think>` block of the last turn) is trained;
  it ends with the first `<|im_end|>` the template writes after the content (the model must
  learn to stop).
- Other templates: the span is the content itself, extended over the tokenizer's eos token when
  the template writes it right after the content.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.preprocess.chat_template import RenderedChat

IGNORE = -100
CHATML_HEADER = "<|im_start|>assistant\n"
CHATML_END = "<|im_end|>"


def assistant_spans(chat: RenderedChat, eos_token: str | None = None) -> list[tuple[int, int]]:
    """Character [start, end) spans of the assistant turns of `chat`, in text order."""
    spans: list[tuple[int, int]] = []
    for turn, role in enumerate(chat.roles):
        extent = chat.turn_extent(turn) if role == "assistant" else None
        if extent is None:
            continue
        start, end = extent
        before = max((c.end for c in chat.content if c.end <= start and c.turn != turn),
                     default=0)
        after = min((c.start for c in chat.content if c.start >= end and c.turn != turn),
                    default=len(chat.text))
        header = chat.text.rfind(CHATML_HEADER, before, start)
        if header >= 0:
            closing = chat.text.find(CHATML_END, end, after)
            spans.append((header + len(CHATML_HEADER),
                          end if closing < 0 else closing + len(CHATML_END)))
            continue
        if start == end:
            continue  # an empty answer outside ChatML: nothing of the turn to train on
        if eos_token and chat.text.startswith(eos_token, end, after):
            end += len(eos_token)
        spans.append((start, end))
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
