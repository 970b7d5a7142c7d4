"""Chunk framing (pipeline/service/chunk_framing.py): a batch larger than one chunk becomes a
BatchHeader and bounded Chunks that the ordinary stubs parse, that the client reassembles into
the very batch one message would have carried, and that never copy the whole batch."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.preprocess.vision import PIXEL_NORM
from pipeline.service.chunk_framing import chunk_message, wire_batch
from pipeline.service.collate import Rows
from pipeline.service.wire_codec import batch_message_bytes
from trainer_client.batch_assembly import BatchAssembler, read_chunk
from trainer_client.decode import decode_batch
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

DTYPES = ["<i4", "<i8", "<f4", "<u2", "<f2", "u1", "?", ">i4", ">f4"]
HEADER = pb.Batch(step=9, epoch=1, rank=2, sample_ids=["s:1", "s:2"], collate="padded",
                  info=pb.StepInfo(step_samples=4, step_tokens=100, world_size=2))


@st.composite
def tensors(draw) -> dict[str, np.ndarray]:
    names = draw(st.lists(st.sampled_from(["input_ids", "labels", "attention_mask",
                                           "pixel_values", "image_grid_thw", "x"]),
                          min_size=1, max_size=5, unique=True))
    out = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 24), min_size=1, max_size=3)))
        dt = np.dtype(draw(st.sampled_from(DTYPES)))
        seed = draw(st.integers(0, 2**16))
        raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dt.itemsize,
                                                   dtype=np.uint8)
        out[name] = raw.view(dt).reshape(shape)
    return out


def assembled(messages: list[bytes], kind: str = "numpy", max_chunk: int | None = None):
    head = pb.ServerMessage.FromString(messages[0])
    assert head.WhichOneof("kind") == "batch_header"
    asm = BatchAssembler(head.batch_header, kind, max_chunk_bytes=max_chunk)
    for raw in messages[1:]:
        asm.add(*read_chunk(raw))
    assert asm.complete
    return asm.batch()


@settings(max_examples=150, deadline=None)
@given(tensors(), st.integers(1, 60), st.integers(-2, 2))
def test_chunks_reassemble_into_the_batch_one_message_carries(arrays, pieces, slack):
    total = sum(a.nbytes for a in arrays.values())
    chunk_bytes = max(1, total // pieces + slack)  # from one chunk to ~60, and sizes around
    whole = wire_batch(HEADER, arrays, chunk_bytes=10**9)
    assert list(whole.messages()) == [batch_message_bytes(HEADER, arrays)]
    single = decode_batch(pb.ServerMessage.FromString(whole.first).batch, "numpy")
    wb = wire_batch(HEADER, arrays, chunk_bytes=chunk_bytes)
    assert wb.nbytes == whole.nbytes == sum(a.nbytes for a in arrays.values())
    messages = list(wb.messages())
    if wb.nbytes <= chunk_bytes:  # small batches keep travelling as one message
        assert messages == [batch_message_bytes(HEADER, arrays)]
        return
    assert len(messages) == 1 + wb.chunks
    for raw in messages[1:]:
        chunk = pb.ServerMessage.FromString(raw).chunk  # the ordinary stubs parse every chunk
        assert 1 <= len(chunk.data) <= chunk_bytes
        assert len(raw) <= chunk_bytes + 32  # a chunk message is its data and a few bytes
    batch = assembled(messages, max_chunk=chunk_bytes)
    assert batch.digest() == single.digest()
    assert batch.info == single.info
    for name, a in arrays.items():
        assert batch[name].dtype == a.dtype.newbyteorder("=") and batch[name].shape == a.shape
        assert batch[name].tobytes() == a.astype(a.dtype.newbyteorder("<")).tobytes()


@settings(max_examples=100, deadline=None)
@given(tensors(), st.integers(1, 60), st.data())
def test_a_tensor_in_blocks_of_rows_goes_out_as_the_concatenated_one(arrays, pieces, data):
    total = sum(a.nbytes for a in arrays.values())
    chunk_bytes = max(1, total // pieces)
    blocks = {}
    for name, a in arrays.items():  # cut each tensor's rows into up to 4 blocks
        cuts = sorted(data.draw(st.lists(st.integers(0, a.shape[0]), max_size=3)))
        blocks[name] = Rows(tuple(np.split(a, cuts)))
    assert (list(wire_batch(HEADER, blocks, chunk_bytes).messages())
            == list(wire_batch(HEADER, arrays, chunk_bytes).messages()))


@given(st.integers(0, 2**31 - 1), st.integers(0, 2**62), st.binary(min_size=1, max_size=300))
def test_a_hand_framed_chunk_is_what_the_stubs_write(tensor, offset, data):
    cut = len(data) // 2  # a chunk's bytes may come in pieces (it spans blocks of rows)
    framed = chunk_message(tensor, offset, [memoryview(data)[:cut], memoryview(data)[cut:]])
    stubs = pb.ServerMessage(chunk=pb.Chunk(tensor=tensor, offset=offset, data=data))
    assert framed == stubs.SerializeToString()


def test_torch_and_numpy_assemble_alike_with_pixel_norm_for_raw_pixels():
    arrays = {"input_ids": np.arange(4000, dtype=np.int32).reshape(4, 1000),
              "pixel_values": np.arange(40 * 1176, dtype=np.uint64).astype(np.uint8)
              .reshape(40, 1176),
              "image_grid_thw": np.array([[1, 4, 10]], np.int64)}
    messages = list(wire_batch(HEADER, arrays, chunk_bytes=4096).messages())
    as_torch, as_numpy = assembled(messages, "torch"), assembled(messages, "numpy")
    assert as_torch.digest() == as_numpy.digest()
    assert as_torch.pixel_norm == as_numpy.pixel_norm == PIXEL_NORM
    assert not HEADER.HasField("pixel_norm")  # the caller's header is left alone


def test_the_chunks_are_views_of_the_samples_pixels_until_sent():
    samples = [np.full((n, 1176), i, np.uint8) for i, n in enumerate((1000, 1500, 500))]
    ids = np.arange(9000, dtype=np.int32).reshape(3, 3000)
    rows = wire_batch(HEADER, {"input_ids": ids, "pixel_values": Rows(tuple(samples))},
                      chunk_bytes=100_000)
    # No copy of the whole batch: its bytes stay in the samples' arrays, and each chunk is
    # copied into its message only as it is sent (a chunk may span two samples' blocks).
    assert len(rows.first) < 1000
    assert [np.shares_memory(np.asarray(v), s)
            for v, s in zip(rows.tensors[1].parts, samples, strict=True)] == [True] * 3
    joined = wire_batch(HEADER, {"input_ids": ids, "pixel_values": np.concatenate(samples)},
                        chunk_bytes=100_000)
    assert list(rows.messages()) == list(joined.messages())  # the very same bytes
    assert rows.chunks == 1 + -(-3000 * 1176 // 100_000)
