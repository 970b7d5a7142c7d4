"""The compute fit as status shows it: the fit's record -> `ComputeStatus` -> JSON and back,
the status text, and a job without compute balancing shows none of it."""

from __future__ import annotations

from pipeline.jobstate import ComputeFitStatus, MemoryJobState
from pipeline.observability.job_status import JobStatus
from pipeline.observability.status_json import job_from_dict, job_to_dict
from pipeline.observability.status_view import compute_status, training_job_status
from pipeline.planner.compute_fit import FEATURES
from pipeline.status.text import _job

FIT = ComputeFitStatus(gate_open=True, coefficients=(1e-3, 0, 2e-6, 4e-9, 0, 0, 1e-4),
                       error=0.031, reports=200, last_error=0.029, accepted=230, rejected=3,
                       warmup=6, stale=1, drifts=0,
                       imbalance=tuple((n, 1.0 + n / 100) for n in range(10)),
                       last_step=9, last_measured={0: 0.5, 1: 0.4},
                       last_predicted={0: 0.45, 1: 0.41})


def test_fit_record_round_trips_and_becomes_status():
    assert ComputeFitStatus.from_json(FIT.to_json()) == FIT
    c = compute_status(FIT)
    assert c.coefficients == dict(zip(FEATURES, FIT.coefficients, strict=True))
    assert (c.imbalance_p50, c.imbalance_p90, c.imbalance_last) == (1.05, 1.09, 1.09)
    assert c.imbalance_steps == 10 and c.rejected == 3
    assert (c.last_step, c.rank_measured_s, c.rank_predicted_s) == (
        9, {0: 0.5, 1: 0.4}, {0: 0.45, 1: 0.41})
    closed = compute_status(ComputeFitStatus(last_error=0.4, accepted=40))
    assert not closed.gate_open and closed.coefficients is None and closed.error is None
    assert closed.last_error == 0.4 and closed.imbalance_p50 is None


def test_status_json_and_text_show_the_fit():
    state = MemoryJobState("j", 2)
    assert training_job_status("j", state).compute is None  # never recorded: nothing shown
    state.set_compute_fit(FIT)
    job = training_job_status("j", state)
    assert job_from_dict(job_to_dict(job)).compute == job.compute
    text = "\n".join(_job(job, False))
    assert "by fitted time (error 3.1% over 200 reports)" in text
    assert "rejected 3" in text and "p50 1.050" in text and "attention=4e-09" in text
    assert "step 9 per rank, measured (predicted) s: 0: 0.5 (0.45)  1: 0.4 (0.41)" in text
    closed = JobStatus("j", state.mode, "running",
                       compute=compute_status(ComputeFitStatus(last_error=0.4)))
    assert "by tokens until the fit passes its gate (last fit error 40.0%)" in "\n".join(
        _job(closed, False))
