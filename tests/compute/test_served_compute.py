"""Compute balancing served end to end: real Redis, real gRPC, real BatchStreams that report
synthetic compute seconds following planted coefficients. The gate opens, the producer's later
steps are balanced by (and record) the fitted model, and their measured imbalance is lower than
that of the steps balanced by tokens."""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path
from statistics import median

import pytest

from pipeline.planner.compute_fit import ComputeModel, batch_features
from pipeline.planner.types import Collate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "service"))
from service_helpers import job_dict, service_config, serving

from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchStream

# Attention-heavy, with a per-sample overhead: padded tokens alone misjudge a batch's time.
PLANTED = ComputeModel((2e-3, 0.0, 1e-6, 4e-9, 0.0, 0.0, 2e-3))
W = 2


def features_of(state, step: int, rank: int) -> tuple[float, ...]:
    batch = state.get_step_for(step, [rank]).batch_for(rank)
    lengths = [batch.truncated_to.get(s.sample_id, s.num_tokens) for s in batch.samples]
    return batch_features(batch.samples, lengths, Collate.PADDED)


def run_rank(address: str, state, rank: int, errors: list, per_step_s: float) -> None:
    rng = random.Random(rank)
    try:
        with BatchStream(address, "j", rank, W) as stream:
            for batch in stream:
                seconds = PLANTED.predict(features_of(state, batch.info.step, rank))
                stream.report_compute(batch, seconds * (1 + rng.gauss(0, 0.01)))
                if rank == 0 and batch.info.step % 50 == 7:
                    stream.report_compute(batch, float("nan"))  # nonsense: rejected, counted
                time.sleep(per_step_s)  # the producer polls reports every second
    except BaseException as exc:
        errors.append(exc)


def test_gate_opens_and_later_steps_are_balanced_by_predicted_time(redis_url):
    job = job_dict("j", W, batching={"compute_balancing": {"enabled": True, "min_reports": 32},
                                     "pool_steps": 16})
    samples = synthetic_samples(3000, seed=3, min_len=16, max_len=1024)
    with serving(service_config(job, redis_url=redis_url), {"j": samples}) as svc:
        state = svc.runtimes["j"].state
        errors: list = []
        threads = [threading.Thread(target=run_rank, args=(svc.address, state, r, errors, 0.01))
                   for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a rank did not finish its epoch"
        assert not errors, errors
        assert state.is_done() and state.acked_all() == [state.published_through()] * W
        fit = state.compute_fit()
        steps = [state.get_step(n) for n in range(state.published_through() + 1)]
        probe = features_of(state, steps[-1].step, steps[-1].batches[0].rank)
    assert fit is not None and fit.gate_open, fit
    assert fit.error <= 0.10 and fit.rejected >= 1 and fit.accepted >= 32
    # The newest fully reported step was balanced by the model: its ranks' times predicted.
    assert fit.last_predicted.keys() == fit.last_measured.keys() and fit.last_predicted
    for r, measured in fit.last_measured.items():
        assert fit.last_predicted[r] == pytest.approx(measured, rel=0.1)
    by_model = [s for s in steps if s.compute is not None]
    by_tokens = [s for s in steps if s.compute is None]
    assert by_model and by_tokens, "the job starts by tokens and switches once the gate opens"
    first = min(s.step for s in by_model)
    assert all(s.compute is not None for s in steps[first:]), "the model stays in force"
    model = by_model[-1].compute
    assert model.predict(probe) == pytest.approx(PLANTED.predict(probe), rel=0.05)

    def imbalance(group):
        out = []
        for s in group:
            if len(s.batches) == W:
                t = [PLANTED.predict(batch_features(
                    b.samples, [x.num_tokens for x in b.samples], Collate.PADDED))
                     for b in s.batches]
                out.append(max(t) * W / sum(t))
        return median(out)

    assert imbalance(by_model) < imbalance(by_tokens)


@pytest.mark.parametrize("enabled", [True, False])
def test_reports_ride_on_acks_and_bad_ones_get_invalid_argument(enabled):
    import grpc
    from service_helpers import RawStream, open_msg

    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    job = job_dict("j", W, batching={"compute_balancing": {"enabled": enabled}})
    with serving(service_config(job), {"j": synthetic_samples(200, max_len=300)}) as svc:
        state = svc.runtimes["j"].state
        raw = RawStream(svc.address, open_msg("j", rank=1, credits=2))
        try:
            step = raw.next().batch.step
            raw.send(pb.ClientMessage(ack=pb.Ack(consumed_step=step, credits=1, compute=[
                pb.ComputeReport(step=step, seconds=0.25),
                pb.ComputeReport(step=step, seconds=-1.0)])))  # nonsense is the fit's to count
            nxt = raw.next().batch.step
            deadline = time.monotonic() + 10
            while enabled and state.compute_reports()[0] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            total, kept = state.compute_reports()
            assert (total, [(r.world, r.step, r.rank, r.seconds) for r in kept]) == (
                (2, [(0, step, 1, 0.25), (0, step, 1, -1.0)]) if enabled else (0, []))
            raw.send(pb.ClientMessage(ack=pb.Ack(consumed_step=nxt, compute=[
                pb.ComputeReport(step=nxt + 1000, seconds=0.1)])))  # a step it was not sent
            with pytest.raises(grpc.RpcError) as err:
                while True:
                    raw.next()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"compute report of step {nxt + 1000}" in err.value.details()
        finally:
            raw.close()
