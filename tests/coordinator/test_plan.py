"""The plan is write-once: racing publishers, republish, gaps, atomic steps + checkpoint."""

from __future__ import annotations

import threading

import pytest
from pipeline.service.job_state import PlannerCheckpoint, StepConflict

from pipeline.coordinator import CheckpointConflict, RedisJobState, StepGap
from pipeline.planner.types import EpochEnd, MeasuredSample

from .helpers import make_step


def test_publish_get_and_identical_republish_is_noop(new_state):
    st = new_state()
    assert st.published_through() == -1 and st.get_step(0) is None
    s0, s1 = make_step(0), make_step(1)
    assert st.publish_steps([s0, s1]) == 2
    assert st.get_step(0) == s0 and st.get_step(1) == s1
    assert st.publish_steps([s0, s1]) == 0  # no-op
    st.publish_step(s1)
    assert st.published_through() == 1
    part = st.get_step_for(1, [2, 0, 9 % 4])
    assert [b.rank for b in part.batches] == [0, 1, 2] and part.info == s1.info
    assert part.batch_for(2) == s1.batch_for(2)


def test_different_content_for_same_step_is_conflict(new_state):
    st = new_state()
    st.publish_step(make_step(0))
    with pytest.raises(StepConflict, match="step 0"):
        st.publish_step(make_step(0, salt="x"))
    # Even a change in info only, or a rank's batch moved, conflicts.
    s = make_step(0)
    with pytest.raises(StepConflict):
        st.publish_step(type(s)(s.epoch, 0, s.batches, type(s.info)(1, 1)))
    with pytest.raises(StepConflict):
        st.publish_step(make_step(0, ranks=[0, 1, 2]))
    assert st.get_step(0) == make_step(0)


def test_gap_refused(new_state):
    st = new_state()
    with pytest.raises(StepGap):
        st.publish_step(make_step(1))
    st.publish_step(make_step(0))
    with pytest.raises(StepGap):
        st.publish_step(make_step(2))
    assert st.published_through() == 0


def test_batch_publish_is_all_or_nothing(new_state):
    st = new_state()
    st.publish_steps([make_step(0), make_step(1)])
    ck = PlannerCheckpoint(0, 10, 2)
    st.save_checkpoint(ck)
    # step 2 and 3 are new, but step 1 conflicts: nothing of the call may land.
    with pytest.raises(StepConflict):
        st.publish_steps([make_step(2), make_step(1, salt="y"), make_step(3)],
                         PlannerCheckpoint(0, 20, 4), [EpochEnd(0, (3, 3, 3, 3), 4)])
    assert st.published_through() == 1 and st.get_step(2) is None
    assert st.load_checkpoint() == ck and st.epoch_ends() == []
    # Same step twice in one call with different content.
    with pytest.raises(StepConflict):
        st.publish_steps([make_step(2), make_step(2, salt="z")])
    assert st.published_through() == 1


