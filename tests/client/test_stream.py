"""BatchStream against a real served job: exits that never abort, gRPC targets with failover,
decoding to torch or numpy and to the model's inputs, the wire-version refusal, and
StreamLoader's state conventions (torchdata StatefulDataLoader)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from service_helpers import RawStream, job_dict, open_msg, service_config, serving
from support.waiting import wait_for

from pipeline.preprocess.array_source import synthetic_samples
from pipeline.redis_server import free_port
from trainer_client import BatchStream, EpochEndInfo, StreamError, StreamLoader
from trainer_client.wire_format import MISMATCH_PREFIX, WIRE_VERSION

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = synthetic_samples(120, max_len=400, seed=11)


def served(world_size: int = 1, epochs: int = 1, **batching):
    cfg = service_config(job_dict(world_size=world_size, epochs=epochs,
                                  batching={"token_budget": 1024, **batching}))
    return serving(cfg, {"j": SAMPLES})


def ids_of(batches) -> list[str]:
    return sorted(i for b in batches for i in b.info.sample_ids)


ALL_IDS = sorted(s.sample_id for s in SAMPLES)

# --- exits -------------------------------------------------------------------------------

TRAINER = textwrap.dedent("""
    import os, signal, sys
    from trainer_client import BatchStream
    how, address = sys.argv[1], sys.argv[2]
    # Ctrl-C raises KeyboardInterrupt even where this process was started with SIGINT ignored
    # (a background job of a non-interactive shell, as CI runs it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stream = BatchStream(address, "j", 0, 1, prefetch=4)   # never closed
    for i, batch in enumerate(stream):
        if how == "max_steps":
            break
        if how == "exception":
            raise RuntimeError("the trainer failed")
        if how == "ctrl_c":
            os.kill(os.getpid(), signal.SIGINT)
