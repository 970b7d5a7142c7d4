"""Collation: padded and packed layouts, labels, positions, cu_seqlens, truncation, vision."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.preprocess.sample import ProcessedSample
from pipeline.service.collate import IGNORE_INDEX, Piece, collate, loss_tokens
from pipeline.service.wire_codec import decode, encode


def sample(row: int, n: int, masked: int = 0, vision: bool = False) -> ProcessedSample:
    ids = np.arange(1, n + 1, dtype=np.int32) + 100 * row
    labels = ids.copy()
    labels[:masked] = IGNORE_INDEX
    pv = np.full((4, 6), row, np.float32) if vision else None
    grid = np.array([[1, 2, 2]], np.int64) if vision else None
    return ProcessedSample(f"s:{row}", "s", row, ids, labels, pixel_values=pv,
                           image_grid_thw=grid)


def test_padded_shapes_labels_mask_positions():
    out = collate([Piece(sample(0, 3)), Piece(sample(1, 5, masked=2))], "padded", pad_id=7)
    assert set(out) == {"input_ids", "attention_mask", "labels", "position_ids"}
    assert out["input_ids"].shape == (2, 5) and out["input_ids"].dtype == np.int64
    assert out["input_ids"][0].tolist() == [1, 2, 3, 7, 7]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert out["labels"][0].tolist() == [1, 2, 3, -100, -100]
    assert out["labels"][1].tolist() == [-100, -100, 103, 104, 105]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]


def test_packed_is_one_row_with_cu_seqlens_and_restarting_positions():
    out = collate([Piece(sample(0, 3)), Piece(sample(1, 4)), Piece(sample(2, 2))], "packed")
    assert out["input_ids"].shape == (1, 9)
    assert out["cu_seqlens"].dtype == np.int32
    assert out["cu_seqlens"].tolist() == [0, 3, 7, 9]
    assert int(out["max_seqlen"]) == 4
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]
    # First label of every sample masked: no cross-sample prediction after the model's shift.
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 102, 103, 104, -100, 202]]
    assert "attention_mask" not in out


def test_truncation_cuts_payload_in_both_layouts():
    pieces = [Piece(sample(0, 10), keep=4), Piece(sample(1, 3))]
    padded = collate(pieces, "padded")
    assert padded["input_ids"].shape == (2, 4)
    assert padded["input_ids"][0].tolist() == [1, 2, 3, 4]
    packed = collate(pieces, "packed")
    assert packed["cu_seqlens"].tolist() == [0, 4, 7]


def test_loss_tokens_matches_collated_labels():
    pieces = [Piece(sample(0, 6, masked=2)), Piece(sample(1, 5), keep=3)]
    for mode in ("padded", "packed"):
        out = collate(pieces, mode)
        assert loss_tokens(pieces, mode) == int((out["labels"] != IGNORE_INDEX).sum())


def test_vision_tensors_are_concatenated():
    out = collate([Piece(sample(0, 3, vision=True)), Piece(sample(1, 3)),
                   Piece(sample(2, 3, vision=True))], "padded")
    assert out["pixel_values"].shape == (8, 6)
    assert out["pixel_values"][:4].max() == 0 and out["pixel_values"][4:].min() == 2
    assert out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]


def test_bad_mode_and_empty_batch_are_errors():
    with pytest.raises(ValueError, match="unknown collate mode 'ragged'"):
        collate([Piece(sample(0, 3))], "ragged")
    with pytest.raises(ValueError, match="empty"):
        collate([], "padded")


def test_wire_codec_round_trip_is_raw_little_endian():
    arr = np.arange(12, dtype=np.int64).reshape(3, 4)
    t = encode("x", arr)
    assert t.data == arr.astype("<i8").tobytes() and list(t.shape) == [3, 4]
    assert np.array_equal(decode(t), arr)
    big = np.arange(5, dtype=">i4")
    assert np.array_equal(decode(encode("b", big)), big)
    with pytest.raises(TypeError, match="complex128"):
        encode("c", np.zeros(2, np.complex128))


def test_hand_framed_batch_message_parses_with_the_ordinary_stubs():
    from pipeline.service.wire_codec import batch_message_bytes
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    arrays = collate([Piece(sample(0, 300, vision=True)), Piece(sample(1, 5))], "padded")
    header = pb.Batch(step=7, epoch=1, rank=3, sample_ids=["s:0", "s:1"], collate="padded",
                      info=pb.StepInfo(step_samples=2, step_tokens=305, world_size=4))
    raw = batch_message_bytes(header, arrays)
    expected = pb.ServerMessage(batch=header)
    for name, arr in arrays.items():
        expected.batch.tensors.append(encode(name, arr))
    parsed = pb.ServerMessage.FromString(raw)
    assert parsed == expected
    assert raw == batch_message_bytes(header, arrays)  # deterministic bytes
    for t in parsed.batch.tensors:
        assert np.array_equal(decode(t), arrays[t.name])
