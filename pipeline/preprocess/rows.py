"""ProcessedSample / QuarantinedRecord <-> one Arrow table row (the Ray Data block format).

One fixed schema for every block, so blocks with and without images, or made only of
quarantined rows, always concatenate. Arrays travel as raw little-endian bytes (binary columns):
ragged numpy columns would otherwise become Ray tensor or pickled extension types whose exact
type depends on what happens to be in a block.

Copies: a Ray block crosses processes once, when Ray serializes it into the object store. So
building a block copies only small payloads (ids, labels: concatenated, cheaper than a chunk
each); a large one (an image's patches) becomes a chunk of its own over the sample's own memory.
Reading one back (`from_table`) makes numpy views of the block's buffers, no copy: for an
object read from Ray's object store, they view its shared memory (a sample holds its block).
Copying ~6 MB of patches per 1024 x 1024 image twice more, into one block buffer and out into
Python bytes, cost Ray's workers and driver more CPU than the resize (bench/image_bench.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.quarantine import QuarantineReason

Item = ProcessedSample | QuarantinedRecord

SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("source", pa.string()),
    ("row", pa.int64()),
    ("num_tokens", pa.int64()),
    ("num_visual_tokens", pa.int64()),
    ("cost", pa.int64()),
    ("truncated", pa.bool_()),
    ("input_ids", pa.binary()),  # int32 LE
    ("labels", pa.binary()),  # int32 LE
    ("pixel_values", pa.binary()),  # pixel_dtype LE, [patches, pixel_dim]; empty = no images
    ("pixel_dim", pa.int64()),
    ("pixel_dtype", pa.string()),  # numpy dtype string: "|u1", "<u2" (bfloat16 bits), "<f4"
    ("image_grid_thw", pa.binary()),  # int64 LE, [num_images, 3]
    ("quarantine_reason", pa.string()),  # "" for a sample
    ("quarantine_detail", pa.string()),
])

# What the planner needs, and nothing else (no payload columns).
MEASURE_COLUMNS = ["sample_id", "source", "row", "num_tokens", "num_visual_tokens", "cost",
                   "quarantine_reason"]


_EMPTY = np.empty(0, np.uint8)
_EMPTY.flags.writeable = False


def _le_bytes(arr: np.ndarray | None, dtype: str | np.dtype) -> np.ndarray:
    """`arr` as its little-endian bytes, a view where it already is (the usual case)."""
    if arr is None:
        return _EMPTY
    return np.ascontiguousarray(arr, dtype=dtype).reshape(-1).view(np.uint8)


_MAX_CHUNK_BYTES = 2**31 - 1  # a binary array's int32 offsets
# A payload at least this big is a chunk of its own, over its own memory (no copy); smaller
# ones are concatenated into shared chunks.
_OWN_CHUNK_BYTES = 1 << 20


def _binary_chunk(parts: list[np.ndarray]) -> pa.Array:
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([p.nbytes for p in parts], out=offsets[1:])  # < 2 GiB: see _binary_column
    data = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _EMPTY
    return pa.Array.from_buffers(pa.binary(), len(parts),
                                 [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _binary_column(parts: list[np.ndarray]) -> pa.ChunkedArray:
    """One Arrow binary column from byte views: small ones copied together into chunks of
    < 2 GiB, each large one a chunk over its own memory (`from_pydict` on `bytes` copied every
    payload twice: `tobytes`, then into Arrow)."""
    chunks, group, size = [], [], 0
    for part in parts:
        if part.nbytes > _MAX_CHUNK_BYTES:
            raise ValueError(f"one payload of {part.nbytes} bytes exceeds Arrow's 2 GiB binary "
                             "value limit")
        if size + part.nbytes > _MAX_CHUNK_BYTES or (group and part.nbytes >= _OWN_CHUNK_BYTES):
            chunks.append(_binary_chunk(group))
            group, size = [], 0
        if part.nbytes >= _OWN_CHUNK_BYTES:
            chunks.append(_binary_chunk([part]))
            continue
        group.append(part)
        size += part.nbytes
    if group or not chunks:
        chunks.append(_binary_chunk(group))
    return pa.chunked_array(chunks, type=pa.binary())


def _binary_views(column: pa.ChunkedArray) -> list[np.ndarray]:
    """Each value of a binary column as a read-only uint8 view of its buffer (no copy)."""
    out: list[np.ndarray] = []
    for chunk in column.chunks:
        _, offsets_buf, data_buf = chunk.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=len(chunk) + 1,
                                offset=4 * chunk.offset).tolist()
        data = _EMPTY if data_buf is None else np.frombuffer(data_buf, dtype=np.uint8)
        data.flags.writeable = False  # a block built in this process shares its samples' memory
        out.extend(data[offsets[i] : offsets[i + 1]] for i in range(len(chunk)))
    return out


def to_table(items: Sequence[Item]) -> pa.Table:
    cols: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for it in items:
        cols["source"].append(it.source)
        cols["row"].append(it.row)
        cols["sample_id"].append(it.sample_id)
        if isinstance(it, QuarantinedRecord):
            for name, v in (("num_tokens", 0), ("num_visual_tokens", 0), ("cost", 0),
                            ("truncated", False), ("input_ids", _EMPTY), ("labels", _EMPTY),
                            ("pixel_values", _EMPTY), ("pixel_dim", 0), ("pixel_dtype", ""),
                            ("image_grid_thw", _EMPTY),
                            ("quarantine_reason", it.reason), ("quarantine_detail", it.detail)):
                cols[name].append(v)
            continue
        pv = it.pixel_values
        pv_dtype = None if pv is None else pv.dtype.newbyteorder("<")
        cols["num_tokens"].append(it.num_tokens)
        cols["num_visual_tokens"].append(it.num_visual_tokens)
        cols["cost"].append(it.cost)
        cols["truncated"].append(it.truncated)
        cols["input_ids"].append(_le_bytes(it.input_ids, "<i4"))
        cols["labels"].append(_le_bytes(it.labels, "<i4"))
        cols["pixel_values"].append(_le_bytes(pv, pv_dtype))
        cols["pixel_dim"].append(0 if pv is None else int(pv.shape[1]))
        cols["pixel_dtype"].append("" if pv_dtype is None else pv_dtype.str)
        cols["image_grid_thw"].append(_le_bytes(it.image_grid_thw, "<i8"))
        cols["quarantine_reason"].append("")
        cols["quarantine_detail"].append("")
    arrays = [_binary_column(cols[f.name]) if pa.types.is_binary(f.type)
              else pa.array(cols[f.name], type=f.type) for f in SCHEMA]
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def from_row(row: dict[str, Any]) -> Item:
    """A row's item; its binary fields may be `bytes` or uint8 arrays. Arrays are read-only
    views over them (no copy). The wire is little-endian, so views are in native order."""
    if row["quarantine_reason"]:
        return QuarantinedRecord(row["source"], int(row["row"]),
                                 QuarantineReason(row["quarantine_reason"]),
                                 row["quarantine_detail"] or "")
    pv = grid = None
    if len(row["image_grid_thw"]):
        grid = np.frombuffer(row["image_grid_thw"], dtype="<i8").reshape(-1, 3)
        pv = np.frombuffer(row["pixel_values"], dtype=np.dtype(row["pixel_dtype"]))
        pv = pv.reshape(-1, int(row["pixel_dim"]))
    return ProcessedSample(
        sample_id=row["sample_id"], source=row["source"], row=int(row["row"]),
        input_ids=np.frombuffer(row["input_ids"], dtype="<i4"),
        labels=np.frombuffer(row["labels"], dtype="<i4"),
        num_visual_tokens=int(row["num_visual_tokens"]), cost=int(row["cost"]),
        pixel_values=pv, image_grid_thw=grid, truncated=bool(row["truncated"]),
    )


def from_table(table: pa.Table) -> list[Item]:
    """Every row's item; arrays are views of the table's buffers (see the module docstring)."""
    binary = [f.name for f in SCHEMA if pa.types.is_binary(f.type)]
    cols: dict[str, list[Any]] = table.select(
        [f.name for f in SCHEMA if f.name not in binary]).to_pydict()
    cols.update((name, _binary_views(table.column(name))) for name in binary)
    return [from_row({name: values[i] for name, values in cols.items()})
            for i in range(table.num_rows)]
