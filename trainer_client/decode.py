"""odb.v1 Batch -> dict of torch tensors without copying the payload.

Tensors are `torch.frombuffer` views over the received message bytes (read-only memory: move
them to the device or `.clone()` before writing in place).
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from dataclasses import dataclass

import torch

from trainer_client.wire.odb.v1 import data_service_pb2 as pb

if sys.byteorder != "little":  # the wire is little-endian; views would be wrong
    raise ImportError("trainer_client needs a little-endian host")

_DTYPES: dict[int, torch.dtype] = {
    pb.INT32: torch.int32,
    pb.INT64: torch.int64,
    pb.FLOAT32: torch.float32,
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT16: torch.float16,
    pb.UINT8: torch.uint8,
    pb.BOOL: torch.bool,
}


@dataclass(frozen=True)
class BatchInfo:
    """Where a batch sits in the plan and the counts exact loss scaling needs."""

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
    filler: bool = False  # quota mode's closing step: zero loss weight, not a delivery


class StreamBatch(dict):
    """A dict of tensors (pass `**batch` to the model) with the plan metadata on `.info`."""

    info: BatchInfo

    def digest(self) -> str:
        """SHA-256 of step, sample ids and every tensor's name, dtype, shape and bytes: equal
        digests mean byte-identical batches (how a resumed rank can audit a redelivery)."""
        h = hashlib.sha256(f"{self.info.step}|{','.join(self.info.sample_ids)}".encode())
        for name in sorted(self):
            t = self[name]
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def tensor_from_wire(t: pb.Tensor) -> torch.Tensor:
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise ValueError(f"tensor {t.name!r}: unknown wire dtype {t.dtype}")
    shape = tuple(t.shape)
    if not t.data:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": by design
        return torch.frombuffer(t.data, dtype=dtype).reshape(shape)


def decode_batch(b: pb.Batch) -> StreamBatch:
    out = StreamBatch((t.name, tensor_from_wire(t)) for t in b.tensors)
    i = b.info
    out.info = BatchInfo(
        step=b.step, epoch=b.epoch, rank=b.rank, world_size=i.world_size,
        sample_ids=tuple(b.sample_ids), step_samples=i.step_samples, step_tokens=i.step_tokens,
        rank_samples=i.rank_samples, rank_tokens=i.rank_tokens,
        step_loss_tokens=i.step_loss_tokens, rank_loss_tokens=i.rank_loss_tokens,
        collate=b.collate, over_budget=b.over_budget, filler=b.filler,
    )
    return out
