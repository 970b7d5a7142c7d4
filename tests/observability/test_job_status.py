"""The one typed status and its renderings: JSON and back is the identity, GetJob's reply
carries what the wire has, answers of several sources merge field by field, and a served job's
GetJob answer is the replica's own status."""

from __future__ import annotations

import dataclasses
import json

import grpc
from obs_helpers import JOB, ranks_stopped_at_known_steps, served
from support.waiting import wait_for

from pipeline.observability.job_status import (
    CoordinatorStatus,
    EpochEndStatus,
    JobStatus,
    MixChangeStatus,
    MixtureStatus,
    Planned,
    ProducerStatus,
    ProducerTrouble,
    QuarantineRecord,
    QuarantineStatus,
    RankOnReplica,
    RankStatus,
    RefillEpoch,
    RefillRates,
    RefillStatus,
    ReplicaStatus,
    SourceShareStatus,
    Throughput,
    Totals,
    WorldStatus,
)
from pipeline.observability.status_json import job_from_dict, job_to_dict
from pipeline.observability.status_proto import from_proto, to_proto
from pipeline.observability.status_view import ServiceView
from pipeline.status.merge import merge, with_interval_rates
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

RANKS = (RankStatus(0, 7, "c0", 2, 1.5, False, False, 0.0, 0.4, 4, 40, 900, 100, 1000,
                    RankOnReplica(True, 8, 40)),
         RankStatus(1, 6, "c1", 3, 31.0, True, True, 2.5, None, 3, 30, 700, 0, 800,
                    RankOnReplica(False, 6, 0)))
WORLDS = (WorldStatus(0, 4, 0, 37, (37, 37, 36, 37), "initial", 1.0, 0, None, None, None, {},
                      (0, 1, 2, 3), ()),
          WorldStatus(1, 2, 38, None, (), "scale", 2.0, 12, 0.04, 0.2, 0.31, {0: 0.3, 1: 0.31},
                      (), (0, 1, 2, 3)))
TRAINING = JobStatus(
    job_id="sft", mode="join", state="running", done=False, error="boom", open=True,
    world_size=2, epochs=2, published_through=41, samples_in=500, planned=Planned(480, 9000),
    collate="padded", token_budget=1024, producer=ProducerStatus(3, "replica:a", True),
    producer_trouble=ProducerTrouble("source gone a while", "source_unreadable", 2, 5.0),
    uptime_s=12.5, ranks=RANKS, lapsed_ranks=(1,), worlds=WORLDS, reconfiguring=False,
    epoch_ends=(EpochEndStatus(0, 20, (19, 18), 2),), totals=Totals(7, 70, 1600, 100, 1800),
    throughput=Throughput("uptime", 12.5, 5.6, 128.0, 0.56),
    quarantine=QuarantineStatus(2, {"bad_json": 2}, (QuarantineRecord("f:1", "bad_json", "x"),
                                                     QuarantineRecord("f:2", "bad_json"))),
    replica=ReplicaStatus("host:1:ab", 12.5),
    coordinator=CoordinatorStatus("planning", 41, -1, 42, 6, 1, 1, 100.0),
    exposure={"epochs": 1, "min": 1, "max": 2, "p50": 1, "max_epochs_unseen": 0},
    sources=MixtureStatus(1, "loss_tokens", (
        SourceShareStatus("chat", 300, 9000, 1, 0.6, 0.5),
        SourceShareStatus("code", 180, 6000, 0, 0.4, 0.5)),
        (MixChangeStatus(30, "mix 1", {"chat": 1.0, "code": 1.0}),)))
REFILL = JobStatus(
    job_id="gen", mode="refill", state="serving", open=False, epochs=2, samples_in=90,
    quarantine=QuarantineStatus(4, {"over_budget": 4}),
    refill=RefillStatus(90, 10, 5, 75, 3, 83, 4, 2, False, 1, 1, 2,
                        (RefillEpoch(0, 50, 50, 2), RefillEpoch(1, 40, 25, 2)),
                        RefillRates("uptime", 10.0, 8.3, 7.5)),
    replica=ReplicaStatus("host:1:ab", 10.0))


