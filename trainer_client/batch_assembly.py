"""A batch that came in chunks, reassembled into its tensors with no extra copy.

A batch larger than one chunk arrives as a `BatchHeader` (the batch without its tensors'
bytes, and each tensor's name, dtype, shape and byte length) and then `Chunk`s carrying every
tensor's bytes in order: tensor 0 from offset 0 to its end, then tensor 1, ... `BatchAssembler`
allocates each tensor once from the header (`torch.empty` / `numpy.empty`) and writes every
chunk into it with one slice assignment (a memcpy: no Python loop over bytes, no
concatenation). A chunk must continue exactly where the previous one ended: one that overlaps
written bytes, leaves a gap, names a tensor the batch does not have, runs past its tensor's end
or is larger than the chunk size raises `ChunkError`, naming what it got and what was due.
The batch exists only once its last byte is written (`complete`): a stream cut mid-batch drops
the assembler, and the service sends the batch again whole.

`StreamReader` turns one call's server messages into whole batches and ENDs. `read_chunk` takes
a Chunk's fields straight out of the serialized ServerMessage, its data as a
view of the received bytes: parsing it with the stubs would copy every chunk twice more (into
the message, then out of it as a new bytes object), several times the cost of the one copy
into the tensor.
"""

from __future__ import annotations

import math
import mmap
from typing import Any, Literal

import numpy as np

from trainer_client.decode import StreamBatch, decode_batch, stream_batch, torch_dtypes
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire_format import NUMPY_DTYPES

_CHUNK_FIELD = 4  # ServerMessage.chunk
_MAPPED_FROM = 1 << 20  # tensors of at least this many bytes get memory mapped of their own
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5  # protobuf wire types


class ChunkError(ValueError):
    """A chunked batch that does not add up (its header, or a chunk out of place)."""


class StreamReader:
    """One call's serialized server messages -> whole batches and ENDs (None while a chunked
    batch is incomplete). A new call gets a new reader: a batch cut off with its call is
    dropped, never handed out."""

    def __init__(self, kind: Literal["torch", "numpy"] = "torch") -> None:
        self.kind = kind
        self._batch: BatchAssembler | None = None

    def read(self, raw: bytes) -> StreamBatch | pb.End | None:
        chunk = read_chunk(raw)
        if chunk is not None:
            if self._batch is None:
                raise ChunkError(f"a chunk (tensor {chunk[0]} offset {chunk[1]}) with no "
                                 "batch header before it")
            self._batch.add(*chunk)
        else:
            msg = pb.ServerMessage.FromString(raw)
            kind = msg.WhichOneof("kind")
            if kind == "batch":
                return decode_batch(msg.batch, self.kind)
            if kind == "end":
                return msg.end
            if kind != "batch_header":
                raise ChunkError(f"a server message of unknown kind {kind!r}")
            if self._batch is not None:
                raise ChunkError(f"step {msg.batch_header.batch.step}: a batch header before "
                                 f"step {self._batch.header.step} was complete")
            self._batch = BatchAssembler(msg.batch_header, self.kind)
        if not self._batch.complete:
            return None
        done, self._batch = self._batch, None
        return done.batch()


