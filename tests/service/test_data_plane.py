"""The gRPC data plane over real loopback: coverage, DGAP ends, flow control, resume, status."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_helpers import (
    RawStream,
    consume_all,
    job_dict,
    open_msg,
    service_config,
    serving,
    uneven_samples,
)
from support.waiting import wait_for

from pipeline.jobstate import MemoryJobState
from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchStream, EpochEndInfo, loss_scale
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc
from trainer_client.wire_format import STREAM_ACCEPTED


def batches(items):
    return [b for b in items if not isinstance(b, EpochEndInfo)]


@pytest.mark.parametrize("collate", ["padded", "packed"])
def test_join_epoch_is_delivered_exactly_once_with_ready_tensors(collate):
    samples = synthetic_samples(257, max_len=900, seed=1)
    cfg = service_config(job_dict(batching={"collate": collate}))
    with serving(cfg, {"j": samples}) as svc:
        got = consume_all(svc.address, "j", 2)
    ids = [i for r in got for b in batches(got[r]) for i in b.info.sample_ids]
    assert sorted(ids) == sorted(s.sample_id for s in samples)  # every sample exactly once
    by_id = {s.sample_id: s for s in samples}
    for r in got:
        for b in batches(got[r]):
            assert b.info.rank == r and b.info.world_size == 2
            assert b["input_ids"].dtype == torch.int32  # the wire dtype (wire version 2)
            n_tok = sum(by_id[i].num_tokens for i in b.info.sample_ids)
            assert b.info.rank_tokens == n_tok
            if collate == "padded":
                assert b["input_ids"].shape[0] == len(b.info.sample_ids)
                assert int(b["attention_mask"].sum()) == n_tok
                assert b["input_ids"].numel() <= 2048  # the token budget, padded cost
                first = by_id[b.info.sample_ids[0]]
                assert b["input_ids"][0, : first.num_tokens].tolist() == first.input_ids.tolist()
            else:
                assert b["cu_seqlens"].dtype == torch.int32
                assert int(b["cu_seqlens"][-1]) == n_tok == b["input_ids"].shape[1] <= 2048
        ends = [e for e in got[r] if isinstance(e, EpochEndInfo)]
        assert len(ends) == 1 and ends[0].job_done and ends[0].mode == "join"
        assert ends[0].final_step == batches(got[r])[-1].info.step
    # Step info: all-rank totals agree with what the ranks received.
    for step in {b.info.step for r in got for b in batches(got[r])}:
        parts = [b for r in got for b in batches(got[r]) if b.info.step == step]
        assert sum(p.info.rank_tokens for p in parts) == parts[0].info.step_tokens
        assert sum(p.info.rank_loss_tokens for p in parts) == parts[0].info.step_loss_tokens
        assert sum(loss_scale(p) for p in parts) == pytest.approx(2.0)


def test_join_ranks_end_at_different_steps_each_with_in_band_end():
    samples = uneven_samples(7, budget=64)
    cfg = service_config(job_dict(batching={"token_budget": 64}))
    with serving(cfg, {"j": samples}) as svc:
        got = consume_all(svc.address, "j", 2)
    ends = {r: got[r][-1] for r in got}
    assert ends[0].final_step == 3 and ends[1].final_step == 2  # rank 1 ends a step earlier
    assert [b.info.step for b in batches(got[0])] == [0, 1, 2, 3]
    ids = [i for r in got for b in batches(got[r]) for i in b.info.sample_ids]
    assert sorted(ids) == sorted(s.sample_id for s in samples)


def test_quota_mode_gives_every_rank_the_same_steps_over_epochs():
    samples = uneven_samples(7, budget=64)
    cfg = service_config(job_dict(mode="quota", epochs=2, batching={"token_budget": 64}))
    with serving(cfg, {"j": samples}) as svc:
        got = consume_all(svc.address, "j", 2, epochs=2)
    steps = {r: [b.info.step for b in batches(got[r])] for r in got}
    assert steps[0] == steps[1]
    ends = {r: [e for e in got[r] if isinstance(e, EpochEndInfo)] for r in got}
    for r in got:
        assert [e.epoch for e in ends[r]] == [0, 1]
        assert [e.job_done for e in ends[r]] == [False, True]
        assert all(e.mode == "quota" for e in ends[r])
    assert [e.final_step for e in ends[0]] == [e.final_step for e in ends[1]]
    # 7 samples: 3 full steps in epoch 0, the 7th is carried into epoch 1 (never dropped).
    ids = [i for r in got for b in batches(got[r]) for i in b.info.sample_ids]
    assert len(ids) == 14 and set(ids) == {s.sample_id for s in samples}


def test_multi_epoch_join_sends_end_per_epoch_then_next_epochs_steps():
    samples = synthetic_samples(60, max_len=300)
    cfg = service_config(job_dict(epochs=3))
    with serving(cfg, {"j": samples}) as svc:
        got = consume_all(svc.address, "j", 2, epochs=3)
    for r in got:
        epoch = 0
        for item in got[r]:
            if isinstance(item, EpochEndInfo):
                assert item.epoch == epoch and item.job_done == (epoch == 2)
                epoch += 1
            else:
                assert item.info.epoch == epoch
        assert epoch == 3
    for e in range(3):
        ids = [i for r in got for b in batches(got[r]) if b.info.epoch == e
               for i in b.info.sample_ids]
        assert sorted(ids) == sorted(s.sample_id for s in samples)


def test_slow_trainer_bounds_server_and_client_memory():
    samples = synthetic_samples(600, max_len=200)
    cfg = service_config(job_dict(batching={"token_budget": 256, "max_window_samples": 16,
                                            "pool_steps": 4}), prefetch_steps=2)
    with serving(cfg, {"j": samples}) as svc:
        rt = svc.runtimes["j"]
        streams = [BatchStream(svc.address, "j", r, 2, prefetch=2) for r in range(2)]
        its = [iter(s) for s in streams]
        firsts = [next(it) for it in its]  # both ranks connected, then they stall
        time.sleep(1.0)
        ahead = rt.state.published_through()
        # The producer waits for acks (max_ahead = 2 * prefetch + 2 = 6 steps); the planner
        # releases a pool (4 steps) at a time.
        assert ahead <= 6 + 4, ahead
        assert rt.state.counters().samples_in < 200
        assert all(s._queued_batches <= 2 for s in streams)  # client window respected
        assert firsts[0].info.step == 0
        # Draining both ranks (concurrently, as trainers do) lets the producer finish.
        counts = [len(f.info.sample_ids) for f in firsts]

        def drain(r: int) -> None:
            counts[r] += sum(len(b.info.sample_ids) for b in its[r])

        threads = [threading.Thread(target=drain, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        seen = sum(counts)
        assert seen == 600 and rt.state.is_done()
        assert rt.state.published_through() > ahead + 20  # it really was held back
        for s in streams:
            s.close()


def test_state_dict_resume_is_byte_identical_and_exactly_once():
    samples = synthetic_samples(200, max_len=600, seed=3)
    cfg = service_config(job_dict(seed=5))
    with serving(cfg, {"j": samples}) as svc:  # the reference run
        ref = consume_all(svc.address, "j", 2)
    ref0 = [b.digest() for b in batches(ref[0])]

    with serving(cfg, {"j": samples}) as svc:
        other = threading.Thread(target=lambda: list(BatchStream(svc.address, "j", 1, 2)),
                                 daemon=True)
        other.start()
        s = BatchStream(svc.address, "j", 0, 2, client_id="first")
        it = iter(s)
        head = [next(it).digest() for _ in range(5)]
        state = s.state_dict()
        s.close()
        assert state["next_step"] == batches(ref[0])[4].info.step + 1
        s2 = BatchStream(svc.address, "j", 0, 2, client_id="second")
        s2.load_state_dict(state)
        tail = [b.digest() for b in s2]
        assert s2.last_end.job_done and s2.state_dict()["done"]
        s2.close()
        other.join(30)
    assert head + tail == ref0


def test_health_reflection_and_job_status():
    samples = synthetic_samples(40, max_len=100)
    cfg = service_config(job_dict())
    with serving(cfg, {"j": samples}) as svc:
        ch = grpc.insecure_channel(svc.address)
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "odb.v1.DataService"):
            resp = h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {"odb.v1.DataService", "grpc.health.v1.Health"} <= names
        consume_all(svc.address, "j", 2)
        st = pb_grpc.DataServiceStub(ch).GetJob(pb.GetJobRequest(job_id="j"), timeout=5)
        assert st.done and st.world_size == 2 and st.mode == pb.JOIN and st.samples_in == 40
        assert [r.acked_step for r in st.ranks] == [r.delivered_step for r in st.ranks]
        assert st.epoch_ends[0].steps == st.published_through + 1
        ch.close()


def test_health_watchers_hold_no_handler_thread_and_see_not_serving():
    """Every trainer channel watches its replicas' health (round_robin's health checking):
    more watchers than the replica has handler threads (16) must leave GetJob answering, each
    must see a drain's NOT_SERVING, and the replica must stop with none left behind."""
    samples = synthetic_samples(40, max_len=100)
    cfg = service_config(job_dict())
    with serving(cfg, {"j": samples}) as svc:
        channels = [grpc.insecure_channel(svc.address) for _ in range(24)]
        watches = [health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=30) for ch in channels]
        try:
            assert {next(w).status for w in watches} == {health_pb2.HealthCheckResponse.SERVING}
            st = pb_grpc.DataServiceStub(channels[0]).GetJob(pb.GetJobRequest(job_id="j"),
                                                             timeout=5)
            assert st.job_id == "j"
            svc.health.enter_graceful_shutdown()
            assert {next(w).status for w in watches} == {
                health_pb2.HealthCheckResponse.NOT_SERVING}
        finally:
            for ch in channels:
                ch.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("odb_")]


