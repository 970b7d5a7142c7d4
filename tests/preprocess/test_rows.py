"""rows.to_table / from_row: every field survives the Arrow block format byte for byte."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.preprocess import rows
from pipeline.preprocess.rows import SCHEMA, from_table, to_table
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.quarantine import QuarantineReason


def _sample(row: int, *, pixels: np.ndarray | None = None) -> ProcessedSample:
    ids = np.arange(row, row + 5 + row, dtype=np.int32)
    grid = None if pixels is None else np.array([[1, 2, 2]], dtype=np.int64)
    return ProcessedSample(f"s.jsonl:{row}", "s.jsonl", row, ids, ids.copy(), cost=len(ids),
                           num_visual_tokens=0 if pixels is None else 1, pixel_values=pixels,
                           image_grid_thw=grid, truncated=row % 2 == 1)


@pytest.mark.parametrize("dtype", ["|u1", "<u2", "<f4", ">f4"])
def test_round_trip_mixed_block(dtype: str) -> None:
    # Non-contiguous and big-endian pixels must come back as the same values, little-endian.
    pixels = (np.arange(48, dtype=np.float64).reshape(4, 12)[:, ::2]).astype(dtype)
    items = [_sample(0), QuarantinedRecord("s.jsonl", 1, QuarantineReason.BAD_JSON, "x"),
             _sample(2, pixels=pixels), _sample(3)]
    table = to_table(items)
    assert table.schema == SCHEMA and table.num_rows == 4
    back = from_table(table)
    assert isinstance(back[1], QuarantinedRecord) and back[1].detail == "x"
    for want, got in zip([items[0], items[2], items[3]], [back[0], back[2], back[3]],
                         strict=True):
        assert isinstance(got, ProcessedSample)
        assert got.truncated == want.truncated and got.cost == want.cost
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        np.testing.assert_array_equal(got.labels, want.labels)
    np.testing.assert_array_equal(back[2].pixel_values, pixels)
    assert back[2].pixel_values.dtype == np.dtype(dtype).newbyteorder("<")
    assert back[0].pixel_values is None


def test_blocks_concatenate_and_slice() -> None:
    # Ray slices blocks and the gather task concatenates single rows of several blocks.
    a, b = to_table([_sample(0), _sample(1)]), to_table([_sample(5)])
    joined = pa.concat_tables([a.slice(1, 1), b]).combine_chunks()
    assert [s.sample_id for s in from_table(joined)] == ["s.jsonl:1", "s.jsonl:5"]
    assert to_table([]).num_rows == 0


def test_binary_columns_split_below_the_int32_offset_limit(monkeypatch) -> None:
    # A block over 2 GiB of payload must not wrap its int32 offsets: it is cut into chunks.
    monkeypatch.setattr(rows, "_MAX_CHUNK_BYTES", 64)
    items = [_sample(i) for i in range(6)]  # 20-40 bytes of ids each
    table = to_table(items)
    assert table.column("input_ids").num_chunks > 1
    assert [s.digest() for s in from_table(table)] == [s.digest() for s in items]
    big = _sample(0, pixels=np.zeros((1, 65), np.uint8))
    with pytest.raises(ValueError, match="2 GiB"):
        to_table([big])


def test_a_large_payload_is_not_copied_into_the_block_nor_out_of_it() -> None:
    # ~6 MB of patches per 1024 x 1024 image: Ray's serialization into the object store is the
    # one copy a block needs; building it and reading it back make none.
    pixels = np.arange(1176 * 1024, dtype=np.uint32).astype(np.uint8).reshape(-1, 1176)
    items = [_sample(0), _sample(1, pixels=pixels), _sample(2)]
    table = to_table(items)
    column = table.column("pixel_values")
    own = [c for c in column.chunks if c.buffers()[2] is not None
           and c.buffers()[2].address == pixels.__array_interface__["data"][0]]
    assert len(own) == 1 and len(own[0]) == 1, "the patches are a chunk over their own memory"
    assert table.column("input_ids").num_chunks == 1, "small payloads share one chunk"
    back = from_table(table)
    assert np.shares_memory(back[1].pixel_values, pixels), "read back as a view, not a copy"
    assert not back[1].pixel_values.flags.writeable
    assert [s.digest() for s in back] == [s.digest() for s in items]


def test_a_sliced_block_reads_back_its_own_rows() -> None:
    # Ray hands out zero-copy slices (offset > 0) of blocks; views must honour the offset.
    items = [_sample(i, pixels=np.full((3, 4), i, np.uint8) if i % 2 else None)
             for i in range(6)]
    table = to_table(items).slice(2, 3)
    assert [s.digest() for s in from_table(table)] == [s.digest() for s in items[2:5]]
