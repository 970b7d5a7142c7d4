"""Where a job's producer runs: whether the job needs one is judged on the state's clock (the
clock every lease runs on), never on this replica's (issue #40 item 11)."""

from __future__ import annotations

import time

import pytest
from jobstate.conftest import LAPSE, SHORT, ManualClock

from pipeline.jobstate import MemoryJobState
from pipeline.producer.hosting import needs_producer


def test_a_job_needs_a_producer_once_its_lease_lapsed_on_the_state_clock(env):
    st = env.state
    assert needs_producer(st)  # never claimed
    gen = st.claim_producer("a", SHORT)
    assert st.producer_lease().live and not needs_producer(st)
    env.sleep(LAPSE)
    assert not st.producer_lease().live and needs_producer(st)
    st.renew_producer(gen, 60.0)
    assert not needs_producer(st)
    st.release_producer(gen)
    assert not st.producer_lease().live and needs_producer(st)


@pytest.mark.parametrize("skew", [-3600.0, 3600.0])
def test_a_replica_whose_clock_is_off_judges_the_lease_as_the_state_does(skew):
    """The state's clock an hour behind this machine's (a healthy producer would be restarted
    every few seconds) or ahead of it (a dead one never replaced)."""
    clock = ManualClock(time.time() + skew)
    st = MemoryJobState("skewed", 1, clock=clock)
    st.claim_producer("a", 10.0)
    assert not needs_producer(st)
    clock.sleep(10.5)
    assert needs_producer(st)