def test_an_accepted_stream_says_so_before_its_first_batch_and_a_refused_one_does_not():
    """The initial metadata a client ends its outage on (`STREAM_ACCEPTED`): sent once the
    Open is accepted, before any batch (a rank waiting for its step has a working call); never
    on a call the replica refuses."""
    samples = synthetic_samples(40, max_len=100)
    with serving(service_config(job_dict()), {"j": samples}) as svc:
        ok = RawStream(svc.address, open_msg(credits=1))
        refused = RawStream(svc.address, open_msg(job="nope"))
        try:
            assert STREAM_ACCEPTED in tuple(ok.call.initial_metadata())
            with pytest.raises(grpc.RpcError) as err:
                refused.next()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert STREAM_ACCEPTED not in tuple(refused.call.initial_metadata() or ())
        finally:
            ok.close()
            refused.close()


def test_a_trainer_slower_than_a_lease_through_its_last_batches_still_acks_them_all():
    """The final END arrives with the last prefetched batches; a trainer that takes longer than
    `lease_seconds` to train through them (a long step, on real hosts: a DDP step on a loaded
    machine) keeps its stream with its heartbeats, and its acks through the last step are
    recorded. (Found on the multi-host suite: the replica ended the call a lease after the
    END, and the last acks were lost: acked 7 of 11.)"""
    samples = uneven_samples(12, 2048)
    cfg = service_config(job_dict("j", 1, batching={"token_budget": 2048})).model_copy(
        update={"lease_seconds": 1.0})
    with serving(cfg, {"j": samples}) as svc:
        with BatchStream(svc.address, "j", 0, 1, prefetch=4, heartbeat_s=0.2) as stream:
            taken = 0
            for _ in stream:
                time.sleep(0.6)  # 4 batches held: 2.4 s > the lease
                taken += 1
        state = svc.runtimes["j"].state
        assert taken == 12 and stream.done
        wait_for(lambda: [h.acked for h in state.rank_health()] == [11], 5.0,
                 "the acks through the last step")


