"""The one table from the domain's errors to gRPC status codes (`data_server.STATUS_OF`): each
error the service raises on purpose has its precise code; the most specific class wins; an
error the table does not name is UNKNOWN, never a guess."""

from __future__ import annotations

import grpc
import pytest

from pipeline import errors
from pipeline.jobstate.interface import ProducerFailure
from pipeline.service.data_server import STATUS_OF, status_of
from pipeline.service.rank_stream import producer_failed

C = grpc.StatusCode


@pytest.mark.parametrize(("error", "code"), [
    (errors.BadRequest, C.INVALID_ARGUMENT),
    (errors.AckAheadOfPlan, C.INVALID_ARGUMENT),
    (errors.AckNotDelivered, C.INVALID_ARGUMENT),
    (errors.PositionUnavailable, C.OUT_OF_RANGE),
    (errors.UnknownJob, C.NOT_FOUND),
    (errors.Unauthenticated, C.UNAUTHENTICATED),
    (errors.WrongJobMode, C.FAILED_PRECONDITION),
    (errors.WireMismatch, C.FAILED_PRECONDITION),
    (errors.RankHeld, C.FAILED_PRECONDITION),
    (errors.ScaleInProgress, C.FAILED_PRECONDITION),
    (errors.PlanningComplete, C.FAILED_PRECONDITION),
    (errors.RanksLive, C.FAILED_PRECONDITION),
    (errors.RankTimedOut, C.ABORTED),
    (errors.ProducerFailed, C.INTERNAL),
    (errors.ProducerMisconfigured, C.FAILED_PRECONDITION),
    (errors.ProducerUnavailable, C.UNAVAILABLE),
    (errors.ReplicaUnavailable, C.UNAVAILABLE),
    (errors.StateUnavailable, C.UNAVAILABLE),
])
def test_each_domain_error_has_its_code(error, code):
    assert status_of(error("why")) == code


def test_anything_else_is_unknown_and_the_table_holds_only_domain_errors():
    assert status_of(ValueError("x")) == C.UNKNOWN
    assert status_of(errors.StepConflict("x")) == C.UNKNOWN  # a producer's error, not a call's
    assert all(issubclass(cls, errors.OdbError) for cls in STATUS_OF)


@pytest.mark.parametrize(("cause", "code"), [
    ("source_missing", C.FAILED_PRECONDITION), ("source_forbidden", C.FAILED_PRECONDITION),
    ("config", C.FAILED_PRECONDITION), ("plan_conflict", C.FAILED_PRECONDITION),
    ("state_unavailable", C.UNAVAILABLE), ("not_durable", C.UNAVAILABLE),
    ("state_rolled_back", C.UNAVAILABLE), ("ray_unavailable", C.UNAVAILABLE),
    ("source_unreadable", C.UNAVAILABLE), ("internal", C.INTERNAL), ("unheard-of", C.INTERNAL),
])
def test_a_producers_failure_ends_streams_with_the_code_of_its_cause(cause, code):
    failure = ProducerFailure("boom", cause, permanent=True, since=0.0)
    err = producer_failed("j", failure)
    assert status_of(err) == code and str(err) == "job 'j' producer failed: boom"