def test_json_and_back_is_the_identity() -> None:
    for job in (TRAINING, REFILL):
        text = json.dumps(job_to_dict(job))
        assert job_from_dict(json.loads(text)) == job
    out = job_to_dict(TRAINING)
    assert out["padding_efficiency"] == 1600 / 1700 and out["redis"]["retained_steps"] == 42
    assert out["ranks"][0]["replica"]["delivered_step"] == 8  # the keys `status --json` keeps


def test_getjob_carries_what_the_wire_has() -> None:
    back = from_proto(pb.JobStatus.FromString(to_proto(TRAINING).SerializeToString()))
    assert (back.job_id, back.mode, back.world_size, back.epochs, back.published_through) == (
        "sft", "join", 2, 2, 41)
    assert (back.error, back.open, back.lapsed_ranks, back.state) == ("boom", True, (1,),
                                                                      "failed")
    assert [(r.rank, r.acked_step, r.client_id, r.replica) for r in back.ranks] == [
        (0, 7, "c0", RankOnReplica(True, 8)), (1, 6, "c1", RankOnReplica(False, 6))]
    assert back.epoch_ends == TRAINING.epoch_ends and back.quarantine.total == 2
    assert [(w.world_size, w.last_step, w.adopted_s, w.first_batch_s) for w in back.worlds] == [
        (4, 37, None, None), (2, None, 0.04, 0.31)]
    assert back.totals is None and back.throughput is None  # not on the wire: unknown
    assert back.sources == TRAINING.sources
    rf = from_proto(to_proto(REFILL))
    assert rf.refill == dataclasses.replace(REFILL.refill, rates=None)
    assert (rf.state, rf.epochs, rf.world_size, rf.ranks) == ("serving", 2, None, None)


def test_a_job_no_rank_has_reached_says_so_and_shows_no_raw_minus_one() -> None:
    """#42: `status` said `state=draining` for a fully planned job no rank had connected to,
    with -1 for each step no rank had; it says `waiting for ranks`, and `-`."""
    from pipeline.observability.status_view import training_state
    from pipeline.status.report import StatusReport
    from pipeline.status.text import render

    ahead = dict(error=None, published_through=5, final_steps=(5, 4))
    assert training_state(done=True, acked=(-1, -1), holders=("", ""), **ahead) == \
        "waiting for ranks"
    assert training_state(done=False, acked=(-1, -1), holders=(None, None), **ahead) == \
        "waiting for ranks"
    assert training_state(done=True, acked=(-1, -1), holders=("c0", ""), **ahead) == "draining"
    assert training_state(done=True, acked=(2, -1), holders=("", ""), **ahead) == "draining"
    assert training_state(done=True, acked=(5, 4), holders=("", ""), **ahead) == "finished"
    assert training_state(done=False, acked=(-1, -1), error=None, published_through=-1,
                          final_steps=None) == "waiting"
    idle = tuple(RankStatus(r, -1, "", replica=RankOnReplica(False, -1)) for r in (0, 1))
    job = dataclasses.replace(TRAINING, state="waiting for ranks", error=None, ranks=idle,
                              published_through=-1, coordinator=None)
    text = render(StatusReport(generated_at=0.0, sources={}, jobs=(job,)))
    assert "state=waiting for ranks" in text and "published_through=-" in text
    assert "-1" not in text, text


