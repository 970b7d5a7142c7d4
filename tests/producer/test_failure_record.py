"""The producer-failure part of the `JobState` contract, on every implementation: a transient
failure is trouble (not an error: streams wait), counted per streak and cleared by the next
publication; a permanent one is the job's error until a replica's start clears it; both are
fenced like a publish."""

from __future__ import annotations

import pytest
from jobstate.builders import publication, steps
from jobstate.conftest import LONG

from pipeline.errors import Fenced


def test_a_transient_failure_is_trouble_until_the_next_publication(env):
    st = env.state
    gen = env.producer()
    st.set_error("source_unreadable: OSError: EIO", fence=gen, cause="source_unreadable",
                 transient=True)
    first = st.producer_failure()
    assert st.error() is None  # not an error: streams keep waiting
    assert (first.message, first.cause, first.permanent, first.attempts) == (
        "source_unreadable: OSError: EIO", "source_unreadable", False, 1)
    env.sleep(0.02)
    st.set_error("ray_unavailable: ObjectLostError", fence=gen, cause="ray_unavailable",
                 transient=True)
    again = st.producer_failure()
    assert (again.cause, again.attempts, again.since) == ("ray_unavailable", 2, first.since)
    st.publish(publication(steps(0, 1)), fence=gen)
    assert st.producer_failure() is None and st.error() is None


def test_a_permanent_failure_replaces_trouble_and_stays_until_cleared(env):
    st = env.state
    gen = env.producer()
    st.set_error("flaky", fence=gen, cause="source_unreadable", transient=True)
    st.set_error("job 'x': source not found", fence=gen, cause="source_missing")
    f = st.producer_failure()
    assert (f.message, f.cause, f.permanent) == ("job 'x': source not found", "source_missing",
                                                 True)
    assert st.error() == "job 'x': source not found"
    st.set_error("later trouble", fence=gen, cause="state_unavailable", transient=True)
    assert st.producer_failure().permanent  # the permanent one wins
    cleared = st.clear_error()
    assert cleared is not None and cleared.cause == "source_missing" and cleared.permanent
    assert st.error() is None
    left = st.producer_failure()  # what was transient stays until a publication
    assert left is not None and not left.permanent
    assert st.clear_error() is None  # nothing permanent left: nothing cleared


def test_failures_are_fenced_like_a_publish(env):
    st = env.state
    with pytest.raises(Fenced):
        st.set_error("nobody holds the lease", fence=0, transient=True)
    gen = env.producer(lease_seconds=0.2)
    env.sleep(0.3)
    with pytest.raises(Fenced):  # an expired lease records nothing either
        st.set_error("late", fence=gen, cause="internal")
    new = st.claim_producer("successor", LONG)
    with pytest.raises(Fenced):
        st.set_error("zombie", fence=gen, transient=True)
    assert st.producer_failure() is None
    st.set_error("mine", fence=new, cause="config")
    assert st.error() == "mine"
