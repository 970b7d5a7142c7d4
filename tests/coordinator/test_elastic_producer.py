"""A real producer (thread, ArrayFeed, RedisJobState) follows a reconfiguration: it notices the
new world (a refused publish or its back-pressure poll), re-plans from its checkpoint with the
returned batches, publishes for the new world at once, and the epoch stays exactly once across
both worlds. Ranks are driven by hand through the state (grant, read, ack), as a replica does,
so every number can be checked against the plan."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
from support.reference_plan import reference_steps
from support.waiting import wait_for

from pipeline.config import TrainingJobConfig
from pipeline.coordinator import RedisJobState
from pipeline.coordinator.registry import config_hash
from pipeline.jobstate import ScaleRequest
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.local_feed import LocalFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings

N = 240
SETTINGS = ProducerSettings(lease_seconds=5.0, max_ahead=4, poll_seconds=0.01)


def job(job_id: str, world_size: int = 3) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({
        "job_id": job_id, "world_size": world_size, "seed": 5, "source": {"paths": ["arrays"]},
        "batching": {"token_budget": 1024, "max_window_samples": 32, "pool_steps": 2}})


class Run:
    """A producer thread for `cfg` over the state in Redis."""

    def __init__(self, cfg: TrainingJobConfig, url: str, samples, holder: str) -> None:
        self.state = RedisJobState.connect(url, cfg)
        self.producer = Producer(cfg, self.state, ArrayFeed(ArraySource(samples), "padded"),
                                 holder=holder, settings=SETTINGS)
        self.thread = threading.Thread(target=self.producer.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.producer.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


def consume(st: RedisJobState, gen: int, rank: int, upto: int | None, got: list) -> int:
    """Take rank's batches of world `gen` in order, as a replica does (grant before sending),
    through `upto` or until its world ends; returns the last step taken."""
    pos = got[-1][0] + 1 if got else st.worlds()[gen].first_step
    while upto is None or pos <= upto:
        (g,) = st.grant([(gen, rank, pos)])
        if g.ended:
            limit = g.through
            while pos <= limit:
                step = st.get_step(pos)
                if step.batch_for(rank) is not None:
                    got.append((pos, step.batch_for(rank)))
                pos += 1
            return limit
        if g.through < pos:
            if st.is_done() and pos > st.published_through():
                return pos - 1
            time.sleep(0.005)
            continue
        step = st.get_step(pos)
        b = step.batch_for(rank)
        if b is not None:
            got.append((pos, b))
            if gen == st.head().generation:
                st.ack(rank, pos)
        pos += 1
    return pos - 1


def _quiet(st: RedisJobState, seconds: float = 0.3) -> bool:
    """The plan did not move for `seconds`."""
    through = st.published_through()
    time.sleep(seconds)
    return st.published_through() == through


def _ids(batches) -> Counter:
    return Counter(s.sample_id for _, b in batches for s in b.samples)


@pytest.fixture
def url(redis_client, redis_url):
    return redis_url


def test_three_to_two_mid_epoch_exactly_once(url):
    samples = synthetic_samples(N, max_len=400, seed=2)
    cfg = job("p32")
    run = Run(cfg, url, samples, "p-a")
    st = run.state
    try:
        old: dict[int, list] = {r: [] for r in range(3)}
        for r in range(3):
            st.claim_rank(r, f"old{r}", 30)
        upto = {0: 3, 1: 5, 2: 4}
        for pos in range(6):  # step by step: the producer stays max_ahead past the slowest ack
            for r in range(3):
                if pos <= upto[r]:
                    consume(st, 0, r, pos, old[r])
        res = st.scale(ScaleRequest(2))
        prev = res.previous
        assert prev.last_steps == (5, 5, 5) and res.world.first_step == prev.published_through + 1
        wait_for(lambda: st.world_timings(1).adopted_at is not None, 10, "the producer adopts")
        for r in range(3):  # the old world drains to its boundary
            assert consume(st, 0, r, None, old[r]) == 5
            st.rank_left(0, r, f"old{r}")
        new: dict[int, list] = {0: [], 1: []}
        threads = [threading.Thread(target=consume, args=(st, 1, r, None, new[r]))
                   for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wait_for(lambda: run.producer.outcome is not None, 30, "the producer to finish")
        assert run.producer.outcome is Outcome.DONE
        kept = [x for r in old.values() for x in r]
        assert all(n <= prev.last_steps[0] for n, _ in kept)
        fresh = [x for r in new.values() for x in r]
        steps = sorted({n for n, _ in fresh})
        assert steps[0] == res.world.first_step
        assert steps == list(range(steps[0], steps[-1] + 1))  # contiguous, numbered on
        for n in steps:  # aligned for 2 ranks; totals exact for what the new world runs
            step = st.get_step(n)
            assert {b.rank for b in step.batches} <= {0, 1}
            assert step.info.step_samples == sum(len(b.samples) for b in step.batches)
            if n != steps[-1]:
                assert len(step.batches) == 2
        got = _ids(kept) + _ids(fresh)
        assert got == Counter(s.sample_id for s in samples)  # the epoch exactly once
        c = st.counters()
        assert c.samples_planned == N and c.samples_in == N
    finally:
        run.stop()


def test_a_producer_started_after_the_switch_adopts_identically(url):
    """The plan of the new world depends only on the checkpoint and the boundary: the producer
    that saw the switch live and one started after it (its predecessor stopped first) publish the
    same steps."""
    samples = synthetic_samples(N, max_len=400, seed=4)
    plans = []
    for live in (True, False):
        cfg = job(f"adopt-{live}")
        run = Run(cfg, url, samples, "p-1")
        st = run.state
        try:
            for r in range(3):
                st.claim_rank(r, f"c{r}", 30)
                consume(st, 0, r, 3, [])
            # Back-pressure holds the producer at a point set by the acks alone.
            wait_for(lambda st=st: st.published_through() > 3, 10, "the first steps")
            wait_for(lambda st=st: _quiet(st), 10, "back-pressure to hold the producer")
            p = st.published_through()
            if not live:
                run.stop()
            st.scale(ScaleRequest(2))
            if not live:
                run = Run(cfg, url, samples, "p-2")
            wait_for(lambda st=st: st.world_timings(1).adopted_at is not None, 10, "adoption")
            for r in range(3):
                st.rank_left(0, r, f"c{r}")
            for r in (0, 1):
                consume(st, 1, r, p + 5, [])
            wait_for(lambda st=st, p=p: st.published_through() >= p + 5, 10,
                     "the new world's steps")
            plans.append((p, [st.get_step(n) for n in range(p + 1, p + 6)]))
            if not live:
                assert st.producer_lease().holder == "p-2"
        finally:
            run.stop()
    assert plans[0] == plans[1]
    assert all(len(s.batches) == 2 for s in plans[0][1])


def test_a_registered_world_size_still_resumes_after_a_switch(url):
    """A replica (re)started with the job's config after a reconfiguration registers with the
    config's world size; it resumes the job (the current world is the state's)."""
    cfg = job("resume-after")
    st = RedisJobState.connect(url, cfg)
    gen = st.claim_producer("x", 30)
    st.release_producer(gen)
    st.scale(ScaleRequest(5))
    again = RedisJobState(url, "resume-after", config_hash=config_hash(cfg), world_size=3)
    assert again.world_size == 5 and again.head().generation == 1



def _chats(path, tag: str, rows: int) -> str:
    lines = [json.dumps({"messages": [
        {"role": "user", "content": f"{tag} {i}: " + "why " * (1 + i % 7)},
        {"role": "assistant", "content": f"{tag} answer {i} " + "word " * (3 + (i * 37) % 90)}]})
        for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _by_optimizer_step(steps) -> dict[int, Counter]:
    """optimizer step -> the samples it trains (fillers are not samples)."""
    out: dict[int, Counter] = {}
    for step in steps:
        out.setdefault(step.info.optimizer_step, Counter()).update(
            str(s.sample_id) for b in step.batches if not b.filler for s in b.samples)
    return out


def test_a_shuffled_mixture_trains_the_same_global_steps_across_two_one_two(url, tmp_path):
    """Guarantee 11 across an elastic 2 -> 1 -> 2 (the order never depends on the world): a
    mixture read from files (shuffled, one source repeated: the bootstrap producer's feed),
    global steps; every optimizer step the ranks ran holds the samples it holds in the job's
    plan on a fresh state without a switch, and ran once (each switch re-plans the returned
    steps from the checkpoint, the order's cursor included)."""
    a, b = _chats(tmp_path / "a.jsonl", "a", 300), _chats(tmp_path / "b.jsonl", "b", 150)
    cfg = TrainingJobConfig.model_validate({
        "job_id": "o212", "world_size": 2, "seed": 7,
        "batching": {"token_budget": 1024, "global_token_budget": 2048,
                     "lookahead_tokens": 4096},
        "source": {"mixture": [{"name": "a", "paths": [a]},
                               {"name": "b", "paths": [b], "repeat": 2}]}})
    want = _by_optimizer_step(reference_steps(cfg))
    st = RedisJobState.connect(url, cfg)
    producer = Producer(cfg, st, LocalFeed(cfg), holder="p", settings=SETTINGS)
    thread = threading.Thread(target=producer.run, daemon=True)
    thread.start()
    try:
        ran: list[int] = []  # the steps served, each rank's
        gen, ranks, first = 0, (0, 1), 0
        for size in (1, 2, None):
            got: dict[int, list] = {r: [] for r in ranks}
            for r in ranks:
                st.claim_rank(r, f"g{gen}r{r}", 30)
            for pos in range(first, first + 3):  # a few steps into each world
                for r in ranks:
                    consume(st, gen, r, pos, got[r])
            if size is not None:
                res = st.scale(ScaleRequest(size))
                wait_for(lambda g=gen + 1: st.world_timings(g).adopted_at is not None, 10,
                         "the producer adopts")
            for r in ranks:  # the world drains to its boundary (the last: to the epoch's end)
                consume(st, gen, r, None, got[r])
                st.rank_left(gen, r, f"g{gen}r{r}")
            ran += sorted({n for r in ranks for n, _ in got[r]})
            if size is not None:
                gen, ranks, first = gen + 1, tuple(range(size)), res.world.first_step
        wait_for(lambda: producer.outcome is not None, 30, "the producer to finish")
        assert producer.outcome is Outcome.DONE
        worlds = st.worlds()
        assert [w.world_size for w in worlds] == [2, 1, 2]
        assert 0 < worlds[1].first_step < worlds[2].first_step <= max(ran)  # mid-epoch
        served = [st.get_step(n) for n in ran]
        assert sorted(s.info.optimizer_step for s in served) == sorted(want)  # each once
        assert _by_optimizer_step(served) == want
    finally:
        producer.stop()
        thread.join(10)
