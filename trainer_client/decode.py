"""odb.v1 Batch -> a dict of tensors (torch when installed, else numpy) and the model's inputs.

Tensors are views over the payload bytes read once out of the message (read-only memory: move
them to the device or copy before writing in place); a batch that came in chunks has tensors of
its own (`batch_assembly`). They keep their compact wire dtypes
(int32 ids, bool mask, uint8 pixels); `StreamBatch.to_model_inputs(device, dtype)` does the
conversions the model wants on the device, after the transfer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import numpy as np

from trainer_client.pixels import PixelNorm, bfloat16_to_float32, normalize_numpy, normalize_torch
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire_format import NUMPY_DTYPES, WIRE_DTYPES

if sys.byteorder != "little":  # the wire is little-endian; views would be wrong
    raise ImportError("trainer_client needs a little-endian host")

TensorKind = Literal["auto", "torch", "numpy"]
_INT64_INPUTS = ("input_ids", "labels", "attention_mask", "position_ids", "image_grid_thw")
_NOT_INPUTS = ("max_seqlen", "cu_seqlens_unpadded")  # read by the varlen names, or kept apart


@dataclass(frozen=True)
class BatchInfo:
    """Where a batch sits in the plan and the counts exact loss scaling needs.

    Global steps (docs/global-steps.md): a rank gets `micro_count` batches per step, micro-batch
    `micro_index` of them here; `step_*` are the totals of the whole step (every rank, every
    micro-batch), `rank_*` this micro-batch's, and `optimizer_step` is the step's ordinal among
    the job's trained steps (the same at any world size). Without global steps a batch is its
    rank's only one in the step (`micro_count` 1) and `optimizer_step` is None.
    """

    step: int
    epoch: int
    rank: int
    world_size: int
    sample_ids: tuple[str, ...]
    step_samples: int
    step_tokens: int
    rank_samples: int
    rank_tokens: int
    step_loss_tokens: int
    rank_loss_tokens: int
    collate: str
    over_budget: bool
    # A batch that only keeps this rank's collectives in step, with loss scale 0 and no samples
    # delivered: quota mode's closing step (a copy of a real sample) or a stand-in step of the
    # aligned loader (trainer_client.loader).
    filler: bool = False
    micro_index: int = 0
    micro_count: int = 1
    optimizer_step: int | None = None

    @property
    def last_micro(self) -> bool:
        """This batch ends the rank's share of its step: the optimizer steps after it."""
        return self.micro_index == self.micro_count - 1


class ModelInputs(dict):
    """The model's keyword arguments on the device (`model(**inputs)`), plan metadata on
    `.info`."""

    info: BatchInfo


class StreamBatch(dict):
    """A dict of wire tensors with the plan metadata on `.info`; see `to_model_inputs`."""

    info: BatchInfo
    pixel_norm: PixelNorm | None = None
    loader_state: dict[str, Any] | None = None  # set by StreamLoader: its state after this batch

    @property
    def nbytes(self) -> int:
        """Its tensors' bytes: what it holds of the stream's byte window (`prefetch_bytes`)."""
        return sum(int(t.nbytes) if _is_numpy(t) else t.numel() * t.element_size()
                   for t in self.values())

    def digest(self) -> str:
        """SHA-256 of step, sample ids, pixel normalization and every tensor's name, dtype,
        shape and bytes: equal digests mean byte-identical batches (how a resumed rank can
        audit a redelivery)."""
        micro = (f"/{self.info.micro_index}" if self.info.optimizer_step is not None else "")
        h = hashlib.sha256(f"{self.info.step}{micro}|{','.join(self.info.sample_ids)}".encode())
        if self.pixel_norm is not None:
            h.update(repr(self.pixel_norm).encode())
        for name in sorted(self):
            t = self[name]
            h.update(f"{name}|{_wire_dtype(t)}|{tuple(t.shape)}".encode())
            h.update(_raw_bytes(t))
        return h.hexdigest()

    def to_model_inputs(self, device: Any = None, dtype: Any = None) -> ModelInputs:
        """What the model's forward takes, converted on `device` after the transfer.

        int64 `input_ids`, `labels`, `attention_mask`, `position_ids`, `image_grid_thw`;
        `pixel_values` normalized in `dtype` (default float32); packed batches get the
        flash-attention varlen names HF models take (`cu_seq_lens_q/k`, `max_length_q/k`: the
        segments as sent, padding included). A job's `pad_to_multiple` adds
        `cu_seqlens_unpadded` (the real tokens' bounds): it stays on the batch
        (`batch["cu_seqlens_unpadded"]`, for Transformer Engine / Megatron), not in the inputs.
        numpy batches (no torch installed) convert in host memory; `device` must be None.
        """
        if self and _is_numpy(next(iter(self.values()))):
            if device not in (None, "cpu"):
                raise ValueError(f"a numpy batch cannot move to device {device!r}")
            out = ModelInputs(_numpy_inputs(self, dtype))
        else:
            out = ModelInputs(_torch_inputs(self, device, dtype))
        out.info = self.info
        return out


def _is_numpy(t: Any) -> bool:
    return isinstance(t, np.ndarray)