def test_racing_publishers_exactly_one_plan_per_step(new_state, redis_url):
    """8 threads (own clients) race to publish steps 0..29, each its own plan: per step one wins."""
    st0 = new_state(job_id="race")
    n_threads, n_steps = 8, 30
    wins = [[] for _ in range(n_steps)]
    conflicts = [0] * n_threads
    barrier = threading.Barrier(n_threads)

    def publisher(t: int) -> None:
        st = RedisJobState(redis_url, "race", config_hash="cfg-1", world_size=4)
        barrier.wait()
        for n in range(n_steps):
            try:
                if st.publish_steps([make_step(n, salt=str(t))]) == 1:
                    wins[n].append(t)
            except StepConflict:
                conflicts[t] += 1
            except StepGap:  # another thread has not published n-1 yet: impossible here
                raise
        st.close()

    threads = [threading.Thread(target=publisher, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(len(w) == 1 for w in wins), wins
    assert sum(conflicts) == n_steps * (n_threads - 1)
    for n in range(n_steps):
        assert st0.get_step(n) == make_step(n, salt=str(wins[n][0]))
    assert st0.published_through() == n_steps - 1


def test_checkpoint_rules(new_state):
    st = new_state()
    assert st.load_checkpoint() is None
    with pytest.raises(CheckpointConflict, match="not published"):
        st.save_checkpoint(PlannerCheckpoint(0, 5, 1))  # step 0 is not published
    st.publish_steps([make_step(0), make_step(1)], PlannerCheckpoint(0, 8, 2, b'{"buf":[1]}'))
    assert st.load_checkpoint() == PlannerCheckpoint(0, 8, 2, b'{"buf":[1]}')
    with pytest.raises(CheckpointConflict, match="backwards"):
        st.save_checkpoint(PlannerCheckpoint(0, 4, 1))
    st.save_checkpoint(PlannerCheckpoint(1, 0, 2))  # epoch transition at the same step
    assert st.load_checkpoint().epoch == 1


def test_checkpoint_always_matches_published_steps_under_concurrent_reads(new_state):
    """A reader never sees steps without their checkpoint or the other way round."""
    st = new_state(job_id="ck")
    stop = threading.Event()
    bad: list[tuple] = []

    def reader() -> None:
        while not stop.is_set():
            pipe = st.client.pipeline(transaction=True)
            pipe.hget(st.keys.meta, "published_through")
            pipe.get(st.keys.checkpoint)
            pt, raw = pipe.execute()
            if raw is not None:
                from pipeline.coordinator.step_codec import decode_checkpoint

                ck = decode_checkpoint(raw)
                if ck.next_step != int(pt) + 1:
                    bad.append((pt, ck))

    th = threading.Thread(target=reader)
    th.start()
    for n in range(0, 120, 3):
        st.publish_steps([make_step(n), make_step(n + 1), make_step(n + 2)],
                         PlannerCheckpoint(0, n * 8 + 24, n + 3))
    stop.set()
    th.join()
    assert bad == []


def test_epoch_ends_write_once_and_carry_over(new_state):
    st = new_state(mode="quota")
    st.publish_steps([make_step(0), make_step(1)])
    carried = (MeasuredSample("a:9", 40), MeasuredSample(17, 3, 2))
    end0 = EpochEnd(0, (1, 1, 1, 1), 2, carried)
    st.publish_steps([make_step(2, epoch=1)], PlannerCheckpoint(1, 0, 3, b"carried"), [end0])
    assert st.epoch_ends() == [end0] and st.carried_over(0) == carried
    assert st.epoch() == 1
    st.publish_epoch_end(end0)  # identical: no-op
    with pytest.raises(StepConflict, match="epoch 0"):
        st.publish_epoch_end(EpochEnd(0, (1, 1, 1, 0), 2))
    st.publish_epoch_end(EpochEnd(1, (2, 2, 2, 2), 1))
    assert [e.epoch for e in st.epoch_ends()] == [0, 1]


def test_done_refuses_new_steps(new_state):
    st = new_state()
    st.publish_step(make_step(0))
    assert not st.is_done()
    st.mark_done()
    assert st.is_done()
    st.publish_step(make_step(0))  # republish still fine
    with pytest.raises(StepConflict, match="done"):
        st.publish_step(make_step(1))


def test_large_world_size_step(new_state):
    """W = 3000 batches in one step (HSET chunking inside Lua, rank subsets via one HMGET)."""
    st = new_state(world_size=3000)
    s = make_step(0, world_size=3000, per_rank=1)
    st.publish_step(s)
    assert st.get_step(0) == s
    assert st.get_step_for(0, [2999, 5]).batch_for(2999) == s.batch_for(2999)


def _replica_publisher(url: str, salt: str, n_steps: int, seed: int, out) -> None:
    """A planner replica: publishes its own plan in random-size chunks with checkpoints; on a
    conflict it adopts what is published (as a restarted planner would) and goes on."""
    import random

    rng = random.Random(seed)
    st = RedisJobState(url, "procs", config_hash="cfg-1", world_size=4)
    won, n = [], 0
    while n < n_steps:
        k = min(n_steps - n, rng.randint(1, 4))
        try:
            if st.publish_steps([make_step(i, salt=salt) for i in range(n, n + k)],
                                PlannerCheckpoint(0, n + k, n + k)):
                won.append((n, k))
        except (StepConflict, StepGap, CheckpointConflict):
            pass
        n = st.published_through() + 1
    out.put((salt, won))


def test_racing_replica_processes_never_mix_plans(new_state, redis_url):
    """3 processes publish different plans in random chunks: every step is one process's, each
    call was all-or-nothing, and the checkpoint matches the published steps."""
    import multiprocessing as mp

    st = new_state(job_id="procs")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica_publisher, args=(redis_url, s, 60, i, out))
             for i, s in enumerate("abc")]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    owner = {}
    for salt, won in results.items():
        for first, k in won:
            for i in range(first, first + k):
                assert i not in owner, f"step {i} claimed by {owner[i]} and {salt}"
                owner[i] = salt
    assert sorted(owner) == list(range(60))
    for i in range(60):
        assert st.get_step(i) == make_step(i, salt=owner[i])
    assert st.load_checkpoint().next_step == 60 == st.published_through() + 1
