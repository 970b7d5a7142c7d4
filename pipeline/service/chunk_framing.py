"""A batch as it goes on the wire: one message, or a `BatchHeader` and bounded `Chunk`s.

A batch whose tensors fit in one chunk travels as one `ServerMessage{batch}` (as it always
did). A larger one (VLM pixel patches: 10-100 MB at the default budget, beyond grpcio's message
limit) travels as a `BatchHeader` (the batch without its tensors' bytes, and each tensor's name,
dtype, shape and byte length), then every tensor's bytes in order as `Chunk`s of at most
`chunk_bytes` each, naming their tensor and offset. The client allocates each tensor once from
the header and writes every chunk into it (`trainer_client.batch_assembly`).

The chunk messages are framed by hand from the collated arrays as they are sent, the pixel
patches straight from the samples' own arrays (`collate.Rows`): one copy of each chunk (into
its message), no copy of the whole batch, and no per-byte Python work. Pure: the same arrays
give the same messages.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.service.collate import Rows
from pipeline.service.wire_codec import (
    WireTensor,
    batch_message_bytes,
    varint,
    wire_tensor,
    with_pixel_norm,
)
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

DEFAULT_CHUNK_BYTES = 1024 * 1024

_MESSAGE_CHUNK_TAG = b"\x22"  # ServerMessage.chunk: field 4, length-delimited
_CHUNK_TENSOR_TAG = b"\x08"  # Chunk.tensor: field 1, varint
_CHUNK_OFFSET_TAG = b"\x10"  # Chunk.offset: field 2, varint
_CHUNK_DATA_TAG = b"\x1a"  # Chunk.data: field 3, length-delimited


@dataclass(frozen=True)
class WireBatch:
    """One rank's batch ready to go: `messages()` yields its serialized ServerMessages."""

    step: int
    nbytes: int  # its tensor bytes: what it holds of the client's byte window
    first: bytes  # the whole batch (one message), or its BatchHeader
    tensors: tuple[WireTensor, ...]  # each tensor's bytes, in order; () when `first` is whole
    chunk_bytes: int

    @property
    def chunks(self) -> int:
        """How many Chunk messages follow `first`."""
        return sum(-(-t.nbytes // self.chunk_bytes) for t in self.tensors)

    def messages(self) -> Iterator[bytes]:
        yield self.first
        for i, t in enumerate(self.tensors):
            for offset, pieces in _chunks(t.parts, self.chunk_bytes):
                yield chunk_message(i, offset, pieces)


def wire_batch(header: pb.Batch, arrays: dict[str, np.ndarray | Rows],
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> WireBatch:
    """`header` (a Batch without tensors) and the collated arrays as one message when their
    bytes fit in `chunk_bytes`, else as a BatchHeader and chunks."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    tensors = {name: wire_tensor(name, a) for name, a in arrays.items()}
    nbytes = sum(t.nbytes for t in tensors.values())
    if nbytes <= chunk_bytes:
        return WireBatch(header.step, nbytes, batch_message_bytes(header, arrays), (),
                         chunk_bytes)
    head = pb.ServerMessage(batch_header=pb.BatchHeader(
        batch=with_pixel_norm(header, arrays),
        tensors=[pb.TensorSpec(name=name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes)
                 for name, t in tensors.items()]))
    return WireBatch(header.step, nbytes, head.SerializeToString(), tuple(tensors.values()),
                     chunk_bytes)


def _chunks(parts: tuple[memoryview, ...], size: int
            ) -> Iterator[tuple[int, list[memoryview]]]:
    """(offset, the views that make it up) of each chunk of `size` bytes of the bytes `parts`
    hold in order (a chunk may span parts: they are views, joined once into its message)."""
    offset, pieces, room = 0, [], size
    for part in parts:
        pos = 0
        while pos < part.nbytes:
            take = min(room, part.nbytes - pos)
            pieces.append(part[pos:pos + take])
            pos, room = pos + take, room - take
            if not room:
                yield offset, pieces
                offset, pieces, room = offset + size, [], size
    if pieces:
        yield offset, pieces


def chunk_message(tensor: int, offset: int, data: list[memoryview]) -> bytes:
    """A serialized `ServerMessage{chunk}`, byte for byte what the stubs would write (zero
    fields left out), with the chunk's bytes (`data`, in pieces) copied once."""
    n = sum(d.nbytes for d in data)
    body = [_CHUNK_TENSOR_TAG + varint(tensor) if tensor else b"",
            _CHUNK_OFFSET_TAG + varint(offset) if offset else b"",
            _CHUNK_DATA_TAG, varint(n)]
    return b"".join([_MESSAGE_CHUNK_TAG, varint(sum(map(len, body)) + n), *body, *data])
