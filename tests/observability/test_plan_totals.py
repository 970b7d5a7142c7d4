"""Consumption totals derived from the plan and the ranks' cursors, and stall detection."""

from __future__ import annotations

import time

from obs_helpers import JOB, Rank, served
from support.waiting import wait_for

from pipeline.jobstate import MemoryJobState, PlannerCheckpoint, Publication
from pipeline.observability import status_view
from pipeline.observability.plan_totals import PlanTotals, batch_figures
from pipeline.planner.types import Batch, MeasuredSample, Step, StepInfo, WorldStamp


def _batch(rank: int, *lengths: int, truncated: dict | None = None) -> Batch:
    samples = tuple(MeasuredSample(f"s{rank}-{i}", n) for i, n in enumerate(lengths))
    return Batch(rank, samples, cost=len(lengths) * max(lengths),
                 truncated_to=truncated or {})


def _step(n: int, *batches: Batch) -> Step:
    return Step(0, n, batches, StepInfo(sum(len(b.samples) for b in batches),
                                        sum(b.num_tokens for b in batches)), WorldStamp(0, 2))


def test_batch_figures_padded_packed_and_truncated() -> None:
    b = _batch(0, 10, 30, 20)
    f = batch_figures(b, "padded")
    assert (f.samples, f.tokens, f.padded_tokens, f.cost) == (3, 60, 30, 90)
    assert batch_figures(b, "packed").padded_tokens == 0
    t = batch_figures(_batch(0, 100, 10, truncated={"s0-0": 40}), "padded")
    assert (t.tokens, t.padded_tokens) == (50, 30)


def test_join_mode_tail_and_rewind_count_each_batch_once() -> None:
    state = MemoryJobState(JOB, 2)
    gen = state.claim_producer("p", 60)
    state.publish(Publication(PlannerCheckpoint(0, 4, 2), steps=(
        _step(0, _batch(0, 8, 8), _batch(1, 4)),
        _step(1, _batch(0, 6)))), fence=gen)  # join tail: rank 1 has no batch at step 1
    pt = PlanTotals(state, "padded")
    pt.update([1, 0])
    assert [(r.batches, r.samples, r.tokens) for r in pt.ranks.values()] == [(2, 3, 22),
                                                                      (1, 1, 4)]
    assert pt.published_samples == 4 and not pt._pending  # both steps fully counted
    pt.update([0, 0])  # a rank restored from an older checkpoint: cursors never go back,
    pt.update([1, 0])  # and a count never does either
    assert pt.ranks[0].batches == 2  # a step counts once however often it is delivered


def test_a_rank_with_waiting_steps_and_no_acks_is_stalled(monkeypatch) -> None:
    monkeypatch.setattr(status_view, "STALL_AFTER_S", 0.3)
    with served() as (svc, _port):
        view = status_view.ServiceView(svc.runtimes, svc.replica_id)
        r0 = Rank(svc.address, 0, 1).start()
        try:
            r0.wait_taken()
            wait_for(lambda: svc.runtimes[JOB].state.acked(0) == r0.steps[-1], what="ack")
            view.snapshot()  # observe the ack
            time.sleep(0.5)
            ranks = view.snapshot()["jobs"][0]["ranks"]
            assert ranks[0]["stalled"] is True and ranks[0]["lag_steps"] > 0
            assert ranks[0]["seconds_since_progress"] >= 0.3
            assert ranks[1]["replica"]["connected"] is False
        finally:
            r0.release()