def test_answers_merge_field_by_field_in_order_of_authority() -> None:
    grpc_part = from_proto(to_proto(TRAINING))
    http_part = dataclasses.replace(TRAINING, coordinator=None, exposure=None, error=None,
                                    replica=ReplicaStatus("other", 3.0))
    redis_part = JobStatus(job_id="sft", mode="join", state="running", coordinator=
                           TRAINING.coordinator, exposure=TRAINING.exposure,
                           ranks=(RankStatus(2, 5, "gone", heartbeat_age_s=9.0),))
    got = merge([grpc_part, http_part, redis_part])
    assert got.error == "boom"  # GetJob's
    assert got.replica == ReplicaStatus("host:1:ab", 3.0)  # its id, the uptime it lacks
    assert got.totals == TRAINING.totals and got.coordinator == TRAINING.coordinator
    assert [r.rank for r in got.ranks] == [0, 1, 2]
    assert got.ranks[0] == RANKS[0]  # GetJob's position, the metrics port's figures
    assert got.ranks[2].heartbeat_age_s == 9.0 and got.ranks[2].replica is None
    assert got.quarantine.records == TRAINING.quarantine.records
    later = dataclasses.replace(TRAINING, totals=Totals(9, 90, 2000, 100, 2300), ranks=(
        dataclasses.replace(RANKS[0], acked_step=9), RANKS[1]))
    t = with_interval_rates(later, TRAINING, 2.0).throughput
    assert (t.basis, t.samples_per_s, t.batches_per_s, t.steps_per_s) == ("interval", 10.0,
                                                                          1.0, 1.0)
    rf = dataclasses.replace(REFILL.refill, admitted=93, completed=80)
    r = with_interval_rates(dataclasses.replace(REFILL, refill=rf), REFILL, 5.0).refill.rates
    assert (r.basis, r.admissions_per_s, r.completions_per_s) == ("interval", 2.0, 1.0)


def test_a_served_jobs_getjob_answer_is_the_replicas_own_status() -> None:
    with served() as (svc, _), ranks_stopped_at_known_steps(svc) as (_, acked, delivered):
        rt = svc.runtimes[JOB]
        wait_for(lambda: [rt.state.acked(i) for i in range(2)] == acked
                 and [rt.ranks[i].delivered for i in range(2)] == delivered,
                 what="acks and deliveries")
        with grpc.insecure_channel(svc.address) as ch:
            reply = pb_grpc.DataServiceStub(ch).GetJob(pb.GetJobRequest(job_id=JOB), timeout=10)
        mine = ServiceView.of(svc).job_status(JOB)
    got = from_proto(reply)
    assert [(r.acked_step, r.replica.connected, r.replica.delivered_step) for r in got.ranks] \
        == [(a, True, d) for a, d in zip(acked, delivered, strict=True)]
    for field in ("job_id", "mode", "world_size", "epochs", "done", "samples_in",
                  "lapsed_ranks", "epoch_ends", "open"):
        assert getattr(got, field) == getattr(mine, field), field
    assert got.published_through <= mine.published_through  # the plan only grows
    assert [r.acked_step for r in got.ranks] == [r.acked_step for r in mine.ranks]


def test_a_producer_retrying_is_trouble_not_a_failure() -> None:
    from pipeline.jobstate.memory import MemoryJobState
    from pipeline.observability.status_view import training_job_status

    st = MemoryJobState("j", 2, "join")
    gen = st.claim_producer("p", 60)
    st.set_error("source gone a while", fence=gen, cause="source_unreadable", transient=True)
    job = training_job_status("j", st)
    assert (job.state, job.error) == ("waiting", None)
    assert (job.producer_trouble.message, job.producer_trouble.cause) == (
        "source gone a while", "source_unreadable")
    st.set_error("no such file", fence=gen, cause="source_missing")
    job = training_job_status("j", st)
    assert (job.state, job.error, job.producer_trouble) == ("failed", "no such file", None)


def test_a_job_with_global_steps_shows_its_budgets_and_micro_batches() -> None:
    """docs/global-steps.md: both budgets and the micro-batches consumed, in every rendering
    that carries them (JSON and back; the text report)."""
    from pipeline.status.report import StatusReport
    from pipeline.status.text import render

    job = dataclasses.replace(TRAINING, global_token_budget=8192)
    assert job_from_dict(json.loads(json.dumps(job_to_dict(job)))) == job
    text = render(StatusReport(0.0, {}, (job,)))
    assert ("token budget 1024 per micro-batch, global token budget 8192 per step; 7 "
            "micro-batches consumed") in text
    assert "per micro-batch" not in render(StatusReport(0.0, {}, (TRAINING,)))
