"""Server-side collation: one rank's samples -> ready tensors (numpy) in compact wire dtypes.

`padded`: int32 input_ids and labels (-100 on padding), bool attention_mask, shape [B, Lmax];
no position_ids (the model derives them from the mask).
`packed`: one row [1, T] of concatenated samples: int32 input_ids, labels and position_ids
(restarting at 0 per sample), `cu_seqlens` (int32, [n+1]) and `max_seqlen` — what
flash-attention varlen kernels take. The first label of every packed sample is -100 so the
model's shifted loss never predicts a sample's first token from the previous sample's last one
(same as HF DataCollatorWithFlattening).
With `pad_to_multiple` m > 1 (`batching.pad_to_multiple`: context parallelism splits every
sequence into 2*CP chunks, FP8 kernels want multiples of 8/16) every sequence is sent padded to
a multiple of m, with `pad_id` and labels -100 (no loss token on the padding): `padded` rounds
the row width up; `packed` pads each sample's segment, so `cu_seqlens` bounds the padded
segments (every length a multiple of m), `position_ids` restart at 0 at each bound and count
through the padding (a model that derives the segments from `position_ids` finds the same
ones), `max_seqlen` is the longest padded segment, and `cu_seqlens_unpadded` ([n+1], int32)
bounds the real tokens inside them (Transformer Engine's `cu_seqlens_q` beside
`cu_seqlens_q_padded`). Causal attention keeps a sample's real tokens from seeing its padding.
Vision samples add `pixel_values` (concatenated patches in their stored dtype: raw uint8,
bfloat16 bits or float32; with `pixel_rows`, the samples' own arrays as `Rows`, which the wire
sends as one tensor without concatenating them in memory) and `image_grid_thw`. The trainer
widens ids and normalizes pixels on its device (`StreamBatch.to_model_inputs`), so the wire
carries ~9 bytes per padded token.
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


@dataclass(frozen=True)
class Rows:
    """A tensor held as blocks of rows: `np.concatenate(parts)` on the wire, never in memory
    (a VLM batch's pixel patches are 10-100 MB: their copy into one array was the replica's
    largest cost)."""

    parts: tuple[np.ndarray, ...]

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def loss_tokens(arrays: dict[str, np.ndarray]) -> int:
    """Tokens of a collated batch that contribute to the loss (label != -100): padding and the
    packed layout's masked first labels are already -100 there."""
    return int(np.count_nonzero(arrays["labels"] != IGNORE_INDEX))


def collate(pieces: Sequence[Piece], mode: str, pad_id: int = 0, *, pixel_rows: bool = False,
            pad_to_multiple: int | None = None) -> dict[str, np.ndarray | Rows]:
    if not pieces:
        raise ValueError("cannot collate an empty batch")
    m = pad_to_multiple or 1
    if m < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    if mode == "padded":
        out = _padded(pieces, pad_id, m)
    elif mode == "packed":
        out = _packed(pieces) if m == 1 else _packed_to_multiple(pieces, pad_id, m)
    else:
        raise ValueError(f"unknown collate mode {mode!r} (expected 'padded' or 'packed')")
    out.update(_vision(pieces, pixel_rows))
    return out


def _padded(pieces: Sequence[Piece], pad_id: int, multiple: int) -> dict[str, np.ndarray]:
    lens = [len(p.input_ids) for p in pieces]
    b, width = len(pieces), -(-max(lens) // multiple) * multiple
    input_ids = np.full((b, width), pad_id, dtype=np.int32)
    labels = np.full((b, width), IGNORE_INDEX, dtype=np.int32)
    mask = np.zeros((b, width), dtype=np.bool_)
    for i, (p, n) in enumerate(zip(pieces, lens, strict=True)):
        input_ids[i, :n] = p.input_ids
        labels[i, :n] = p.labels
        mask[i, :n] = True
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _packed(pieces: Sequence[Piece]) -> dict[str, np.ndarray]:
    lens = np.array([len(p.input_ids) for p in pieces], dtype=np.int32)
    cu = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    # One copy each: concatenate straight into the wire dtype.
    input_ids = np.concatenate([p.input_ids for p in pieces], dtype=np.int32)
    labels = np.concatenate([p.labels for p in pieces], dtype=np.int32)
    labels[cu[:-1][lens > 0]] = IGNORE_INDEX
    # position_ids restart per sample: global index minus the start of its sample.
    pos = np.arange(int(cu[-1]), dtype=np.int32)
    pos -= np.repeat(cu[:-1], lens)
    return {
        "input_ids": input_ids[None, :],
        "labels": labels[None, :],
        "position_ids": pos[None, :],
        "cu_seqlens": cu,
        "max_seqlen": np.array(int(lens.max()), dtype=np.int32),
    }


def _packed_to_multiple(pieces: Sequence[Piece], pad_id: int, multiple: int
                        ) -> dict[str, np.ndarray]:
    lens = np.array([len(p.input_ids) for p in pieces], dtype=np.int32)
    sent = -(-lens // multiple) * multiple
    cu = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(sent, out=cu[1:])
    cu_real = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu_real[1:])
    # Where each real token goes: its sample's padded start plus its offset in the sample.
    at = np.arange(int(cu_real[-1]), dtype=np.int64)
    at += np.repeat(cu[:-1] - cu_real[:-1], lens)
    total = int(cu[-1])
    input_ids = np.full(total, pad_id, dtype=np.int32)
    labels = np.full(total, IGNORE_INDEX, dtype=np.int32)
    input_ids[at] = np.concatenate([p.input_ids for p in pieces])
    labels[at] = np.concatenate([p.labels for p in pieces])
    labels[cu[:-1][lens > 0]] = IGNORE_INDEX  # a sample's first token is predicted by nothing
    pos = np.arange(total, dtype=np.int32)
    pos -= np.repeat(cu[:-1], sent)
    return {
        "input_ids": input_ids[None, :],
        "labels": labels[None, :],
        "position_ids": pos[None, :],
        "cu_seqlens": cu,
        "cu_seqlens_unpadded": cu_real,
        "max_seqlen": np.array(int(sent.max()), dtype=np.int32),
    }


def _vision(pieces: Sequence[Piece], pixel_rows: bool) -> dict[str, np.ndarray | Rows]:
    pv = [p.sample.pixel_values for p in pieces if p.sample.pixel_values is not None]
    if not pv:
        return {}
    dtypes = {a.dtype for a in pv}
    if len(dtypes) > 1:
        ids = [p.sample.sample_id for p in pieces if p.sample.pixel_values is not None]
        raise ValueError(f"samples {ids} mix pixel dtypes {sorted(map(str, dtypes))}: one job "
                         "stores one preprocess.pixel_dtype")
    grids = [p.sample.image_grid_thw for p in pieces if p.sample.image_grid_thw is not None]
    return {
        "pixel_values": Rows(tuple(pv)) if pixel_rows else np.concatenate(pv),
        "image_grid_thw": np.concatenate(grids).astype(np.int64, copy=False),
    }
