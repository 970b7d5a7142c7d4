"""Why a record was set aside: one closed vocabulary for preprocessing and the planner.

A reason is a short machine word that travels as a field from where it was raised
(`RecordError.reason` in preprocessing, `Quarantined.reason` in the planner) through the job
state's quarantine list and counters to `status` and metric labels, never parsed back out of a
sentence. The human-readable detail travels beside it. A leaf module (no imports of the
project), so the pure planner can use it too. Adding a reason means adding a member here with its
meaning.
"""

from __future__ import annotations

from enum import StrEnum


class QuarantineReason(StrEnum):
    """Why a record was set aside. Values are the labels operators and metrics see."""

    BAD_UTF8 = "bad_utf8"
    BAD_JSON = "bad_json"
    BAD_RECORD = "bad_record"
    MISSING_ROLES = "missing_roles"
    MISSING_IMAGE = "missing_image"
    BAD_IMAGE = "bad_image"
    TEMPLATE_ERROR = "template_error"
    SPECIAL_TOKENS_IN_CONTENT = "special_tokens_in_content"
    TOKENIZE_ERROR = "tokenize_error"
    TOO_LONG = "too_long"
    NO_LOSS_TOKENS = "no_loss_tokens"
    PREPROCESS_ERROR = "preprocess_error"
    BAD_EMBEDDING = "bad_embedding"
    # The planner's (a sample that was preprocessed but cannot be placed in a batch):
    INVALID_SIZE = "invalid_size"
    OVER_BUDGET = "over_budget"
    OVER_VISUAL_CAP = "over_visual_cap"

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
    QuarantineReason.TEMPLATE_ERROR: "the chat template failed to render the conversation, "
                                     "or wrote another number of image placeholders than the "
                                     "record has images",
    QuarantineReason.SPECIAL_TOKENS_IN_CONTENT: "a message holds a special-token string "
                                                "(<|im_start|>, <|image_pad|>, ...) and "
                                                "preprocess.special_tokens_in_content is "
                                                "quarantine (under `text` it is plain text)",
    QuarantineReason.TOKENIZE_ERROR: "the tokenizer failed on the rendered text",
    QuarantineReason.TOO_LONG: "longer than preprocess.max_seq_len under "
                               "preprocess.truncation=quarantine",
    QuarantineReason.NO_LOSS_TOKENS: "no assistant token to train on: the template left every "
                                     "answer out (or it is empty), or the cut to the sample "
                                     "limit left none (e.g. an image too big to fit precedes "
                                     "every answer)",
    QuarantineReason.PREPROCESS_ERROR: "an unforeseen failure, kept with its exception message",
    QuarantineReason.BAD_EMBEDDING: "organization: the record's vector is missing, ragged, of "
                                    "another dimension, NaN/inf or zero (SDO embedding stage)",
    QuarantineReason.INVALID_SIZE: "num_tokens <= 0 or num_visual_tokens < 0",
    QuarantineReason.OVER_BUDGET: "num_tokens > token_budget and batching.over_budget is "
                                  "quarantine",
    QuarantineReason.OVER_VISUAL_CAP: "num_visual_tokens > max_visual_tokens and the policy "
                                      "cannot place it",
}
