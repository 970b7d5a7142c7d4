"""Every bad request gets its precise gRPC status and a message that says what was wrong."""

from __future__ import annotations

import grpc
import pytest
from service_helpers import RawStream, consume_all, job_dict, open_msg, service_config, serving

from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchStream, StreamError
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def svc():
    cfg = service_config(job_dict("open"), job_dict("locked"))
    samples = synthetic_samples(40, max_len=200)
    with serving(cfg, {"open": samples, "locked": samples},
                 tokens={"locked": TOKEN}, resume_grace_s=0.2) as s:
        yield s


def status_of(svc, first: pb.ClientMessage, token: str | None = None) -> grpc.RpcError:
    raw = RawStream(svc.address, first, token)
    try:
        with pytest.raises(grpc.RpcError) as err:
            raw.next()
        return err.value
    finally:
        raw.close()


@pytest.mark.parametrize(("first", "token", "code", "text"), [
    (open_msg("nope"), None, grpc.StatusCode.NOT_FOUND, "unknown job 'nope'"),
    (open_msg("locked"), None, grpc.StatusCode.UNAUTHENTICATED, "requires 'authorization"),
    (open_msg("locked"), "wrong", grpc.StatusCode.UNAUTHENTICATED, "bearer token rejected"),
    (open_msg("open", rank=2), None, grpc.StatusCode.INVALID_ARGUMENT, "rank 2 is outside [0, 2)"),
    (open_msg("open", rank=-1), None, grpc.StatusCode.INVALID_ARGUMENT, "rank -1 is outside"),
    (open_msg("open", world_size=4), None, grpc.StatusCode.INVALID_ARGUMENT,
     "job 'open' runs 2 ranks, this rank opened with world_size 4: start 2 ranks"),
    (open_msg("open", resume_step=10_000), None, grpc.StatusCode.OUT_OF_RANGE,
     "resume_step 10000 is beyond the plan"),
    (open_msg("open", resume_step=-3), None, grpc.StatusCode.INVALID_ARGUMENT,
     "resume_step must be >= 0"),
    (pb.ClientMessage(ack=pb.Ack(consumed_step=1)), None, grpc.StatusCode.INVALID_ARGUMENT,
     "first message must be Open"),
], ids=["unknown-job", "no-token", "bad-token", "rank-too-big", "rank-negative",
        "world-mismatch", "resume-beyond", "resume-negative", "no-open"])
def test_bad_open_gets_precise_status(svc, first, token, code, text):
    err = status_of(svc, first, token)
    assert err.code() == code
    assert text in err.details()


def test_second_live_client_on_a_held_rank_is_refused(svc):
    holder = RawStream(svc.address, open_msg("open", rank=0, client_id="holder"))
    try:
        assert holder.next().WhichOneof("kind") == "batch"  # holds rank 0 now
        err = status_of(svc, open_msg("open", rank=0, client_id="intruder"))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "held by client 'holder'" in err.details()
    finally:
        holder.close()


def test_get_job_checks_job_and_token(svc):
    ch = grpc.insecure_channel(svc.address)
    stub = pb_grpc.DataServiceStub(ch)
    with pytest.raises(grpc.RpcError) as err:
        stub.GetJob(pb.GetJobRequest(job_id="missing"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.GetJob(pb.GetJobRequest(job_id="locked"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = stub.GetJob(pb.GetJobRequest(job_id="locked"), timeout=5,
                     metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert ok.job_id == "locked" and ok.world_size == 2
    ch.close()


def test_client_raises_non_retryable_errors_and_token_works(svc):
    with BatchStream(svc.address, "locked", 0, 2) as s, pytest.raises(StreamError) as err:
        next(iter(s))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    got = consume_all(svc.address, "locked", 2, token=TOKEN)
    assert sum(len(b.info.sample_ids) for r in got for b in got[r][:-1]) == 40
