"""Reassembling a chunked batch (trainer_client/batch_assembly.py): one allocation per tensor,
every chunk written into it once, chunks taken out of the received bytes without a copy, and
every chunk out of place refused with what was due."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainer_client.batch_assembly import BatchAssembler, ChunkError, StreamReader, read_chunk
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire_format import WIRE_DTYPES


def header(*tensors: tuple[str, np.ndarray], step: int = 4) -> pb.BatchHeader:
    return pb.BatchHeader(batch=pb.Batch(step=step), tensors=[
        pb.TensorSpec(name=n, dtype=WIRE_DTYPES[a.dtype], shape=a.shape, nbytes=a.nbytes)
        for n, a in tensors])


IDS = np.arange(24, dtype=np.int32).reshape(2, 12)  # 96 bytes
PIX = np.arange(40, dtype=np.uint8).reshape(4, 10)  # 40 bytes


def test_chunks_are_written_in_place_without_allocating():
    pixels = np.random.default_rng(0).integers(0, 256, (2000, 1176), dtype=np.uint8)
    raw = pixels.tobytes()
    chunks = [memoryview(raw)[i:i + 65536] for i in range(0, len(raw), 65536)]
    asm = BatchAssembler(header(("pixel_values", pixels), ("input_ids", IDS)), "numpy")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, c in enumerate(chunks):
            asm.add(0, i * 65536, c)
        asm.add(1, 0, IDS.tobytes())
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 16384  # 2.4 MB written, nothing of a chunk's size allocated on the way
    batch = asm.batch()
    assert np.array_equal(batch["pixel_values"], pixels)
    assert np.array_equal(batch["input_ids"], IDS)
    batch["pixel_values"][0, 0] = 255  # the trainer's own memory: writable


def test_torch_tensors_are_assembled_in_their_dtypes():
    bf16 = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    bits = bf16.view(torch.int16).numpy().view(np.uint16)
    asm = BatchAssembler(header(("pixel_values", bits), ("input_ids", IDS)), "torch")
    asm.add(0, 0, bits.tobytes())
    asm.add(1, 0, IDS.tobytes())
    batch = asm.batch()
    assert batch["pixel_values"].dtype == torch.bfloat16 and torch.equal(batch["pixel_values"],
                                                                         bf16)
    assert torch.equal(batch["input_ids"], torch.from_numpy(IDS))


def test_empty_tensors_need_no_chunk():
    empty = np.zeros((0, 1176), np.uint8)
    asm = BatchAssembler(header(("a", empty), ("input_ids", IDS), ("b", empty)), "numpy")
    asm.add(1, 0, IDS.tobytes())
    assert asm.complete and asm.batch()["a"].shape == (0, 1176)


@pytest.mark.parametrize(("chunks", "message"), [
    ([(0, 8, b"x" * 8)], "leaves a gap (the next chunk is due at tensor 0 offset 0)"),
    ([(1, 0, b"x")], "leaves a gap (the next chunk is due at tensor 0 offset 0)"),
    ([(0, 0, b"x" * 50), (0, 40, b"x" * 10)],
     "overlaps bytes already written (the next chunk is due at tensor 0 offset 50)"),
    ([(0, 0, b"x" * 64), (0, 64, b"x" * 32), (0, 0, b"x")],
     "overlaps bytes already written (the next chunk is due at tensor 1 offset 0)"),
    ([(0, 0, b"x" * 64), (0, 64, b"x" * 33)],
     "runs past the end of tensor 0 ('input_ids', 96 bytes)"),
    ([(2, 0, b"x")], "the batch has tensors 0..1"),
    ([(-1, 0, b"x")], "the batch has tensors 0..1"),
    ([(0, 0, b"")], "a chunk carries at least one byte"),
    ([(0, 0, b"x" * 65)], "larger than the chunk size 64"),
    ([(0, 0, b"x" * 64), (0, 64, b"x" * 32), (1, 0, b"x" * 40), (1, 40, b"x")],
     "the batch is already complete"),
])
def test_a_chunk_out_of_place_is_refused_precisely(chunks, message):
    asm = BatchAssembler(header(("input_ids", IDS), ("pixel_values", PIX)), "numpy",
                         max_chunk_bytes=64)
    *fine, bad = chunks
    for c in fine:
        asm.add(*c)
    with pytest.raises(ChunkError, match=r"^step 4: chunk of") as err:
        asm.add(*bad)
    assert message in str(err.value)


def test_an_incomplete_batch_is_never_handed_out():
    asm = BatchAssembler(header(("input_ids", IDS)), "numpy")
    asm.add(0, 0, IDS.tobytes()[:95])
    with pytest.raises(ChunkError, match=r"incomplete \(next chunk due at tensor 0 offset 95\)"):
        asm.batch()


@pytest.mark.parametrize(("spec", "message"), [
    (pb.TensorSpec(name="a", dtype=pb.INT32, shape=[2, 3], nbytes=25),
     "announces 25 bytes, but shape (2, 3) of int32 holds 24"),
    (pb.TensorSpec(name="a", dtype=99, shape=[2], nbytes=2), "unknown wire dtype 99"),
    (pb.TensorSpec(name="a", dtype=pb.UINT8, shape=[-2, -3], nbytes=6), "has shape (-2, -3)"),
    (pb.TensorSpec(name="input_ids", dtype=pb.UINT8, shape=[1], nbytes=1),
     "repeats the name 'input_ids'"),
])
def test_a_header_that_does_not_add_up_is_refused(spec, message):
    h = header(("input_ids", IDS))
    h.tensors.append(spec)
    with pytest.raises(ChunkError, match=r"^step 4: tensor 1") as err:
        BatchAssembler(h, "numpy")
    assert message in str(err.value)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    from pipeline.service.wire_codec import varint

    key = varint(number << 3 | wire_type)
    if wire_type == 2:
        return key + varint(len(payload)) + payload
    return key + payload


@given(st.integers(0, 2**31 - 1), st.integers(0, 2**62), st.binary(max_size=64),
       st.permutations([0, 1, 2]), st.booleans())
def test_read_chunk_reads_what_the_stubs_read(tensor, offset, data, order, unknown):
    from pipeline.service.wire_codec import varint

    fields = [_field(1, 0, varint(tensor)), _field(2, 0, varint(offset)), _field(3, 2, data)]
    body = b"".join(fields[i] for i in order)
    if unknown:  # fields of a later version are skipped, as the stubs skip them
        body += _field(9, 0, varint(5)) + _field(10, 2, b"later") + _field(11, 5, b"abcd")
    raw = _field(4, 2, body)
    expected = pb.ServerMessage.FromString(raw).chunk
    t, o, d = read_chunk(raw)
    assert (t, o, bytes(d)) == (expected.tensor, expected.offset, expected.data)
    assert d.obj is raw  # a view of the received bytes, not a copy


@pytest.mark.parametrize("message", [
    pb.ServerMessage(batch=pb.Batch(step=1)),
    pb.ServerMessage(end=pb.End(epoch=1)),
    pb.ServerMessage(batch_header=pb.BatchHeader(batch=pb.Batch(step=1))),
    pb.ServerMessage(),
])
def test_read_chunk_leaves_other_messages_to_the_stubs(message):
    assert read_chunk(message.SerializeToString()) is None


@pytest.mark.parametrize("raw", [b"\x22\x05\x1a\x09abc", b"\x22", b"\x22\x02\x08\xff", b"\x27"])
def test_read_chunk_leaves_malformed_bytes_to_the_stubs(raw):
    assert read_chunk(raw) is None


def test_a_stream_reader_hands_out_a_chunked_batch_only_once_whole():
    from pipeline.service.chunk_framing import wire_batch

    messages = list(wire_batch(pb.Batch(step=4), {"input_ids": IDS, "pixel_values": PIX},
                               chunk_bytes=32).messages())
    reader = StreamReader("numpy")
    assert [reader.read(m) for m in messages[:-1]] == [None] * (len(messages) - 1)
    batch = reader.read(messages[-1])
    assert batch.info.step == 4 and np.array_equal(batch["input_ids"], IDS)
    end = pb.ServerMessage(end=pb.End(epoch=0, final_step=4)).SerializeToString()
    assert reader.read(end) == pb.End(epoch=0, final_step=4)
    with pytest.raises(ChunkError, match="with no batch header before it"):
        StreamReader("numpy").read(messages[1])
    cut = StreamReader("numpy")
    cut.read(messages[0])
    cut.read(messages[1])
    with pytest.raises(ChunkError, match="step 4: a batch header before step 4 was complete"):
        cut.read(messages[0])  # a half batch never merges with the next
