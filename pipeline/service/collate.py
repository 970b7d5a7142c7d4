"""Server-side collation: one rank's samples -> ready tensors (numpy), so the trainer does no work.

`padded`: input_ids / attention_mask / labels (-100 on padding) / position_ids, shape [B, Lmax].
`packed`: one row [1, T] of concatenated samples with `cu_seqlens` (int32, [n+1]) and
`max_seqlen`, position_ids restarting at 0 per sample — what flash-attention varlen kernels take.
The first label of every packed sample is -100 so the model's shifted loss never predicts a
sample's first token from the previous sample's last one (same as HF DataCollatorWithFlattening).
Vision samples add `pixel_values` (concatenated patches) and `image_grid_thw`.
Pure functions; deterministic byte output (restarts must redeliver identical bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.preprocess.sample import IGNORE_INDEX, ProcessedSample


@dataclass(frozen=True)
class Piece:
    """A sample as it enters a batch: its payload and how many tokens to keep."""

    sample: ProcessedSample
    keep: int | None = None  # Batch.truncated_to for this sample; None = all

    @property
    def input_ids(self) -> np.ndarray:
        ids = self.sample.input_ids
        return ids[: self.keep] if self.keep is not None else ids

    @property
    def labels(self) -> np.ndarray:
        return self.sample.labels[: self.keep] if self.keep is not None else self.sample.labels


def loss_tokens(pieces: Sequence[Piece], collate: str) -> int:
    """Tokens that contribute to the loss once collated (label != -100)."""
    total = 0
    for p in pieces:
        lab = p.labels
        n = int(np.count_nonzero(lab != IGNORE_INDEX))
        if collate == "packed" and len(lab) and lab[0] != IGNORE_INDEX:
            n -= 1  # the packed collate masks each sample's first label
        total += n
    return total


def collate(pieces: Sequence[Piece], mode: str, pad_id: int = 0) -> dict[str, np.ndarray]:
    if not pieces:
        raise ValueError("cannot collate an empty batch")
    if mode == "padded":
        out = _padded(pieces, pad_id)
    elif mode == "packed":
        out = _packed(pieces)
    else:
        raise ValueError(f"unknown collate mode {mode!r} (expected 'padded' or 'packed')")
    out.update(_vision(pieces))
    return out


def _padded(pieces: Sequence[Piece], pad_id: int) -> dict[str, np.ndarray]:
    lens = [len(p.input_ids) for p in pieces]
    b, width = len(pieces), max(lens)
    input_ids = np.full((b, width), pad_id, dtype=np.int64)
    labels = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.int64)
    pos = np.zeros((b, width), dtype=np.int64)
    ramp = np.arange(width, dtype=np.int64)
    for i, (p, n) in enumerate(zip(pieces, lens, strict=True)):
        input_ids[i, :n] = p.input_ids
        labels[i, :n] = p.labels
        mask[i, :n] = 1
        pos[i, :n] = ramp[:n]
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "position_ids": pos}


def _packed(pieces: Sequence[Piece]) -> dict[str, np.ndarray]:
    lens = np.array([len(p.input_ids) for p in pieces], dtype=np.int64)
    cu = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    input_ids = np.concatenate([p.input_ids for p in pieces]).astype(np.int64)[None, :]
    labels = np.concatenate([p.labels for p in pieces]).astype(np.int64)
    labels[cu[:-1][lens > 0]] = IGNORE_INDEX
    # position_ids restart per sample: global index minus the start of its sample.
    starts = np.repeat(cu[:-1].astype(np.int64), lens)
    pos = (np.arange(int(cu[-1]), dtype=np.int64) - starts)[None, :]
    return {
        "input_ids": input_ids,
        "labels": labels[None, :],
        "position_ids": pos,
        "cu_seqlens": cu,
        "max_seqlen": np.array(int(lens.max()), dtype=np.int32),
    }


def _vision(pieces: Sequence[Piece]) -> dict[str, np.ndarray]:
    pv = [p.sample.pixel_values for p in pieces if p.sample.pixel_values is not None]
    if not pv:
        return {}
    grids = [p.sample.image_grid_thw for p in pieces if p.sample.image_grid_thw is not None]
    return {
        "pixel_values": np.concatenate(pv).astype(np.float32, copy=False),
        "image_grid_thw": np.concatenate(grids).astype(np.int64, copy=False),
    }
