"""The server's side of the wire: numpy arrays <-> odb.v1 Tensor messages (raw little-endian
C-order bytes + dtype + shape), whole Batch messages, and the check of a client's wire version.
A tensor may come as `collate.Rows` (blocks of rows): its bytes are then the blocks' bytes in
order, each framed from where it lies (never concatenated first).

The dtype table and the version live in `trainer_client.wire_format`, shared with the client.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.preprocess.vision import PIXEL_NORM
from pipeline.service.collate import Rows
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire_format import NUMPY_DTYPES as _FROM_WIRE
from trainer_client.wire_format import WIRE_DTYPES as _TO_WIRE
from trainer_client.wire_format import version_mismatch


def wire_version_problem(open_msg: pb.Open, *, global_steps: bool = False) -> str | None:
    """None when the client decodes this server's wire version (for a job with `global_steps`:
    one with micro-batches); else the details for the FAILED_PRECONDITION the data server must
    answer the Open with (naming both versions):

        problem = wire_version_problem(op)
        if problem:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)

    The client never retries that status when the details carry this message."""
    return version_mismatch(open_msg.wire_version, global_steps=global_steps)


def encode(name: str, array: np.ndarray) -> pb.Tensor:
    return encode_into(pb.Tensor(), name, array)


def encode_into(out: pb.Tensor, name: str, array: np.ndarray) -> pb.Tensor:
    """Fill `out` (e.g. `batch.tensors.add()`, avoiding a nested-message copy)."""
    t = wire_tensor(name, array)
    out.name, out.dtype = name, t.dtype
    out.shape.extend(t.shape)
    out.data = b"".join(t.parts)
    return out


def decode(t: pb.Tensor) -> np.ndarray:
    """numpy view of a Tensor message (the server side and tests; the trainer uses torch)."""
    if t.dtype not in _FROM_WIRE:
        raise ValueError(f"tensor {t.name!r}: unknown wire dtype {t.dtype}")
    return np.frombuffer(t.data, dtype=_FROM_WIRE[t.dtype]).reshape(tuple(t.shape))


def varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_TENSOR_DATA_TAG = b"\x22"  # Tensor.data: field 4, length-delimited
_BATCH_TENSORS_TAG = b"\x42"  # Batch.tensors: field 8, length-delimited
_MESSAGE_BATCH_TAG = b"\x0a"  # ServerMessage.batch: field 1, length-delimited


@dataclass(frozen=True)
class WireTensor:
    """A tensor as it goes on the wire: its DType, shape and bytes (little-endian, C order),
    the bytes as views of the arrays they lie in."""

    dtype: int
    shape: tuple[int, ...]
    parts: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def wire_tensor(name: str, array: np.ndarray | Rows) -> WireTensor:
    """No copy for the usual arrays (little-endian, C-contiguous)."""
    blocks = array.parts if isinstance(array, Rows) else (array,)
    dt = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dt not in _TO_WIRE:
        raise TypeError(f"tensor {name!r}: dtype {array.dtype} has no wire type")
    return WireTensor(_TO_WIRE[dt], tuple(array.shape), tuple(
        byte_view(np.ascontiguousarray(b.astype(dt, copy=False))) for b in blocks))


def byte_view(data: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (zero-size arrays included)."""
    return memoryview(data.reshape(-1).view(np.uint8))


def with_pixel_norm(header: pb.Batch, arrays: dict[str, np.ndarray | Rows]) -> pb.Batch:
    """`header`, or a copy of it with `pixel_norm` when `pixel_values` travels as raw uint8
    (how the trainer turns them into floats) and the header has none yet."""
    pv = arrays.get("pixel_values")
    if pv is None or pv.dtype != np.uint8 or header.HasField("pixel_norm"):
        return header
    own = pb.Batch()
    own.CopyFrom(header)  # the caller's header stays as it was
    PIXEL_NORM.to_wire(own.pixel_norm)
    return own


def batch_message_bytes(header: pb.Batch, arrays: dict[str, np.ndarray | Rows]) -> bytes:
    """A serialized `ServerMessage{batch}`: `header` (a Batch without tensors) plus the arrays,
    framed by hand so each payload is copied once (into the result) instead of through
    tobytes -> message field -> SerializeToString. Valid protobuf (fields may come in any
    order; repeated fields concatenate), deterministic, parsed by the ordinary stubs.
    Raw uint8 `pixel_values` get `pixel_norm` (`with_pixel_norm`)."""
    parts: list[bytes | memoryview] = [with_pixel_norm(header, arrays).SerializeToString()]
    for name, array in arrays.items():
        t = wire_tensor(name, array)
        meta_bytes = pb.Tensor(name=name, dtype=t.dtype, shape=t.shape).SerializeToString()
        tensor_len = len(meta_bytes) + 1 + len(varint(t.nbytes)) + t.nbytes
        parts += [_BATCH_TENSORS_TAG, varint(tensor_len), meta_bytes,
                  _TENSOR_DATA_TAG, varint(t.nbytes), *t.parts]
    body_len = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    return b"".join([_MESSAGE_BATCH_TAG, varint(body_len), *parts])