def test_server_restart_continues_the_plan_from_its_checkpoint():
    """A new server on the surviving JobState (what Redis gives) resumes planning mid-epoch:
    ranks resume from their state_dicts; the union is the epoch exactly once, byte-identical."""
    # ~38 steps: the producer, held 6 steps past the ranks' acks plus a pool, cannot finish.
    samples = synthetic_samples(800, max_len=500, seed=9)
    cfg = service_config(job_dict(seed=4, batching={"pool_steps": 4}))
    with serving(cfg, {"j": samples}) as svc:
        ref = consume_all(svc.address, "j", 2)
    ref_digests = {r: [b.digest() for b in batches(ref[r])] for r in ref}

    state = MemoryJobState("j", 2)
    heads: dict[int, list[str]] = {}
    saved: dict[int, dict] = {}
    with serving(cfg, {"j": samples}, job_states={"j": state}) as svc:
        def head(r: int) -> None:
            with BatchStream(svc.address, "j", r, 2, client_id=f"a{r}") as s:
                it = iter(s)
                heads[r] = [next(it).digest() for _ in range(6)]
                saved[r] = s.state_dict()

        threads = [threading.Thread(target=head, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not state.is_done()  # stopped mid-epoch (the producer is held by acks)
    with serving(cfg, {"j": samples}, job_states={"j": state}) as svc:
        tails: dict[int, list[str]] = {}

        def tail(r: int) -> None:
            with BatchStream(svc.address, "j", r, 2, client_id=f"b{r}") as s:
                s.load_state_dict(saved[r])
                tails[r] = [b.digest() for b in s]

        threads = [threading.Thread(target=tail, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for r in range(2):
        assert heads[r] + tails[r] == ref_digests[r]


def test_a_stream_without_a_state_goes_on_where_the_rank_left_off():
    """Guarantee 5: a trainer restarted without a checkpoint resumes at its first unacknowledged
    step (not at 0), and a rank done with the job gets its final END again."""
    samples = synthetic_samples(200, max_len=600, seed=8)
    cfg = service_config(job_dict(world_size=1, epochs=2))
    with serving(cfg, {"j": samples}) as svc:
        first = BatchStream(svc.address, "j", 0, 1, client_id="a")
        it = iter(first)
        head = [next(it) for _ in range(4)]
        first.ack()  # the fourth batch is consumed too
        first.close()
        with BatchStream(svc.address, "j", 0, 1, client_id="b") as again:
            rest = []
            while not again.done:
                rest += list(again)
        assert rest[0].info.step == head[-1].info.step + 1
        ids = [i for b in head + rest for i in b.info.sample_ids]
        assert sorted(ids) == sorted(2 * [s.sample_id for s in samples])  # exactly once
        with BatchStream(svc.address, "j", 0, 1, client_id="c") as late:
            assert list(late) == [] and late.done and late.last_end.job_done
