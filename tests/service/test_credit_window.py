"""Byte credits (pipeline/service/credit_window.py): a client holds at most its byte window of
batches, or one batch larger than the window, and never waits forever for one; bad credits get
INVALID_ARGUMENT."""

from __future__ import annotations

from collections import deque

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from service_helpers import RawStream, job_dict, open_msg, service_config, serving

from pipeline.preprocess.array_source import synthetic_samples
from pipeline.service.credit_window import CreditError, CreditWindow
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

MB = 1_000_000


def test_batches_go_while_their_bytes_fit_beside_what_the_client_holds():
    w = CreditWindow.opened(credits=4, prefetch_bytes=100 * MB, held_bytes=0)
    for _ in range(3):
        assert w.may_send(30 * MB)
        w.sent(30 * MB)
    assert not w.may_send(30 * MB)  # 120 MB would exceed the window
    assert w.may_send(10 * MB)  # a small one still fits
    w.returned(1, 30 * MB)
    assert w.may_send(30 * MB)


def test_a_batch_larger_than_the_window_goes_alone():
    w = CreditWindow.opened(credits=4, prefetch_bytes=50 * MB, held_bytes=0)
    assert w.may_send(80 * MB)  # the client holds nothing: it would never go otherwise
    w.sent(80 * MB)
    assert not w.may_send(1)
    w.returned(1, 80 * MB)
    assert w.may_send(80 * MB)


def test_steps_bound_as_before_and_zero_bytes_means_no_byte_limit():
    w = CreditWindow.opened(credits=2, prefetch_bytes=0, held_bytes=0)
    w.sent(10**12)
    w.sent(10**12)
    assert not w.may_send(1)  # out of step credits
    w.returned(1, 0)
    assert w.may_send(10**12)


def test_bytes_held_from_an_earlier_call_count_until_returned():
    w = CreditWindow.opened(credits=4, prefetch_bytes=100 * MB, held_bytes=90 * MB)
    assert not w.may_send(20 * MB)
    w.returned(1, 90 * MB)
    assert w.may_send(20 * MB)


@pytest.mark.parametrize(("fields", "message"), [
    ({"credits": -1, "prefetch_bytes": 0, "held_bytes": 0}, "Open.credits must be >= 0, got -1"),
    ({"credits": 1, "prefetch_bytes": -5, "held_bytes": 0}, "Open.prefetch_bytes must be >= 0"),
    ({"credits": 1, "prefetch_bytes": 0, "held_bytes": -1}, "Open.held_bytes must be >= 0"),
])
def test_a_negative_open_is_refused(fields, message):
    with pytest.raises(CreditError, match=message):
        CreditWindow.opened(**fields)


def test_returning_what_was_never_held_is_refused():
    w = CreditWindow.opened(credits=4, prefetch_bytes=100, held_bytes=0)
    w.sent(60)
    with pytest.raises(CreditError, match="returned 61 credit bytes, but the client holds only 60"):
        w.returned(1, 61)
    with pytest.raises(CreditError, match="credits=-1"):
        w.returned(-1, 0)
    with pytest.raises(CreditError, match="credit_bytes=-2"):
        w.returned(0, -2)
    assert (w.steps, w.held_bytes) == (3, 60)  # nothing of a refused Ack is applied


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(0, 300),
       st.lists(st.tuples(st.integers(1, 400), st.integers(0, 3)), min_size=1, max_size=60))
def test_a_client_holds_its_window_or_one_batch_and_always_gets_the_next(steps, window, script):
    """A server sends batches of the script's sizes as credits allow; after each, the trainer
    takes some of the queued batches (returning a step and the batch's bytes for each)."""
    w = CreditWindow.opened(credits=steps, prefetch_bytes=window, held_bytes=0)
    held: deque[int] = deque()
    pending = [size for size, _ in script]
    for _, takes in script:
        while pending and w.may_send(pending[0]):
            nbytes = pending.pop(0)
            w.sent(nbytes)
            held.append(nbytes)
            assert len(held) <= steps
            assert not window or sum(held) <= window or len(held) == 1
        assert w.held_bytes == sum(held)
        for _ in range(min(takes, len(held))):
            w.returned(1, held.popleft())
        if not held and pending:  # a client holding nothing always gets the next batch
            assert w.may_send(pending[0])


def test_bad_byte_credits_over_grpc_are_invalid_argument():
    """Over a real stream: a negative window in the Open, and an Ack that returns more bytes
    than the client was sent, each end the stream INVALID_ARGUMENT naming the field."""
    cfg = service_config(job_dict("bytes", 1))
    with serving(cfg, {"bytes": synthetic_samples(40, max_len=200)}) as svc:
        raw = RawStream(svc.address, open_msg("bytes", world_size=1, prefetch_bytes=-1))
        with pytest.raises(grpc.RpcError) as err:
            raw.next()
        raw.close()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Open.prefetch_bytes must be >= 0, got -1" in err.value.details()

        raw = RawStream(svc.address, open_msg("bytes", world_size=1, credits=1,
                                              prefetch_bytes=1 << 20))
        batch = raw.next().batch
        held = sum(len(t.data) for t in batch.tensors)
        raw.send(pb.ClientMessage(ack=pb.Ack(consumed_step=batch.step, credits=1,
                                             credit_bytes=held + 1)))
        with pytest.raises(grpc.RpcError) as err:
            while True:
                raw.next()
        raw.close()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"returned {held + 1} credit bytes, but the client holds only {held}" \
            in err.value.details()
