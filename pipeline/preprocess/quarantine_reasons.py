"""The quarantine reasons preprocessing can give a record: one closed vocabulary.

A reason is a short machine word that travels as a field from the record that raised it
(`RecordError.reason`) through `QuarantinedRecord.reason` and the Arrow row's
`quarantine_reason` to counters and metric labels, never parsed back out of a sentence. The
human-readable detail travels beside it (`QuarantinedRecord.detail`). Owns nothing else: no I/O,
no counting. Adding a reason means adding a member here with its meaning.
"""

from __future__ import annotations

from enum import StrEnum


class QuarantineReason(StrEnum):
    """Why preprocessing set a record aside. Values are the labels operators and metrics see."""

    BAD_UTF8 = "bad_utf8"
    BAD_JSON = "bad_json"
    BAD_RECORD = "bad_record"
    MISSING_ROLES = "missing_roles"
    MISSING_IMAGE = "missing_image"
    BAD_IMAGE = "bad_image"
    TEMPLATE_ERROR = "template_error"
    TOKENIZE_ERROR = "tokenize_error"
    TOO_LONG = "too_long"
    NO_LOSS_TOKENS = "no_loss_tokens"
    PREPROCESS_ERROR = "preprocess_error"
    BAD_EMBEDDING = "bad_embedding"

    @property
    def meaning(self) -> str:
        """One line an operator can read next to the label."""
        return _MEANING[self]


_MEANING: dict[QuarantineReason, str] = {
    QuarantineReason.BAD_UTF8: "the JSONL line is not valid UTF-8",
    QuarantineReason.BAD_JSON: "the line is empty or not valid JSON",
    QuarantineReason.BAD_RECORD: "valid JSON but not a chat record (wrong types, image "
                                 "placeholders that do not match the images)",
    QuarantineReason.MISSING_ROLES: "no turns, an unknown role, or no user or no assistant turn",
    QuarantineReason.MISSING_IMAGE: "an image file is not found or its reference is unusable",
    QuarantineReason.BAD_IMAGE: "image bytes do not decode or the image processor refuses them",
    QuarantineReason.TEMPLATE_ERROR: "the chat template failed to render the conversation",
    QuarantineReason.TOKENIZE_ERROR: "the tokenizer failed on the rendered text",
    QuarantineReason.TOO_LONG: "longer than preprocess.max_seq_len under "
                               "preprocess.truncation=quarantine",
    QuarantineReason.NO_LOSS_TOKENS: "cut to the sample limit, no assistant token is left to "
                                     "train on (e.g. an image too big to fit precedes every "
                                     "answer)",
    QuarantineReason.PREPROCESS_ERROR: "an unforeseen failure, kept with its exception message",
    QuarantineReason.BAD_EMBEDDING: "organization: the record's vector is missing, ragged, of "
                                    "another dimension, NaN/inf or zero (SDO embedding stage)",
}