def _wire_dtype(t: Any) -> int:
    """The wire DType of a numpy or torch tensor (so a digest does not depend on the kind)."""
    if _is_numpy(t):
        return WIRE_DTYPES[t.dtype]
    return next(k for k, v in torch_dtypes().items() if v == t.dtype)


def _raw_bytes(t: Any) -> bytes:
    if _is_numpy(t):
        return np.ascontiguousarray(t).tobytes()
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _varlen_names(out: dict[str, Any], cu: Any, max_len: int) -> None:
    out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)


def _torch_inputs(batch: StreamBatch, device: Any, dtype: Any) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for name, t in batch.items():
        if name in _NOT_INPUTS:
            continue
        moved = t.to(device, non_blocking=True) if device is not None else t
        if name in _INT64_INPUTS:
            moved = moved.long()
        elif name == "pixel_values":
            if moved.dtype == torch.uint8:
                if batch.pixel_norm is None:
                    raise ValueError(f"step {batch.info.step}: uint8 pixel_values arrived "
                                     "without pixel_norm")
                moved = normalize_torch(moved, batch.pixel_norm, dtype)
            else:
                moved = moved.to(dtype or torch.float32)
        out[name] = moved
    if "cu_seqlens" in out:
        _varlen_names(out, out.pop("cu_seqlens"), int(batch["max_seqlen"]))
    return out


def _numpy_inputs(batch: StreamBatch, dtype: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, a in batch.items():
        if name in _NOT_INPUTS:
            continue
        if name in _INT64_INPUTS:
            a = a.astype(np.int64)
        elif name == "pixel_values":
            if a.dtype == np.uint8:
                if batch.pixel_norm is None:
                    raise ValueError(f"step {batch.info.step}: uint8 pixel_values arrived "
                                     "without pixel_norm")
                a = normalize_numpy(a, batch.pixel_norm)
            elif a.dtype == np.uint16:  # bfloat16 bits: numpy has no bfloat16
                a = bfloat16_to_float32(a)
            a = a.astype(dtype or np.float32, copy=False)
        out[name] = a
    if "cu_seqlens" in out:
        _varlen_names(out, out.pop("cu_seqlens"), int(batch["max_seqlen"]))
    return out


@cache
def torch_dtypes() -> dict[int, Any]:
    """wire DType -> torch dtype (torch imported, and its read-only warning had, once)."""
    import torch

    # torch warns, once per process, that a tensor over read-only bytes is read-only: it is,
    # by design (the module docstring). Have that warning now, silenced, and not around each
    # decode: `catch_warnings` swaps process-wide state, which the stream's receiver thread
    # must not do while the trainer's own threads run (their warnings would be lost, or their
    # filters replaced).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)
    return {k: torch.bfloat16 if k == pb.BFLOAT16 else torch.from_numpy(np.empty(0, v)).dtype
            for k, v in NUMPY_DTYPES.items()}


def resolve_tensor_kind(kind: TensorKind) -> Literal["torch", "numpy"]:
    """"auto" -> "torch" when torch is importable, else "numpy"."""
    if kind == "auto":
        kind = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    if kind not in ("torch", "numpy"):
        raise ValueError(f"tensors must be 'auto', 'torch' or 'numpy', got {kind!r}")
    if kind == "torch":
        torch_dtypes()  # on the caller's thread, before any receiver thread decodes
    return kind


def tensor_from_wire(t: pb.Tensor, kind: Literal["torch", "numpy"] = "torch") -> Any:
    if t.dtype not in NUMPY_DTYPES:
        raise ValueError(f"tensor {t.name!r}: unknown wire dtype {t.dtype}")
    shape = tuple(t.shape)
    data = t.data  # each read of a bytes field copies it out of the message: read it once
    if kind == "numpy":
        dt = NUMPY_DTYPES[t.dtype]
        return np.frombuffer(data, dtype=dt).reshape(shape) if data else np.empty(shape, dt)
    import torch

    dtype = torch_dtypes()[t.dtype]
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def decode_batch(b: pb.Batch, kind: Literal["torch", "numpy"] = "torch") -> StreamBatch:
    return stream_batch(b, ((t.name, tensor_from_wire(t, kind)) for t in b.tensors))


def stream_batch(b: pb.Batch, tensors: Iterable[tuple[str, Any]]) -> StreamBatch:
    """The StreamBatch of `b`'s metadata and the given (name, tensor) pairs."""
    out = StreamBatch(tensors)
    i = b.info
    out.info = BatchInfo(
        step=b.step, epoch=b.epoch, rank=b.rank, world_size=i.world_size,
        sample_ids=tuple(b.sample_ids), step_samples=i.step_samples, step_tokens=i.step_tokens,
        rank_samples=i.rank_samples, rank_tokens=i.rank_tokens,
        step_loss_tokens=i.step_loss_tokens, rank_loss_tokens=i.rank_loss_tokens,
        collate=b.collate, over_budget=b.over_budget, filler=b.filler,
        micro_index=i.micro_index, micro_count=i.micro_count or 1,
        optimizer_step=i.optimizer_step if i.micro_count else None,
    )
    if b.HasField("pixel_norm"):
        out.pixel_norm = PixelNorm.from_wire(b.pixel_norm)
    return out
