"""Collation: padded and packed layouts, compact wire dtypes, labels, positions, cu_seqlens,
truncation, vision."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.preprocess.sample import ProcessedSample
from pipeline.service.collate import IGNORE_INDEX, Piece, collate, loss_tokens
from pipeline.service.wire_codec import decode, encode


def sample(row: int, n: int, masked: int = 0, vision: bool = False,
           pixel_dtype: type = np.uint8) -> ProcessedSample:
    ids = np.arange(1, n + 1, dtype=np.int32) + 100 * row
    labels = ids.copy()
    labels[:masked] = IGNORE_INDEX
    pv = np.full((4, 6), row, pixel_dtype) if vision else None
    grid = np.array([[1, 2, 2]], np.int64) if vision else None
    return ProcessedSample(f"s:{row}", "s", row, ids, labels, pixel_values=pv,
                           image_grid_thw=grid)


def test_padded_shapes_labels_mask_positions():
    out = collate([Piece(sample(0, 3)), Piece(sample(1, 5, masked=2))], "padded", pad_id=7)
    # No position_ids: the model derives them from the mask (fewer bytes on the wire).
    assert set(out) == {"input_ids", "attention_mask", "labels"}
    assert out["input_ids"].shape == (2, 5) and out["input_ids"].dtype == np.int32
    assert out["labels"].dtype == np.int32 and out["attention_mask"].dtype == np.bool_
    assert out["input_ids"][0].tolist() == [1, 2, 3, 7, 7]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert out["labels"][0].tolist() == [1, 2, 3, -100, -100]
    assert out["labels"][1].tolist() == [-100, -100, 103, 104, 105]


def test_padded_batch_is_at_most_9_bytes_per_padded_token():
    out = collate([Piece(sample(0, 300)), Piece(sample(1, 1000)), Piece(sample(2, 7))], "padded")
    padded_tokens = out["input_ids"].size
    assert sum(a.nbytes for a in out.values()) <= 9 * padded_tokens


def test_packed_is_one_row_with_cu_seqlens_and_restarting_positions():
    out = collate([Piece(sample(0, 3)), Piece(sample(1, 4)), Piece(sample(2, 2))], "packed")
    assert out["input_ids"].shape == (1, 9)
    assert {out[k].dtype for k in ("input_ids", "labels", "position_ids")} == {np.dtype(np.int32)}
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


def test_loss_tokens_of_the_payload_match_the_plans_measure():
    samples = [sample(0, 6, masked=2), sample(1, 5), sample(2, 1)]
    for mode in ("padded", "packed"):
        out = collate([Piece(s) for s in samples], mode)
        assert loss_tokens(out) == sum(s.loss_tokens(mode) for s in samples)
    # Truncated: only the kept tokens' labels count.
    cut = collate([Piece(samples[1], keep=3)], "padded")
    assert loss_tokens(cut) == int((samples[1].labels[:3] != IGNORE_INDEX).sum())


@pytest.mark.parametrize("pixel_dtype", [np.uint8, np.uint16, np.float32])
def test_vision_tensors_are_concatenated_in_their_stored_dtype(pixel_dtype):
    out = collate([Piece(sample(0, 3, vision=True, pixel_dtype=pixel_dtype)), Piece(sample(1, 3)),
                   Piece(sample(2, 3, vision=True, pixel_dtype=pixel_dtype))], "padded")
    assert out["pixel_values"].shape == (8, 6) and out["pixel_values"].dtype == pixel_dtype
    assert out["pixel_values"][:4].max() == 0 and out["pixel_values"][4:].min() == 2
    assert out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]


def test_mixed_pixel_dtypes_in_one_batch_are_an_error_naming_the_samples():
    with pytest.raises(ValueError, match=r"s:0.*s:1.*mix pixel dtypes"):
        collate([Piece(sample(0, 3, vision=True)),
                 Piece(sample(1, 3, vision=True, pixel_dtype=np.float32))], "packed")


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


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_collation_is_deterministic_byte_for_byte(mode):
    pieces = [Piece(sample(0, 50, masked=5, vision=True)), Piece(sample(1, 9), keep=4),
              Piece(sample(2, 30, vision=True))]
    first, again = collate(pieces, mode), collate(list(pieces), mode)
    assert list(first) == list(again)
    for name in first:
        assert first[name].dtype == again[name].dtype
        assert first[name].tobytes() == again[name].tobytes()


def test_hand_framed_batch_message_parses_with_the_ordinary_stubs():
    from pipeline.preprocess.vision import PIXEL_NORM
    from pipeline.service.wire_codec import batch_message_bytes
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    arrays = collate([Piece(sample(0, 300, vision=True)), Piece(sample(1, 5))], "padded")
    header = pb.Batch(step=7, epoch=1, rank=3, sample_ids=["s:0", "s:1"], collate="padded",
                      info=pb.StepInfo(step_samples=2, step_tokens=305, world_size=4))
    raw = batch_message_bytes(header, arrays)
    assert not header.HasField("pixel_norm")  # the caller's header is left alone
    expected = pb.ServerMessage(batch=header)
    PIXEL_NORM.to_wire(expected.batch.pixel_norm)  # raw uint8 pixels travel with their norm
    for name, arr in arrays.items():
        expected.batch.tensors.append(encode(name, arr))
    parsed = pb.ServerMessage.FromString(raw)
    assert parsed == expected
    assert raw == batch_message_bytes(header, arrays)  # deterministic bytes
    for t in parsed.batch.tensors:
        assert np.array_equal(decode(t), arrays[t.name])


def test_text_batches_carry_no_pixel_norm():
    from pipeline.service.wire_codec import batch_message_bytes
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    raw = batch_message_bytes(pb.Batch(step=1), collate([Piece(sample(0, 8))], "padded"))
    assert not pb.ServerMessage.FromString(raw).batch.HasField("pixel_norm")


def test_wire_version_check_names_both_versions():
    from pipeline.service.wire_codec import wire_version_problem
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb
    from trainer_client.wire_format import MISMATCH_PREFIX, WIRE_VERSION

    assert wire_version_problem(pb.Open(job_id="j", wire_version=WIRE_VERSION)) is None
    old = wire_version_problem(pb.Open(job_id="j"))  # a client from before the field: 0
    assert old is not None and old.startswith(MISMATCH_PREFIX)
    assert "before wire versions (0)" in old and f"sends version {WIRE_VERSION}" in old
    newer = wire_version_problem(pb.Open(job_id="j", wire_version=WIRE_VERSION + 1))
    assert newer is not None and f"version {WIRE_VERSION + 1}," in newer


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=8),
       st.sampled_from([1, 2, 3, 4, 8, 16]), st.data())
def test_pad_to_multiple_pads_every_sequence_without_loss_tokens(shapes, m, data):
    """Every sequence as sent is a multiple of m long; the real tokens and labels are where
    the unpadded layout has them; the padding is pad_id with label -100; packed `cu_seqlens`,
    `position_ids` and `max_seqlen` agree with each other, and `cu_seqlens_unpadded` bounds the
    real tokens."""
    pieces = [Piece(sample(i, n, masked=min(k, n)),
                    keep=data.draw(st.one_of(st.none(), st.integers(1, n)))) for i, (n, k) in
              enumerate(shapes)]
    lens = [len(p.input_ids) for p in pieces]
    sent = [-(-n // m) * m for n in lens]
    plain = collate(pieces, "padded", pad_id=7)
    out = collate(pieces, "padded", pad_id=7, pad_to_multiple=m)
    width = out["input_ids"].shape[1]
    assert width % m == 0 and width == max(sent)
    w0 = plain["input_ids"].shape[1]
    for name in plain:
        assert np.array_equal(out[name][:, :w0], plain[name])
    assert (out["input_ids"][:, w0:] == 7).all() and (out["labels"][:, w0:] == IGNORE_INDEX).all()
    assert not out["attention_mask"][:, w0:].any()
    assert loss_tokens(out) == loss_tokens(plain)

    plain = collate(pieces, "packed")
    out = collate(pieces, "packed", pad_id=7, pad_to_multiple=m)
    cu = out["cu_seqlens"].tolist()
    assert np.diff(cu).tolist() == sent and all(s % m == 0 for s in np.diff(cu))
    assert int(out["max_seqlen"]) == max(sent) and out["input_ids"].shape == (1, sum(sent))
    pos = out["position_ids"][0]
    assert np.flatnonzero(pos == 0).tolist() == cu[:-1], "position_ids restart at cu_seqlens"
    for a, b in itertools.pairwise(cu):
        assert pos[a:b].tolist() == list(range(b - a))
    if m == 1:  # nothing to pad: the layout of before, byte for byte
        assert list(out) == list(plain) and all(
            out[k].tobytes() == plain[k].tobytes() for k in plain)
        return
    real = out["cu_seqlens_unpadded"]
    assert real.dtype == np.int32 and np.diff(real).tolist() == lens
    ids, labels = out["input_ids"][0], out["labels"][0]
    pcu = plain["cu_seqlens"]
    for i, (start, n) in enumerate(zip(cu[:-1], lens, strict=True)):
        seg = slice(pcu[i], pcu[i + 1])
        assert ids[start:start + n].tolist() == plain["input_ids"][0, seg].tolist()
        assert labels[start:start + n].tolist() == plain["labels"][0, seg].tolist()
        assert (ids[start + n:cu[i + 1]] == 7).all()
        assert (labels[start + n:cu[i + 1]] == IGNORE_INDEX).all()
    assert loss_tokens(out) == loss_tokens(plain)


def test_padding_bounds_stay_on_the_batch_and_out_of_the_model_inputs():
    from trainer_client.decode import StreamBatch

    out = collate([Piece(sample(0, 3)), Piece(sample(1, 5))], "packed", pad_to_multiple=4)
    batch = StreamBatch(out)
    batch.info = None  # (no plan metadata needed here)
    inputs = batch.to_model_inputs()
    assert "cu_seqlens_unpadded" not in inputs and "max_seqlen" not in inputs
    assert inputs["cu_seq_lens_q"].tolist() == [0, 4, 12] and inputs["max_length_q"] == 8
    assert batch["cu_seqlens_unpadded"].tolist() == [0, 3, 8]
