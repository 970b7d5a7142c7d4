"""Emission totals derived from the plan, quarantine labels and stall detection, in isolation."""

from __future__ import annotations

import time
from types import SimpleNamespace

from obs_helpers import JOB, Rank, served, wait_for

from pipeline.observability import status_view
from pipeline.observability.plan_totals import PlanTotals, batch_figures
from pipeline.observability.quarantine import by_reason, parse_record
from pipeline.planner.types import Batch, MeasuredSample, Step, StepInfo
from pipeline.service.job_runtime import RankInfo
from pipeline.service.memory_state import MemoryJobState


def _batch(rank: int, *lengths: int, truncated: dict | None = None) -> Batch:
    samples = tuple(MeasuredSample(f"s{rank}-{i}", n) for i, n in enumerate(lengths))
    return Batch(rank, samples, cost=len(lengths) * max(lengths),
                 truncated_to=truncated or {})


def _step(n: int, *batches: Batch) -> Step:
    return Step(0, n, batches, StepInfo(sum(len(b.samples) for b in batches),
                                        sum(b.num_tokens for b in batches)))


def test_batch_figures_padded_packed_and_truncated() -> None:
    b = _batch(0, 10, 30, 20)
    f = batch_figures(b, "padded")
    assert (f.samples, f.tokens, f.padded_tokens, f.cost) == (3, 60, 30, 90)
    assert batch_figures(b, "packed").padded_tokens == 0
    t = batch_figures(_batch(0, 100, 10, truncated={"s0-0": 40}), "padded")
    assert (t.tokens, t.padded_tokens) == (50, 30)


def test_join_mode_tail_and_rewind_count_each_batch_once() -> None:
    state = MemoryJobState(JOB)
    rt = SimpleNamespace(state=state, world_size=2, collate="padded",
                         ranks=[RankInfo(), RankInfo()])
    pt = PlanTotals(rt)  # type: ignore[arg-type]
    state.publish_step(_step(0, _batch(0, 8, 8), _batch(1, 4)))
    state.publish_step(_step(1, _batch(0, 6)))  # join tail: rank 1 has no batch here
    rt.ranks[0].delivered, rt.ranks[1].delivered = 1, 0
    pt.update()
    assert [(r.batches, r.samples, r.tokens) for r in pt.ranks] == [(2, 3, 22), (1, 1, 4)]
    assert pt.published_samples == 4 and not pt._pending  # both steps fully counted
    rt.ranks[0].delivered = 0  # a rank restored from an older checkpoint gets step 0 again
    pt.update()
    rt.ranks[0].delivered = 1
    pt.update()
    assert pt.ranks[0].batches == 2  # redelivery is not a new emission


def test_quarantine_reason_labels_are_bounded() -> None:
    recs = ["a.jsonl:3: bad_json", "x:1: num_tokens=9000 exceeds token_budget=4096",
            "x:2: num_visual_tokens=9 exceeds max_visual_tokens=4",
            "x:3: invalid size: num_tokens=0, num_visual_tokens=0",
            "x:4: Some Free Text", "garbage", "b.jsonl:7: bad_utf8: byte 0xff at 12"]
    assert by_reason(recs) == {"bad_json": 1, "bad_utf8": 1, "invalid_size": 1, "other": 2,
                               "over_budget": 1, "over_visual_cap": 1}
    assert parse_record(recs[0]).sample_id == "a.jsonl:3"


def test_a_rank_with_waiting_steps_and_no_acks_is_stalled(monkeypatch) -> None:
    monkeypatch.setattr(status_view, "STALL_AFTER_S", 0.3)
    with served() as (svc, _port):
        view = status_view.ServiceView(svc.runtimes)
        r0 = Rank(svc.address, 0, 1).start()
        try:
            r0.wait_taken()
            wait_for(lambda: svc.runtimes[JOB].state.acked(0) == r0.steps[-1], what="ack")
            view.snapshot()  # observe the ack
            time.sleep(0.5)
            ranks = view.snapshot()["jobs"][0]["ranks"]
            assert ranks[0]["stalled"] is True and ranks[0]["lag_steps"] > 0
            assert ranks[0]["seconds_since_progress"] >= 0.3
            assert ranks[1]["connected"] is False
        finally:
            r0.release()
