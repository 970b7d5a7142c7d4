"""A fully planned job whose producer already finished gets a producer again to adopt a new
world (docs/elastic.md, "A fully planned job"): the replica's thread host runs a new producer
once the switch reopens the job; it re-plans the last epoch's returned batches for the new
world and closes the epoch again. Ranks are driven by hand through the state, as a replica
does, so every number can be checked: the epoch exactly once across both worlds, aligned, the
new END naming the new world; and the same plan whether the host saw the switch live or a
replica started after it."""

from __future__ import annotations

from collections import Counter

from support.waiting import wait_for

from pipeline.coordinator import RedisJobState
from pipeline.jobstate import ScaleReason, ScaleRequest
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.hosting import ThreadHost
from pipeline.producer.producer import ProducerSettings

from .test_elastic_producer import consume, job

N = 120
SETTINGS = ProducerSettings(lease_seconds=5.0, max_ahead=10**6, poll_seconds=0.01,
                            linger_seconds=0.0)


def _host(cfg, st, samples, name: str) -> ThreadHost:
    host = ThreadHost(cfg, st, ArrayFeed(ArraySource(samples), "padded"), holder=name,
                      settings=SETTINGS, check_seconds=0.05)
    host.start()
    return host


def test_a_finished_job_is_reopened_and_re_planned_exactly_once(redis_client, redis_url):
    plans = [_reopen(redis_url, live) for live in (True, False)]
    assert plans[0] == plans[1]  # the live host and a replica started later adopt identically


def _reopen(redis_url: str, live: bool) -> list:
    """Plan, switch, re-plan and consume the job; the new world's steps."""
    samples = synthetic_samples(N, max_len=400, seed=7)
    cfg = job(f"reopen-{live}")
    st = RedisJobState.connect(redis_url, cfg)
    host = _host(cfg, st, samples, "replica-a")
    hosts = [host]
    try:
        wait_for(st.is_done, 30, "the job to be fully planned")
        final = st.epoch_ends()[-1]
        assert final.last_step >= 6, "the test needs a longer epoch"
        old: dict[int, list] = {0: [], 1: [], 2: []}
        for r in (0, 2):
            st.claim_rank(r, f"old{r}", 30)
            consume(st, 0, r, 2, old[r])
        consume(st, 0, 1, 1, old[1])  # rank 1 took two steps and died (it never held a lease)
        if not live:
            host.stop()  # its replica is gone; another one starts after the switch
        res = st.scale(ScaleRequest(2, ScaleReason.SHRINK))
        prev = res.previous
        assert prev.last_steps == (2, 1, 2) and not st.is_done()
        assert st.epoch_ends() == []  # the final END is void: the epoch goes on in world 1
        if not live:
            hosts.append(_host(cfg, st, samples, "replica-b"))
        wait_for(lambda: st.world_timings(1).adopted_at is not None, 30, "the adoption")
        for r in (0, 2):  # the live ranks drain to B
            assert consume(st, 0, r, None, old[r]) == 2
            st.rank_left(0, r, f"old{r}")
        new: dict[int, list] = {0: [], 1: []}
        for r in (0, 1):
            consume(st, 1, r, None, new[r])
        wait_for(st.is_done, 30, "the job planned again")
        (end,) = st.epoch_ends()
        assert len(end.final_step) == 2 and end.epoch == 0
        fresh = sorted({n for r in new.values() for n, _ in r})
        assert fresh[0] == res.world.first_step == final.last_step + 1
        assert fresh == list(range(fresh[0], fresh[-1] + 1)) and fresh[-1] == end.last_step
        assert end.steps == end.last_step + 1  # the epoch's span, voided numbers included
        for n in fresh[:-1]:
            assert len(st.get_step(n).batches) == 2
        got = Counter(s.sample_id for r in [*old.values(), *new.values()] for _, b in r
                      for s in b.samples)
        assert got == Counter(s.sample_id for s in samples)  # the epoch exactly once
        assert st.counters().samples_planned == N
        return [st.get_step(n) for n in fresh]
    finally:
        for h in hosts:
            h.stop()
