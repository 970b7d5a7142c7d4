"""Guarantee 7 against a Redis-backed server: stale or foreign job ids and world-size mismatches
on resume get precise statuses, and a *restarted* server whose Redis holds the job with another
world size or config refuses to start with a clear error (and leaves nothing half-started)."""

from __future__ import annotations

import grpc
import pytest
from fault_helpers import job_dict

from pipeline.config import ServiceConfig
from pipeline.errors import JobMismatch
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.redis_server import free_port
from pipeline.service.server import start_service
from trainer_client import BatchStream, StreamError
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

SAMPLES = synthetic_samples(300, max_len=600, seed=4)


def config(redis_url: str, port: int, **job_kw) -> ServiceConfig:
    job = job_dict("live", **{"world_size": 2, "seed": 4, **job_kw})
    return ServiceConfig.model_validate({"redis_url": redis_url, "metrics_port": None,
                                         "lease_seconds": 2.0, "grpc": {"port": port},
                                         "jobs": [job]})


def serve(cfg: ServiceConfig):
    return start_service(cfg, sample_sources={"live": ArraySource(SAMPLES)})


def first_error(stream: BatchStream) -> StreamError:
    with pytest.raises(StreamError) as err:
        next(iter(stream))
    stream.close()
    return err.value


def test_stale_ids_world_mismatch_and_a_mismatched_restart(redis_client, redis_url):
    port = free_port()
    cfg = config(redis_url, port)
    svc = serve(cfg)
    try:
        # A stale / foreign job id: NOT_FOUND at once (no reconnect loop), for streams and GetJob.
        err = first_error(BatchStream(svc.address, "old-job", 0, 2, reconnect_timeout=5))
        assert err.code == grpc.StatusCode.NOT_FOUND and "unknown job 'old-job'" in err.details
        with grpc.insecure_channel(svc.address) as ch, pytest.raises(grpc.RpcError) as rpc:
            pb_grpc.DataServiceStub(ch).GetJob(pb.GetJobRequest(job_id="old-job"), timeout=10)
        assert rpc.value.code() == grpc.StatusCode.NOT_FOUND

        # Rank 0 takes 3 steps and checkpoints.
        with BatchStream(svc.address, "live", 0, 2) as s0, BatchStream(svc.address, "live", 1,
                                                                       2) as s1:
            it0, it1 = iter(s0), iter(s1)
            for _ in range(3):
                next(it0)
                next(it1)
            s0.ack()
            s1.ack()
            saved = s0.state_dict()
        # Resuming under another world size: a position does not depend on the world size, so
        # the client takes the state (only the job must match, docs/elastic.md); the server
        # refuses the size for a job that is not elastic and was not reconfigured to it.
        with pytest.raises(ValueError, match="job='live'"):
            BatchStream(svc.address, "other", 0, 2).load_state_dict(saved)
        wrong = BatchStream(svc.address, "live", 0, 3, reconnect_timeout=5)
        wrong.load_state_dict(saved)
        err = first_error(wrong)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "job 'live' runs 2 ranks, this rank opened with world_size 3" in err.details
    finally:
        svc.stop(grace=0.5)

    # A restarted server whose Redis has the job with another world size / another config.
    with pytest.raises(JobMismatch, match=r"world_size=2, this server has world_size=3") as mm:
        serve(config(redis_url, port, world_size=3))
    assert "a resume must use the world size the job started with" in str(mm.value)
    with pytest.raises(JobMismatch, match=r"another config: batching.token_budget \(2048 in "
                                          r"Redis, 4096 here\).*refused"):
        serve(config(redis_url, port, batching={"token_budget": 4096}))

    # Nothing was left half-started: the right config restarts on the same port and the rank
    # resumes where it checkpointed.
    svc = serve(cfg)
    try:
        with BatchStream(svc.address, "live", 0, 2) as s0:
            s0.load_state_dict(saved)
            first = next(iter(s0))
            assert first.info.step >= saved["next_step"]
    finally:
        svc.stop(grace=0.5)