""")


@pytest.mark.slow
@pytest.mark.parametrize(("how", "code"), [("max_steps", 0), ("exception", 1),
                                           ("ctrl_c", -signal.SIGINT)])
def test_a_trainer_that_stops_mid_epoch_without_close_exits_cleanly(how, code):
    """Before the exit finalizer, 2 of 3 such exits aborted ("terminate called without an
    active exception": gRPC threads alive at interpreter exit). Repeated: the abort was racy."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with served() as svc:
        for attempt in range(3):
            proc = subprocess.run([sys.executable, "-c", TRAINER, how, svc.address], env=env,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == code, (attempt, proc.returncode, proc.stderr[-2000:])
            assert "terminate called" not in proc.stderr and "Aborted" not in proc.stderr


def test_close_is_idempotent_and_a_closed_stream_refuses_to_iterate():
    with served() as svc:
        stream = BatchStream(svc.address, "j", 0, 1)
        with stream:
            next(iter(stream))
        stream.close()
        with pytest.raises(StreamError, match="closed"):
            next(iter(stream))


# --- targets and failover -----------------------------------------------------------------

@pytest.mark.parametrize("policy", ["pick_first", "round_robin"])
def test_a_multi_address_target_fails_over_past_a_dead_address(policy):
    dead = free_port()  # nothing listens there
    with served() as svc:
        live = svc.address.rsplit(":", 1)[1]
        target = f"ipv4:127.0.0.1:{dead},127.0.0.1:{live}"
        with BatchStream(target, "j", 0, 1, load_balancing=policy) as stream:
            got = list(stream)
    assert ids_of(got) == ALL_IDS


def test_a_dns_target_works():
    with served() as svc:
        port = svc.address.rsplit(":", 1)[1]
        with BatchStream(f"dns:///localhost:{port}", "j", 0, 1) as stream:
            assert ids_of(list(stream)) == ALL_IDS


# --- decoding -----------------------------------------------------------------------------

def test_padded_batches_decode_to_compact_tensors_and_widen_in_model_inputs():
    with served() as svc, BatchStream(svc.address, "j", 0, 1) as stream:
        batch = next(iter(stream))
        assert batch["input_ids"].dtype == torch.int32 and batch["labels"].dtype == torch.int32
        assert batch["attention_mask"].dtype == torch.bool and "position_ids" not in batch
        wire = sum(t.numel() * t.element_size() for t in batch.values())
        assert wire <= 9 * batch["input_ids"].numel()
        inputs = batch.to_model_inputs("cpu")
        assert {k: v.dtype for k, v in inputs.items()} == {
            "input_ids": torch.int64, "labels": torch.int64, "attention_mask": torch.int64}
        assert torch.equal(inputs["input_ids"], batch["input_ids"].long())
        assert inputs.info is batch.info


def test_packed_batches_get_the_varlen_names_hf_models_take():
    with served(collate="packed") as svc, BatchStream(svc.address, "j", 0, 1) as stream:
        batch = next(iter(stream))
        inputs = batch.to_model_inputs()
        assert set(inputs) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q",
                               "cu_seq_lens_k", "max_length_q", "max_length_k"}
        assert inputs["position_ids"].dtype == torch.int64
        assert inputs["cu_seq_lens_q"].dtype == torch.int32
        assert inputs["max_length_q"] == int(batch["max_seqlen"])
        lens = batch["cu_seqlens"].diff()
        assert inputs["max_length_q"] == int(lens.max())


def test_numpy_batches_when_asked_and_the_digest_ignores_the_kind():
    with served() as svc:
        with BatchStream(svc.address, "j", 0, 1, tensors="numpy", client_id="a") as s:
            as_numpy = list(s)
        with BatchStream(svc.address, "j", 0, 1, tensors="torch", client_id="b") as s:
            # The same epoch again: from step 0 explicitly (a fresh stream would go on where
            # the rank left off, i.e. straight to the job's end).
            s.load_state_dict({**s.state_dict(), "next_step": 0, "epoch": 0})
            as_torch = list(s)
    assert all(isinstance(v, np.ndarray) for b in as_numpy for v in b.values())
    assert [b.digest() for b in as_numpy] == [b.digest() for b in as_torch]
    assert as_numpy[0].to_model_inputs()["input_ids"].dtype == np.int64
    with pytest.raises(ValueError, match="numpy batch cannot move"):
        as_numpy[0].to_model_inputs("cuda")


# --- the wire version ----------------------------------------------------------------------

def test_an_old_client_gets_failed_precondition_naming_both_versions():
    with served() as svc:
        raw = RawStream(svc.address, open_msg(world_size=1, wire_version=0))  # as before the field
        with pytest.raises(grpc.RpcError) as err:
            raw.next()
        raw.close()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details().startswith(MISMATCH_PREFIX)
        assert "(0)" in err.value.details() and f"version {WIRE_VERSION}" in err.value.details()
        # The current client is served.
        with BatchStream(svc.address, "j", 0, 1) as stream:
            assert ids_of(list(stream)) == ALL_IDS


def test_a_client_of_another_version_fails_at_once_instead_of_retrying(monkeypatch):
    import trainer_client.batch_stream as bs

    monkeypatch.setattr(bs, "WIRE_VERSION", WIRE_VERSION + 1)
    with served() as svc, BatchStream(svc.address, "j", 0, 1, reconnect_timeout=60) as s:
        t0 = time.monotonic()
        with pytest.raises(StreamError, match=MISMATCH_PREFIX) as err:
            list(s)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert time.monotonic() - t0 < 10 and s.reconnects == 0


def test_a_client_waiting_for_the_service_says_what_it_waits_for_every_few_seconds(caplog):
    """#42: a trainer started with no service up was silent until its reconnect_timeout ran
    out. It says at once, and every `wait_log_s`, where it connects and what it hears."""
    port = free_port()  # nothing listens there
    with caplog.at_level("WARNING", logger="trainer_client.batch_stream"), \
            BatchStream(f"127.0.0.1:{port}", "j", 0, 1, reconnect_timeout=2.5,
                        wait_log_s=1.0) as s, pytest.raises(StreamError) as err:
        list(s)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    said = [r.getMessage() for r in caplog.records]
    assert len(said) >= 2, said  # at the first failure, then again while it waits
    for line in said:
        assert f"job j rank 0: waiting for the service at 127.0.0.1:{port} for " in line, line
        assert "giving up after reconnect_timeout 2.5 s); it says UNAVAILABLE: " in line, line


def test_a_rerun_on_a_finished_job_says_the_job_has_finished(caplog):
    with served() as svc:
        with BatchStream(svc.address, "j", 0, 1) as stream:
            assert ids_of(list(stream)) == ALL_IDS and stream.done
        with caplog.at_level("WARNING", logger="trainer_client.batch_stream"), \
                BatchStream(svc.address, "j", 0, 1) as again:
            assert list(again) == [] and again.done
    (said,) = [r.getMessage() for r in caplog.records if r.name == "trainer_client.batch_stream"]
    assert "job j rank 0: the job has finished" in said and "job reset j" in said


# --- model-parallel groups ----------------------------------------------------------------

def test_the_members_of_a_group_get_the_same_batches_and_getjob_shows_them():
    with served(pad_to_multiple=8) as svc:
        members = [BatchStream(svc.address, "j", 0, 1, group_size=2, group_rank=j)
                   for j in range(2)]
        its = [iter(m) for m in members]
        got: list[list] = [[], []]
        while True:
            pair = [next(it, None) for it in its]
            if pair[0] is None:
                assert pair[1] is None
                break
            assert pair[0].digest() == pair[1].digest() and pair[0]["input_ids"].shape[1] % 8 == 0
            for mine, b in zip(got, pair, strict=True):
                mine.append(b)
            if len(got[0]) == 2:  # mid-epoch: GetJob lists both members under rank 0
                (rank,) = members[0].job_status().ranks
                assert rank.client_id == "group:2"
                assert [(m.member, m.client_id) for m in rank.members] == [
                    (j, members[j].client_id) for j in range(2)]
        assert ids_of(got[0]) == ALL_IDS and ids_of(got[1]) == ALL_IDS
        for m in members:
            m.close()


def test_a_group_on_a_job_without_pad_to_multiple_fails_at_once():
    with served() as svc, BatchStream(svc.address, "j", 0, 1, group_size=2,
                                      reconnect_timeout=60) as s:
        t0 = time.monotonic()
        with pytest.raises(StreamError, match=r"group refused.*pad_to_multiple") as err:
            next(iter(s))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert time.monotonic() - t0 < 10 and s.reconnects == 0
    with pytest.raises(ValueError, match="group_rank must be in"):
        BatchStream("127.0.0.1:1", "j", 0, 1, group_size=2, group_rank=2)


def test_a_group_size_mismatch_is_retried_then_raised_naming_both():
    """A member of another group size is refused while the rank's group holds a live seat;
    the client retries (the other may be a previous launch's, whose lease lapses) and raises
    the refusal after its reconnect_timeout."""
    with served(pad_to_multiple=8) as svc:
        holder = BatchStream(svc.address, "j", 0, 1, group_size=2, client_id="tp-a")
        next(iter(holder))
        other = BatchStream(svc.address, "j", 0, 1, group_size=3, client_id="tp-b",
                            reconnect_timeout=1.0)
        with pytest.raises(StreamError, match="group_size mismatch") as err:
            next(iter(other))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "member 0 (client 'tp-a')" in err.value.details
        assert "client 'tp-b' opened it with group_size 3" in err.value.details
        assert other.reconnects >= 1
        other.close()
        holder.close()


# --- StreamLoader: torchdata StatefulDataLoader conventions -------------------------------

def test_loader_state_before_iteration_and_an_empty_load_change_nothing():
    with served(epochs=2) as svc, BatchStream(svc.address, "j", 0, 1) as stream:
        loader = StreamLoader(stream)
        before = loader.state_dict()
        assert before["_num_yielded"] == 0 and before["dataset_state"]["next_step"] == 0
        loader.load_state_dict({})
        assert ids_of(list(loader)) == ALL_IDS  # epoch 0 in full
        assert loader.state_dict()["_iterator_finished"] is True
        assert ids_of(list(loader)) == ALL_IDS  # the next pass is the next epoch
        assert stream.done and list(loader) == []


@pytest.mark.parametrize("align", [False, True])
def test_loader_resumes_mid_epoch_and_after_a_finished_pass_exactly_once(align):
    with served(epochs=2) as svc:
        with BatchStream(svc.address, "j", 0, 1, client_id="first") as s:
            loader = StreamLoader(s, align=align)
            it = iter(loader)
            head = [next(it) for _ in range(3)]
            mid = loader.state_dict()
            assert mid["_num_yielded"] == 3 and not mid["_iterator_finished"]
            assert head[-1].loader_state == mid
        with BatchStream(svc.address, "j", 0, 1, client_id="second") as s:
            loader = StreamLoader(s, align=align)
            loader.load_state_dict(mid)
            assert loader.state_dict() == mid  # loaded, not yet iterated
            rest = list(loader)
            assert ids_of(head + rest) == ALL_IDS
            assert loader.state_dict()["_num_yielded"] == len(head) + len(rest)
            finished = loader.state_dict()
        with BatchStream(svc.address, "j", 0, 1, client_id="third") as s:
            loader = StreamLoader(s, align=align)
            loader.load_state_dict(finished)
            second_epoch = list(loader)
            assert {b.info.epoch for b in second_epoch} == {1}
            assert ids_of(second_epoch) == ALL_IDS and s.done


def test_a_rank_with_no_batch_in_an_epoch_runs_only_fillers():
    """W=2 and a single sample: rank 1 gets its END at once; aligned, it still runs the epoch's
    one step, as a filler, and its stream knows where the next epoch starts."""
    cfg = service_config(job_dict(world_size=2, epochs=2, batching={"token_budget": 1024}))
    with serving(cfg, {"j": SAMPLES[:1]}) as svc:
        streams = [BatchStream(svc.address, "j", r, 2) for r in (0, 1)]
        loaders = [StreamLoader(s, align=True) for s in streams]
        for epoch in (0, 1):
            r0, r1 = list(loaders[0]), list(loaders[1])
            assert [b.info.step for b in r0] == [b.info.step for b in r1] == [epoch]
            assert not r0[0].info.filler and r1[0].info.filler and r1[0].info.sample_ids == ()
            end = streams[1].last_end
            assert isinstance(end, EpochEndInfo) and end.final_step == -1
            assert end.first_step == end.last_step == epoch
        for s in streams:
            s.close()


def test_a_version_1_state_learns_where_its_epoch_starts_from_the_job():
    """States saved before `epoch_first_step` existed still resume (and align): the stream asks
    the service how many steps the earlier epochs had."""
    with served(epochs=2) as svc:
        with BatchStream(svc.address, "j", 0, 1, client_id="first") as s:
            first_epoch = list(s)
            saved = s.state_dict()
        assert saved["epoch_first_step"] == len(first_epoch)
        old = {k: v for k, v in saved.items() if k != "epoch_first_step"} | {"version": 1}
        with BatchStream(svc.address, "j", 0, 1, client_id="second") as s:
            s.load_state_dict(old)
            assert s.epoch_first_step == len(first_epoch)
            second_epoch = list(s)
            assert s.last_end.first_step == len(first_epoch)
    assert ids_of(second_epoch) == ALL_IDS


def test_the_services_position_is_the_trainers_exact_one_and_close_records_the_last():
    """Issue #27 item 6: taking batch k acknowledges batch k-1 at once (not grouped), so a rank
    that dies, a shrink or an elastic restart hands back only the batch in progress."""
    with served() as svc:
        s = BatchStream(svc.address, "j", 0, 1, prefetch=4)
        it = iter(s)
        for _ in range(6):
            batch = next(it)  # the queue stays full: the trainer is the slow one
            wait_for(lambda b=batch: s.job_status().ranks[0].acked_step == b.info.step - 1,
                     10, "the ack of the batch before the one in progress")
            time.sleep(0.1)  # a step of training: nothing further is acknowledged
            assert s.job_status().ranks[0].acked_step == batch.info.step - 1
        s.close()  # sends the ack of the last batch taken
        with BatchStream(svc.address, "j", 0, 1) as probe:
            assert probe.job_status().ranks[0].acked_step == batch.info.step
