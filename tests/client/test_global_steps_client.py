"""The client side of global steps (docs/global-steps.md) against a real served job: one wire
Batch per micro-batch, a step consumed (acknowledged, saved in `state_dict`) only once its last
micro-batch was taken, a reconnection mid-step that yields no micro-batch twice, a restored
mid-step position that restarts the step at its first micro-batch, compute reports summed per
step, a wire-version-3 client refused by a job with global steps (and still served one without),
and the accumulation helper: `no_sync` around all but a step's last micro-batch, a step left
early or out of order refused."""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict

import grpc
import pytest
from service_helpers import RawStream, job_dict, open_msg, service_config, serving
from support.waiting import wait_for

from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchInfo, BatchStream, StepOutOfOrder, StreamBatch, optimizer_steps
from trainer_client.wire_format import MISMATCH_PREFIX

SAMPLES = synthetic_samples(160, max_len=400, seed=12)
ALL_IDS = Counter(s.sample_id for s in SAMPLES)


def served(world_size: int = 1, **batching):
    cfg = service_config(job_dict(world_size=world_size, batching={
        "token_budget": 1024, "global_token_budget": 4096, **batching}))
    return serving(cfg, {"j": SAMPLES})


def check_steps(batches: list) -> dict[int, list[int]]:
    """Each step's micro-batches came once each, in order; returns step -> micro indices."""
    micros: dict[int, list[int]] = defaultdict(list)
    for b in batches:
        i = b.info
        assert i.optimizer_step is not None and i.micro_count >= 1
        micros[i.step].append(i.micro_index)
    for step, got in micros.items():
        assert got == list(range(len(got))), f"step {step}: micro-batches {got}"
        assert len(got) == next(b.info.micro_count for b in batches if b.info.step == step)
    return micros


def test_a_reconnection_mid_step_yields_no_micro_batch_twice_and_a_resume_restarts_the_step():
    with served(compute_balancing={"enabled": True}) as svc:
        # One batch in flight: the reconnection comes with the step's micro-batch 2 received,
        # so the resumed call (from the step's first) sends micro-batches 0-2 again.
        s = BatchStream(svc.address, "j", 0, 1, prefetch=1)
        it = iter(s)
        got = [next(it)]
        while got[-1].info.micro_count < 4 or got[-1].info.micro_index:
            got.append(next(it))
        first = got[-1]
        assert first.info.micro_index == 0
        got.append(next(it))  # its micro-batch 1: the step is not consumed yet
        step = first.info.step
        mid = s.state_dict()
        assert mid["next_step"] == step  # a resume restarts the step
        wait_for(lambda: s.job_status().ranks[0].acked_step == step - 1, 10,
                 "the ack of the step before")
        s.report_compute(got[-2], 0.25)
        s.report_compute(got[-1], 0.5)
        s._link.call.cancel()  # the connection breaks mid-step: the stream reconnects
        got += list(it)
        assert s.reconnects >= 1
        check_steps(got)
        assert Counter(i for b in got for i in b.info.sample_ids) == ALL_IDS
        assert s.state_dict()["next_step"] == got[-1].info.step + 1
        s.close()
        # Reported per micro-batch, recorded once per step: the sum of the step's.
        reports = svc.runtimes["j"].state.compute_reports(0)[1]
        assert [(r.step, r.seconds) for r in reports if r.step == step] == []  # not whole yet
        with BatchStream(svc.address, "j", 0, 1, client_id="again") as again:
            again.load_state_dict(mid)
            redo = list(again)
        assert (redo[0].info.step, redo[0].info.micro_index) == (step, 0)
        check_steps(redo)


