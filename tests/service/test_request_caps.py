"""Requests are small and bounded (issue #28): each cap answers its precise status code before
anything reaches Redis or the logs, batches still go out far larger than any request may be,
and an unknown job id teaches the caller nothing about the jobs a replica serves."""

from __future__ import annotations

import grpc
import pytest
from service_helpers import RawStream, job_dict, open_msg, service_config, serving

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import start_service
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

BIG = 262_144  # tokens: one batch is ~2 MiB on the wire, twice the request limit
CHUNK_KB = 4096  # a whole such batch fits one chunk: a single message of ~2 MiB


@pytest.fixture(scope="module")
def svc():
    cfg = service_config(job_dict("secret-job-a", batching={"token_budget": BIG}),
                         job_dict("secret-job-b"), max_request_mb=1, chunk_kb=CHUNK_KB)
    big = synthetic_samples(40, lengths=[30_000] * 40, source="big")
    with serving(cfg, {"secret-job-a": big, "secret-job-b": synthetic_samples(40)}) as s:
        yield s


def refused(svc, first: pb.ClientMessage, then: pb.ClientMessage | None = None
            ) -> grpc.RpcError:
    raw = RawStream(svc.address, first)
    try:
        with pytest.raises(grpc.RpcError) as err:
            if then is not None:
                raw.next()  # a batch first, then the bad message
                raw.send(then)
            while True:
                raw.next()
        return err.value
    finally:
        raw.close()


def test_a_large_request_is_refused_before_it_is_read_while_batches_are_larger(svc):
    err = refused(svc, open_msg("secret-job-a", client_id="x" * (2 << 20)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    raw = RawStream(svc.address, open_msg("secret-job-a", credits=1))
    try:
        batch = raw.next().batch
        assert batch.ByteSize() > 1 << 20  # the send limit is the batches' own
    finally:
        raw.close()


@pytest.mark.parametrize(("first", "then", "text"), [
    (open_msg("secret-job-b", client_id="c" * 257), None,
     "client_id must be at most 256 characters, got 257"),
    (open_msg("secret-job-b", credits=65_537), None, "credits must be in [0, 65536], got 65537"),
    (open_msg("secret-job-b", credits=1), pb.ClientMessage(ack=pb.Ack(credits=1 << 20)),
     "Ack credits must be in [0, 65536]"),
    (open_msg("secret-job-b", credits=1), pb.ClientMessage(ack=pb.Ack(consumed_step=1 << 40)),
     "a step can only be acked after it was delivered"),
], ids=["client-id", "open-credits", "ack-credits", "ack-of-an-unsent-step"])
def test_each_cap_gets_invalid_argument(svc, first, then, text):
    err = refused(svc, first, then)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert text in err.details()


def test_an_unknown_job_names_no_served_job(svc):
    err = refused(svc, open_msg("nope"))
    # How to list the jobs (#42), never the list: the exact text, so no job name slips in.
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details() == (
        "unknown job 'nope': check the job id (`odb-pipeline status` where the service runs "
        "lists its jobs)")
    with grpc.insecure_channel(svc.address) as ch, pytest.raises(grpc.RpcError) as get:
        pb_grpc.DataServiceStub(ch).GetJob(pb.GetJobRequest(job_id="nope"), timeout=10)
    assert get.value.code() == grpc.StatusCode.NOT_FOUND
    assert "secret-job" not in get.value.details()


def test_refill_open_caps_held_ids_and_names_no_job(tmp_path, redis_url, redis_client):
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages":[{"role":"user","content":"hi"},'
                     '{"role":"assistant","content":"hello"}]}\n')
    cfg = ServiceConfig.model_validate({
        "grpc": {"port": 0}, "metrics_port": None, "redis_url": redis_url,
        "jobs": [{"job_id": "gen", "mode": "refill", "source": {"paths": [str(chats)]}},
                 {**job_dict("secret-train")}]})
    svc = start_service(cfg, sample_sources={"secret-train": ArraySource(
        synthetic_samples(10))})
    try:
        with grpc.insecure_channel(svc.address) as ch:
            stub = pb_grpc.DataServiceStub(ch)

            def open_refill(job: str, held: int) -> grpc.RpcError:
                msg = pb.RefillMessage(open=pb.RefillOpen(
                    job_id=job, consumer_id="c", held_ids=[str(i) for i in range(held)]))
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Refill(iter([msg]), timeout=10))
                return err.value

            many = open_refill("gen", 65_537)
            assert many.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "held_ids may name at most 65536 requests, got 65537" in many.details()
            unknown = open_refill("nope", 0)
            assert unknown.code() == grpc.StatusCode.NOT_FOUND
            assert "secret-train" not in unknown.details() and "gen" not in unknown.details()
    finally:
        svc.stop(grace=0.5)
