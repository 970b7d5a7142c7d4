"""What of a record is embedded: its user and assistant turns as plain text, in order.

No chat template (its special tokens are the same in every sample), no system prompt (shared
boilerplate that would pull unrelated chats together), no images (the model reads text). The
text is taken from the raw record, before augmentation, so it is the same in every epoch and the
embedding is computed once per dataset. The model reads the first 256 word pieces of it, so the
opening exchange decides where a long chat lands.
"""

from __future__ import annotations

from typing import Any

from pipeline.preprocess.records import Conversation, RecordError, decode_line
from pipeline.quarantine import QuarantineReason

TEXT_RECIPE = "turns-v1"  # part of the cache key: change it when the text above changes


def conversation_text(conv: Conversation) -> str:
    lines = []
    for turn in conv.turns:
        if turn.role == "system":
            continue
        text = " ".join(s.text.strip() for s in turn.segments if s.text.strip())
        if text:
            lines.append(text)
    return "\n".join(lines)


def decode_record(raw: Any) -> dict[str, Any]:
    """A source row (JSONL line bytes or a Parquet row dict) -> the record's JSON object."""
    rec = decode_line(raw) if isinstance(raw, (bytes, bytearray)) else raw
    if not isinstance(rec, dict):
        raise RecordError(QuarantineReason.BAD_RECORD,
                          f"expected a record, got {type(rec).__name__}")
    return rec
