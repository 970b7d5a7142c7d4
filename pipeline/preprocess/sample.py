"""What preprocessing produces: one sample with its payload, or one quarantined record.

The planner sees only `ProcessedSample.measured()`; the payload stays with the data plane.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pipeline.planner.types import MeasuredSample
from pipeline.quarantine import QuarantineReason

IGNORE_INDEX = -100  # label of a token that does not count toward the loss


@dataclass(frozen=True)
class ProcessedSample:
    sample_id: str  # "<source>:<row>", stable across epochs and restarts
    source: str
    row: int  # 0-based line/row in the source
    input_ids: np.ndarray  # int32 [num_tokens]
    labels: np.ndarray  # int32 [num_tokens], -100 outside assistant turns
    num_visual_tokens: int = 0
    cost: int = 0  # under the job's cost model, alone
    # [num_patches, C*T*P*P] (Qwen2-VL layout): raw uint8, bfloat16 bits (uint16) or float32,
    # as preprocess.pixel_dtype says
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None  # int64 [num_images, 3]
    truncated: bool = False  # cut to JobConfig.max_sample_tokens() (vision-safe: whole images)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def loss_tokens(self, collate: str = "padded") -> int:
        """Tokens with a label once collated: the packed collate masks each sample's first
        label (so a sample never predicts its first token from the previous sample's last)."""
        lab = self.labels
        n = int(np.count_nonzero(lab != IGNORE_INDEX))
        if collate == "packed" and len(lab) and lab[0] != IGNORE_INDEX:
            n -= 1
        return n

    def measured(self, collate: str = "padded") -> MeasuredSample:
        return MeasuredSample(self.sample_id, self.num_tokens, self.num_visual_tokens,
                              self.loss_tokens(collate))

    def digest(self) -> str:
        """Hash of every field's exact bytes: equal digests = byte-identical samples."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.sample_id}|{self.num_visual_tokens}|{self.cost}|{self.truncated}".encode())
        for arr in (self.input_ids, self.labels, self.pixel_values, self.image_grid_thw):
            if arr is None:
                h.update(b"<none>")
            else:
                h.update(f"{arr.dtype.str}{arr.shape}".encode())
                h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class QuarantinedRecord:
    """A record that could not be parsed/templated/tokenized/decoded: kept, counted, listed."""

    source: str
    row: int
    reason: QuarantineReason  # the vocabulary word (pipeline/quarantine.py), never a sentence
    detail: str = ""  # the human-readable message

    @property
    def sample_id(self) -> str:
        return f"{self.source}:{self.row}"