def test_a_steps_micro_batch_compute_is_reported_once_summed():
    with served(compute_balancing={"enabled": True}) as svc:
        with BatchStream(svc.address, "j", 0, 1) as s:
            seconds = {}
            for b in s:
                s.report_compute(b, 0.01 * (b.info.micro_index + 1))
                seconds[b.info.step] = seconds.get(b.info.step, 0.0) + 0.01 * (
                    b.info.micro_index + 1)
        reports = svc.runtimes["j"].state.compute_reports(0)[1]
        assert sorted(r.step for r in reports) == sorted(seconds)  # one report per step
        for r in reports:
            assert r.seconds == pytest.approx(seconds[r.step])


def test_a_version_3_client_is_refused_by_a_job_with_global_steps_and_served_without():
    with served() as svc:
        raw = RawStream(svc.address, open_msg(world_size=1, wire_version=3))
        with pytest.raises(grpc.RpcError) as err:
            raw.next()
        raw.close()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details()
        assert details.startswith(MISMATCH_PREFIX) and "global steps" in details
        assert "version 3" in details and "version 4" in details
    cfg = service_config(job_dict(world_size=1, batching={"token_budget": 1024}))
    with serving(cfg, {"j": SAMPLES}) as svc:
        raw = RawStream(svc.address, open_msg(world_size=1, wire_version=3))
        msg = raw.next()
        raw.close()
        assert msg.WhichOneof("kind") == "batch" and msg.batch.info.micro_count == 0


# --- the accumulation helper (pure) ---------------------------------------------------------

def _batch(step: int, index: int, count: int) -> StreamBatch:
    b = StreamBatch()
    b.info = BatchInfo(step=step, epoch=0, rank=0, world_size=2, sample_ids=(), step_samples=1,
                       step_tokens=1, rank_samples=1, rank_tokens=1, step_loss_tokens=1,
                       rank_loss_tokens=1, collate="padded", over_budget=False,
                       micro_index=index, micro_count=count, optimizer_step=step)
    return b


class Model:
    """Records whether each batch ran under no_sync."""

    def __init__(self) -> None:
        self.syncing = True

    @contextlib.contextmanager
    def no_sync(self):
        assert self.syncing, "no_sync entered twice"
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


def test_optimizer_steps_sync_only_on_each_steps_last_micro_batch():
    model = Model()
    batches = [_batch(0, 0, 3), _batch(0, 1, 3), _batch(0, 2, 3), _batch(1, 0, 1),
               _batch(2, 0, 2), _batch(2, 1, 2)]
    seen = []
    for step in optimizer_steps(batches, model):
        for b in step:
            seen.append((b.info.step, b.info.micro_index, model.syncing))
        assert model.syncing and step.done
    assert seen == [(0, 0, False), (0, 1, False), (0, 2, True), (1, 0, True), (2, 0, False),
                    (2, 1, True)]
    plain = [StreamBatch() for _ in range(2)]
    for i, b in enumerate(plain):  # without global steps every batch is a step of one
        b.info = BatchInfo(step=i, epoch=0, rank=0, world_size=1, sample_ids=(),
                           step_samples=1, step_tokens=1, rank_samples=1, rank_tokens=1,
                           step_loss_tokens=1, rank_loss_tokens=1, collate="padded",
                           over_budget=False)
    assert [[b.info.step for b in st] for st in optimizer_steps(plain, model)] == [[0], [1]]


def test_a_step_left_early_or_out_of_order_is_refused():
    model = Model()
    steps = optimizer_steps([_batch(0, 0, 2), _batch(0, 1, 2), _batch(1, 0, 1)], model)
    first = next(steps)
    for _ in first:
        break  # left after its first micro-batch
    assert model.syncing  # the context was left with the loop
    with pytest.raises(StepOutOfOrder, match="step 0 was left after 1 of its 2"):
        next(steps)
    with pytest.raises(StepOutOfOrder, match="expected micro-batch 1 of step 0"):
        for step in optimizer_steps([_batch(0, 0, 2), _batch(1, 0, 1)], model):
            list(step)
    with pytest.raises(StepOutOfOrder, match="expected micro-batch 0 of step 3"):
        list(optimizer_steps([_batch(3, 1, 2)], model))
