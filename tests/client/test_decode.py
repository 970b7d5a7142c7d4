"""Decoding on the stream's receiver thread leaves the process's warning state alone: the
trainer's own threads keep their filters and their warnings while batches arrive."""

from __future__ import annotations

import sys
import threading
import warnings

import numpy as np
import torch

from pipeline.service.wire_codec import batch_message_bytes
from trainer_client.decode import decode_batch, resolve_tensor_kind
from trainer_client.wire.odb.v1 import data_service_pb2 as pb


def message() -> pb.Batch:
    ids = np.arange(4096, dtype=np.int32).reshape(8, 512)
    raw = batch_message_bytes(pb.Batch(step=3, collate="padded"),
                              {"input_ids": ids, "labels": ids, "attention_mask": ids > 7})
    return pb.ServerMessage.FromString(raw).batch


def test_decoding_beside_the_trainer_never_swaps_its_warning_filters():
    resolve_tensor_kind("torch")  # what BatchStream does on the trainer's thread
    batch = message()
    filters = warnings.filters
    swapped = 0
    done = threading.Event()

    def receiver() -> None:
        for _ in range(3000):
            decode_batch(batch, "torch")
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as possible
    try:
        t = threading.Thread(target=receiver)
        t.start()
        while not done.is_set():
            swapped += warnings.filters is not filters
        t.join()
    finally:
        sys.setswitchinterval(interval)
    assert swapped == 0
    out = decode_batch(batch, "torch")
    assert out["input_ids"].dtype == torch.int32
    assert torch.equal(out["input_ids"], torch.arange(4096, dtype=torch.int32).reshape(8, 512))
    assert out["attention_mask"].dtype == torch.bool


def test_the_read_only_warning_reaches_nobody():
    resolve_tensor_kind("torch")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        decode_batch(message(), "torch")
    assert [str(w.message) for w in seen] == []
