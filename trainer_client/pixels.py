"""Pixel patches on the trainer's side: raw uint8 (or bfloat16 bits) -> the model's floats.

Images travel as raw uint8 patches, a quarter of float32's bytes; normalization happens here, on
the trainer's device, after the transfer. A patch row is flattened channel-major (Qwen2-VL's
C x T x P x P), so channel c is the c-th of C equal blocks of the row:

    value = (x * rescale - mean[c]) / std[c]

Equal to the image processor's float32 output to float rounding (tests/client/test_pixels.py
checks it against the real processor on real pictures). torch is imported only when a torch
tensor is normalized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer_client.wire.odb.v1 import data_service_pb2 as pb


@dataclass(frozen=True)
class PixelNorm:
    """The image processor's rescale factor and per-channel mean and std."""

    rescale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.mean or len(self.mean) != len(self.std):
            raise ValueError(f"PixelNorm needs one mean and one std per channel, got "
                             f"mean={self.mean} std={self.std}")

    @classmethod
    def from_wire(cls, msg: pb.PixelNorm) -> PixelNorm:
        return cls(float(msg.rescale), tuple(msg.mean), tuple(msg.std))

    def to_wire(self, out: pb.PixelNorm) -> None:
        out.rescale = self.rescale
        out.mean[:] = self.mean
        out.std[:] = self.std


def _channel_view(x: Any, channels: int) -> Any:
    rows, width = x.shape
    if width % channels:
        raise ValueError(f"pixel_values rows of {width} values do not split into "
                         f"{channels} channel blocks")
    return x.reshape(rows, channels, width // channels)


def normalize_torch(pixels: Any, norm: PixelNorm, dtype: Any = None) -> Any:
    """uint8 [patches, C*T*P*P] torch tensor -> normalized float tensor on the same device."""
    import torch

    out = pixels.to(torch.float32)
    view = _channel_view(out, len(norm.mean))
    mean = torch.tensor(norm.mean, dtype=torch.float32, device=out.device)[None, :, None]
    std = torch.tensor(norm.std, dtype=torch.float32, device=out.device)[None, :, None]
    view.mul_(norm.rescale).sub_(mean).div_(std)
    return out if dtype is None else out.to(dtype)


def normalize_numpy(pixels: np.ndarray, norm: PixelNorm) -> np.ndarray:
    """uint8 [patches, C*T*P*P] array -> normalized float32 array."""
    out = pixels.astype(np.float32)
    view = _channel_view(out, len(norm.mean))
    view *= np.float32(norm.rescale)
    view -= np.asarray(norm.mean, np.float32)[None, :, None]
    view /= np.asarray(norm.std, np.float32)[None, :, None]
    return out


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even like torch."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