class BatchAssembler:
    def __init__(self, header: pb.BatchHeader, kind: Literal["torch", "numpy"] = "torch", *,
                 max_chunk_bytes: int | None = None) -> None:
        """Allocate the tensors `header` announces; `max_chunk_bytes`: refuse larger chunks."""
        self.header = header.batch
        self.max_chunk_bytes = max_chunk_bytes
        self.names: list[str] = []
        self.sizes: list[int] = []
        self._shaped: list[Any] = []  # the tensors as the trainer gets them
        self._views: list[memoryview] = []  # their bytes, written by `add`
        for i, spec in enumerate(header.tensors):
            self._allocate(i, spec, kind)
        self.nbytes = sum(self.sizes)
        self._tensor, self._offset = 0, 0  # where the next chunk must start
        self._skip_empty()

    def _allocate(self, i: int, spec: pb.TensorSpec, kind: str) -> None:
        step = self.header.step
        if spec.name in self.names:
            raise ChunkError(f"step {step}: tensor {i} repeats the name {spec.name!r}")
        if spec.dtype not in NUMPY_DTYPES:
            raise ChunkError(f"step {step}: tensor {i} ({spec.name!r}) has unknown wire dtype "
                             f"{spec.dtype}")
        shape = tuple(spec.shape)
        if any(d < 0 for d in shape):
            raise ChunkError(f"step {step}: tensor {i} ({spec.name!r}) has shape {shape}")
        dt = NUMPY_DTYPES[spec.dtype]
        if spec.nbytes != math.prod(shape) * dt.itemsize:
            raise ChunkError(f"step {step}: tensor {i} ({spec.name!r}) announces {spec.nbytes} "
                             f"bytes, but shape {shape} of {dt} holds "
                             f"{math.prod(shape) * dt.itemsize}")
        memory = _memory(spec.nbytes)
        if kind == "numpy":
            flat = np.frombuffer(memory, np.uint8)
            self._shaped.append(flat.view(dt).reshape(shape))
        else:
            import torch

            flat = torch.frombuffer(memory, dtype=torch.uint8) if spec.nbytes else \
                torch.empty(0, dtype=torch.uint8)
            self._shaped.append(flat.view(torch_dtypes()[spec.dtype]).reshape(shape))
        self._views.append(memoryview(memory))
        self.names.append(spec.name)
        self.sizes.append(spec.nbytes)

    def _skip_empty(self) -> None:
        while self._tensor < len(self.sizes) and self._offset == self.sizes[self._tensor]:
            self._tensor, self._offset = self._tensor + 1, 0

    @property
    def complete(self) -> bool:
        """Every byte of every tensor is written."""
        return self._tensor == len(self.sizes)

    def add(self, tensor: int, offset: int, data: bytes | memoryview) -> None:
        """Write one chunk's bytes at `offset` of tensor number `tensor`."""
        n = len(data) if isinstance(data, bytes) else data.nbytes
        where = f"step {self.header.step}: chunk of {n} bytes at tensor {tensor} offset {offset}"
        if self.complete:
            raise ChunkError(f"{where}: the batch is already complete")
        if not 0 <= tensor < len(self.sizes):
            raise ChunkError(f"{where}: the batch has tensors 0..{len(self.sizes) - 1}")
        if n == 0:
            raise ChunkError(f"{where}: a chunk carries at least one byte")
        if self.max_chunk_bytes is not None and n > self.max_chunk_bytes:
            raise ChunkError(f"{where}: larger than the chunk size {self.max_chunk_bytes}")
        due = (self._tensor, self._offset)
        if (tensor, offset) != due:
            how = "overlaps bytes already written" if (tensor, offset) < due else "leaves a gap"
            raise ChunkError(f"{where}: {how} (the next chunk is due at tensor {due[0]} "
                             f"offset {due[1]})")
        end = offset + n
        if end > self.sizes[tensor]:
            raise ChunkError(f"{where}: runs past the end of tensor {tensor} "
                             f"({self.names[tensor]!r}, {self.sizes[tensor]} bytes)")
        self._views[tensor][offset:end] = data
        self._offset = end
        self._skip_empty()

    def batch(self) -> StreamBatch:
        """The assembled batch (only once `complete`)."""
        if not self.complete:
            raise ChunkError(f"step {self.header.step}: the batch is incomplete (next chunk due "
                             f"at tensor {self._tensor} offset {self._offset})")
        return stream_batch(self.header, zip(self.names, self._shaped, strict=True))


def read_chunk(raw: bytes) -> tuple[int, int, memoryview] | None:
    """(tensor, offset, data) of a serialized `ServerMessage{chunk}`, `data` a view of `raw`;
    None when `raw` is another message (parse it with the stubs)."""
    view = memoryview(raw)
    fields = _fields(view, 0, len(raw))
    if fields is None or [f for f, _, _ in fields] != [_CHUNK_FIELD]:
        return None
    _, start, end = fields[0]
    if start < 0:
        return None
    tensor = offset = 0
    data = view[0:0]
    inner = _fields(view, start, end)
    if inner is None:
        return None
    for field, a, b in inner:
        if field == 1 and a < 0:
            tensor = b
        elif field == 2 and a < 0:
            offset = b
        elif field == 3 and a >= 0:
            data = view[a:b]
    return tensor, offset, data


def _fields(view: memoryview, pos: int, end: int) -> list[tuple[int, int, int]] | None:
    """The fields of the message in view[pos:end] as (number, start, end) for length-delimited
    ones and (number, -1, value) for varints (others skipped); None if it is malformed."""
    out = []
    while pos < end:
        got = _varint(view, pos, end)
        if got is None:
            return None
        key, pos = got
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            got = _varint(view, pos, end)
            if got is None:
                return None
            value, pos = got
            out.append((field, -1, value))
        elif wire_type == _LEN:
            got = _varint(view, pos, end)
            if got is None or got[1] + got[0] > end:
                return None
            n, pos = got
            out.append((field, pos, pos + n))
            pos += n
        elif wire_type in (_I64, _I32):
            pos += 8 if wire_type == _I64 else 4
        else:
            return None
    return out if pos == end else None


def _varint(view: memoryview, pos: int, end: int) -> tuple[int, int] | None:
    value = shift = 0
    while pos < end and shift < 64:
        b = view[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7
    return None


def _memory(nbytes: int) -> mmap.mmap | bytearray:
    """Writable memory for one tensor. A large one is mapped from the OS on its own and given
    back whole when its last tensor goes: from malloc, freed batches of tens of MB stayed in
    the heap (glibc raises its mmap threshold after the first free), and a client's RSS grew
    by several batches beyond what its window holds."""
    if nbytes >= _MAPPED_FROM:
        return mmap.mmap(-1, nbytes)
    return bytearray(nbytes)
