"""The plan in Redis under contention: fenced producers racing from several processes, readers
racing a publisher, and a large world (the contract itself: tests/jobstate/)."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time

from jobstate.builders import make_step, publication

from pipeline.coordinator import RedisJobState
from pipeline.coordinator.step_codec import decode_checkpoint
from pipeline.errors import Fenced
from pipeline.jobstate import RankAck

N_STEPS = 60


def _racing_producer(url: str, holder: str, salt: str, seed: int, start, out) -> None:
    """A producer that never renews its 20 ms lease: it publishes its own plan in random
    chunks, continuing the plan it reads after claiming, while its lease lasts; when fenced it
    claims again (the same holder takes over at once, another one waits for the lapse).
    Publishes are recorded with their generation."""
    rng = random.Random(seed)
    st = RedisJobState(url, "race", config_hash="cfg-1", world_size=4)
    won, refused, gen = [], {}, None
    start.wait()
    while True:
        through = st.published_through()
        if through >= N_STEPS - 1:
            break
        if gen is None:
            gen = st.claim_producer(holder, 0.02)
            if gen is None:
                time.sleep(0.002)
            continue  # read where the plan stands only once holding the lease
        k = min(N_STEPS - through - 1, rng.randint(1, 4))
        chunk = [make_step(n, salt=salt) for n in range(through + 1, through + 1 + k)]
        try:
            st.publish(publication(chunk, rows=through + 1 + k), fence=gen)
            won.append((through + 1, k, gen))
            time.sleep(0.003)  # planning the next chunk
        except Fenced:
            gen = None
        except Exception as exc:  # anything else is a failure of fencing: report it
            name = type(exc).__name__
            refused[name] = refused.get(name, 0) + 1
    st.close()
    out.put((salt, won, refused))


def test_racing_producer_processes_publish_one_plan_in_generation_order(new_state, redis_url):
    """3 processes (two share a holder id: a restarted actor racing its zombie) race for the
    lease and publish their own plans. Fencing serializes them: no publish ever meets a
    conflict, a gap or a checkpoint out of order; each step is one process's, published by
    one generation, and generations only grow along the plan."""
    st = new_state(job_id="race")
    ctx = mp.get_context("fork")
    out, start = ctx.Queue(), ctx.Barrier(3)
    procs = [ctx.Process(target=_racing_producer, args=(redis_url, holder, salt, i, start, out))
             for i, (holder, salt) in enumerate((("a", "a1"), ("a", "a2"), ("b", "b")))]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(10)
    owner: dict[int, tuple[str, int]] = {}
    for salt, won, refused in results:
        assert refused == {}, f"{salt}: fenced producers must never meet {refused}"
        for first, k, gen in won:
            for n in range(first, first + k):
                assert n not in owner, f"step {n} published by {owner[n]} and {salt}"
                owner[n] = (salt, gen)
    assert sorted(owner) == list(range(N_STEPS))
    gens = [owner[n][1] for n in range(N_STEPS)]
    assert gens == sorted(gens)
    assert len({owner[n][0] for n in range(N_STEPS)}) >= 2  # it really was a race
    for n in range(N_STEPS):
        assert st.get_step(n) == make_step(n, salt=owner[n][0])
    assert st.load_checkpoint().next_step == N_STEPS == st.published_through() + 1


def test_readers_never_see_steps_without_their_checkpoint(new_state):
    """published_through and the checkpoint are written by one script: a reader never sees one
    without the other."""
    st = new_state(job_id="ck")
    gen = st.claim_producer("p", 60)
    stop = threading.Event()
    bad: list[tuple] = []

    def reader() -> None:
        while not stop.is_set():
            pipe = st.client.pipeline(transaction=True)
            pipe.hget(st.keys.meta, "published_through")
            pipe.get(st.keys.checkpoint)
            through, raw = pipe.execute()
            if raw is not None and decode_checkpoint(raw).next_step != int(through) + 1:
                bad.append((through, raw))

    th = threading.Thread(target=reader)
    th.start()
    try:
        for n in range(0, 120, 3):
            st.publish(publication([make_step(n), make_step(n + 1), make_step(n + 2)]),
                       fence=gen)
    finally:
        stop.set()
        th.join()
    assert bad == []


def test_a_large_world(new_state):
    """W = 3000: registration, a 3000-batch step (HSET chunks inside Lua), a replica's rank
    subset in one HMGET, 3000 acks in one call, every rank's health in one script."""
    w = 3000
    st = new_state(world_size=w)
    gen = st.claim_producer("p", 60)
    s0, s1 = make_step(0, w, per_rank=1), make_step(1, w, per_rank=1)
    assert st.publish(publication([s0, s1]), fence=gen) == 2
    assert st.get_step(0) == s0
    part = st.get_step_for(1, [2999, 5, 1500])
    assert [b.rank for b in part.batches] == [5, 1500, 2999] and part.info == s1.info
    assert part.batch_for(2999) == s1.batch_for(2999)
    st.grant([(0, r, 1) for r in range(w)])
    assert st.ack_many([RankAck(r, f"c{r}", r % 2) for r in range(w)], 60) == [None] * w
    assert st.acked_all() == [r % 2 for r in range(w)]
    health = st.rank_health()
    assert len(health) == w and health[2999].acked == 1 and health[0].client_id == "c0"
