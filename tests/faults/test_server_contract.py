"""The server-side pieces the fault tests lean on, each checked directly and fast: acks past the
plan are INVALID_ARGUMENT, a rank's END acks it through the epoch's last step (join mode: so Redis
can trim steps it has no batch in), counters reach Redis with the plan, and the dead-rank
policy works over the in-process MemoryJobState too (a client that vanishes without closing)."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
from fault_helpers import RankThread, job_dict

from pipeline.config import ServiceConfig
from pipeline.jobstate import MemoryJobState
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import start_service
from trainer_client import StreamError
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc
from trainer_client.wire_format import WIRE_VERSION


def cfg_for(job: dict, **kw) -> ServiceConfig:
    return ServiceConfig.model_validate({"metrics_port": None, "grpc": {"port": 0},
                                         "lease_seconds": 2.0, "jobs": [job], **kw})


class Raw:
    """A hand-driven Stream: send ClientMessages, read ServerMessages with a timeout."""

    def __init__(self, address: str, first: pb.ClientMessage) -> None:
        self.channel = grpc.insecure_channel(address)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.q.put(first)
        self.call = pb_grpc.DataServiceStub(self.channel).Stream(iter(self.q.get, None))

    def next(self, timeout: float = 10.0):
        out: list = []
        t = threading.Thread(target=lambda: out.append(self._pull()), daemon=True)
        t.start()
        t.join(timeout)
        assert out, "no server message in time"
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def _pull(self):
        try:
            return next(self.call)
        except Exception as exc:
            return exc

    def vanish(self) -> None:
        """Like a killed process: the connection goes, no half-close first."""
        self.call.cancel()
        self.channel.close()


def open_msg(job: str, rank: int, world: int, credits: int = 1) -> pb.ClientMessage:
    return pb.ClientMessage(open=pb.Open(job_id=job, rank=rank, world_size=world,
                                         wire_version=WIRE_VERSION,
                                         client_id=f"raw{rank}", credits=credits))


def test_an_ack_of_a_step_never_sent_is_invalid_argument(redis_client, redis_url):
    cfg = cfg_for(job_dict("acks", 2, batching={"pool_steps": 1}), redis_url=redis_url)
    svc = start_service(cfg, sample_sources={"acks": ArraySource(
        synthetic_samples(200, max_len=600, seed=2))})
    raw = Raw(svc.address, open_msg("acks", 0, 2))
    try:
        assert raw.next().WhichOneof("kind") == "batch"
        raw.q.put(pb.ClientMessage(ack=pb.Ack(consumed_step=10_000, credits=1)))
        with pytest.raises(grpc.RpcError) as err:
            while True:
                raw.next()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ack of step 10000" in err.value.details()
        assert "acked after it was delivered" in err.value.details()
    finally:
        raw.vanish()
        svc.stop(grace=0.5)


def test_end_acks_the_rank_through_the_epoch_and_counters_reach_redis(redis_client, redis_url):
    # 9 samples that each fill the budget, W=2 join: rank 1 ends at step 3, the epoch at 4.
    samples = synthetic_samples(9, lengths=[64] * 9, vocab=1000, source="full")
    cfg = cfg_for(job_dict("trim", 2, batching={"token_budget": 64}), redis_url=redis_url)
    svc = start_service(cfg, sample_sources={"trim": ArraySource(samples)})
    try:
        ranks = [RankThread(svc.address, "trim", r, 2).start() for r in range(2)]
        for r in ranks:
            r.join(60)
            r.check()
        st = svc.runtimes["trim"].state
        assert [r.ends[0].final_step for r in ranks] == [4, 3]
        deadline = time.monotonic() + 5
        while st.acked_all() != [4, 4] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st.acked_all() == [4, 4]  # rank 1 acked through step 4, where it has no batch
        c = st.counters()
        assert c.samples_planned == c.samples_in == 9 and c.tokens_planned == 9 * 64
    finally:
        svc.stop(grace=0.5)


def test_fail_policy_over_memory_state_names_the_vanished_rank():
    samples = synthetic_samples(600, max_len=400, seed=3)
    cfg = cfg_for(job_dict("mem", 2, batching={"token_budget": 1024}), lease_seconds=1.0,
                  rank_timeout_seconds=1.0)
    state = MemoryJobState("mem", 2)
    svc = start_service(cfg, job_states={"mem": state},
                        sample_sources={"mem": ArraySource(samples)})
    try:
        raw = Raw(svc.address, open_msg("mem", 0, 2))
        assert raw.next().WhichOneof("kind") == "batch"
        other = RankThread(svc.address, "mem", 1, 2).start()
        raw.vanish()
        gone = time.monotonic()
        other.join(15)
        assert isinstance(other.error, StreamError), other.error
        assert other.error.code == grpc.StatusCode.ABORTED
        assert "rank 0 has been gone for" in other.error.details
        assert 1.0 <= other.error_at - gone <= 8.0
        assert 0 in state.timed_out_ranks(1.0) and 0 in state.lapsed_ranks()
        assert state.acked_all()[:2] == [state.acked(0), state.acked(1)]
    finally:
        svc.stop(grace=0.5)
