"""`RefillState` on a real redis-server: the Lua scripts against the pure lease table, exactly
once under concurrent consumers, lease expiry, retried asks, the fenced producer."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.coordinator.refill_state import RefillState
from pipeline.refill.leases import LeaseTable, RefillRejected
from pipeline.refill.request import RefillRequest

_jobs = itertools.count()


def make_requests(costs: list[tuple[int, int]]) -> list[tuple[RefillRequest, np.ndarray]]:
    return [(RefillRequest(f"s:{i}", p, g, seq=i), np.arange(p, dtype=np.int32) + i)
            for i, (p, g) in enumerate(costs)]


def filled(redis_client, costs, lease_seconds=30.0, job=None) -> RefillState:
    state = RefillState(redis_client, job or f"job{next(_jobs)}",
                        lease_ms=int(lease_seconds * 1000))
    assert state.hold_producer("p", 10_000)
    assert state.enqueue("p", len(costs), True, make_requests(costs))
    return state


def test_payloads_travel_whole(redis_client):
    state = filled(redis_client, [(5, 3), (7, 2)])
    res = state.refill("c", 100, [], call_seq=1)
    assert [r.request.request_id for r in res.admitted] == ["s:0", "s:1"]
    assert res.admitted[1].input_ids.tolist() == list(range(1, 8))
    assert res.admitted[1].request.cost == 9


costs = st.lists(st.tuples(st.integers(1, 200), st.integers(1, 200)), min_size=1, max_size=25)
script = st.lists(st.tuples(st.sampled_from(["refill", "refill", "open"]), st.integers(0, 2),
                            st.integers(0, 600), st.integers(0, 4)), max_size=30)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(costs, script)
def test_the_lua_scripts_follow_the_lease_table(redis_client, cs, ops):
    """Random asks and reopenings: Redis and the pure model admit, complete and refuse alike."""
    state = filled(redis_client, cs)
    model = LeaseTable(lease_ms=30_000)
    model.enqueue(r for r, _ in make_requests(cs))
    held: dict[str, list[str]] = {f"c{i}": [] for i in range(3)}
    seq = itertools.count(1)
    for op, c, free, k in ops:
        consumer = f"c{c}"
        if op == "open":
            assert state.open(consumer, held[consumer][1:]) == len(
                model.open(consumer, held[consumer][1:], 0))
            held[consumer] = held[consumer][1:]
            continue
        finished, held[consumer] = held[consumer][:k], held[consumer][k:]
        got = state.refill(consumer, free, finished, next(seq))
        want = model.refill(consumer, free, finished, 0)
        assert [r.request.request_id for r in got.admitted] == [
            r.request_id for r in want.admitted]
        assert (got.completed, got.stale) == (want.completed, want.stale)
        held[consumer] += [r.request.request_id for r in got.admitted]
    counts = state.counts()
    assert (counts.completed, counts.in_flight, counts.waiting, counts.readmitted) == (
        len(model.completed), model.in_flight, len(model.waiting), model.counters.readmitted)


def test_concurrent_consumers_complete_every_request_exactly_once(redis_client, redis_url):
    rng = np.random.default_rng(0)
    cs = [(int(a), int(b)) for a, b in rng.integers(1, 120, size=(300, 2))]
    state = filled(redis_client, cs)
    seen: list[str] = []
    lock = threading.Lock()

    def consume(name: str, seed: int) -> None:
        mine = RefillState.connect(redis_url, state.keys.job_id)
        r = np.random.default_rng(seed)
        held: list[str] = []
        n = 0
        while True:
            k = int(r.integers(0, len(held) + 1))
            free = int(r.integers(0, 600))
            res = mine.refill(name, free, held[:k], n)
            n += 1
            assert sum(x.request.cost for x in res.admitted) <= free
            assert not res.stale
            with lock:
                seen.extend(res.completed)
            held = held[k:] + [x.request.request_id for x in res.admitted]
            if mine.counts().done:
                break
        mine.close()

    threads = [threading.Thread(target=consume, args=(f"c{i}", i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(seen) == sorted(f"s:{i}" for i in range(300))
    assert len(state.completions()) == 300


def test_a_silent_consumers_requests_are_readmitted_first(redis_client):
    state = filled(redis_client, [(10, 10)] * 4, lease_seconds=0.3)
    first = state.refill("dead", 40, [], 1)
    assert [r.request.request_id for r in first.admitted] == ["s:0", "s:1"]
    time.sleep(0.4)
    got = state.refill("live", 1000, [], 1)
    assert [r.request.request_id for r in got.admitted] == ["s:0", "s:1", "s:2", "s:3"]
    assert state.counts().readmitted == 2
    late = state.refill("dead", 0, ["s:0"], 2)
    assert late.stale == ["s:0"] and not late.completed


def test_a_retried_ask_gets_the_same_admission_and_applies_nothing_twice(redis_client):
    state = filled(redis_client, [(10, 10)] * 6)
    a = state.refill("c", 40, [], 7)
    again = state.refill("c", 40, [], 7)
    assert [r.request.request_id for r in again.admitted] == [
        r.request.request_id for r in a.admitted] == ["s:0", "s:1"]
    assert state.counts().admitted == 2
    done = state.refill("c", 0, ["s:0"], 8)
    assert state.refill("c", 0, ["s:0"], 8).completed == done.completed == ["s:0"]


def test_an_ask_retried_after_the_lease_lapsed_still_confirms_what_it_finished(redis_client):
    # A replica restart outlasting the lease: the ask was applied, its reply lost.
    state = filled(redis_client, [(10, 10)] * 4, lease_seconds=0.3)
    state.refill("c", 40, [], 1)                      # s:0, s:1
    first = state.refill("c", 0, ["s:0", "s:1"], 2)   # the reply is lost
    time.sleep(0.4)
    state.refill("other", 0, [], 1)                   # any call expires the lapsed consumer
    state.open("c", [], retry_seq=2)
    again = state.refill("c", 0, ["s:0", "s:1"], 2)
    assert again.completed == first.completed == ["s:0", "s:1"] and not again.stale
    assert state.counts().completed == 2


def test_reopening_keeps_what_is_held_and_the_retried_asks_admission(redis_client):
    state = filled(redis_client, [(10, 10)] * 6)
    state.refill("c", 40, [], 1)                 # s:0, s:1, known to the consumer
    state.refill("c", 40, ["s:0"], 2)            # s:2, s:3: the reply is lost
    assert state.open("c", ["s:1"], retry_seq=2) == 0
    again = state.refill("c", 40, ["s:0"], 2)
    assert [r.request.request_id for r in again.admitted] == ["s:2", "s:3"]
    # A restart (nothing held, no retry) gives everything back.
    assert state.open("c", []) == 3
    assert state.counts().waiting == 5


def test_unknown_and_repeated_ids_are_refused_before_anything_is_applied(redis_client):
    state = filled(redis_client, [(10, 10)] * 2)
    state.refill("c", 40, [], 1)
    with pytest.raises(RefillRejected, match=r"unknown request ids \['x:9'\]"):
        state.refill("c", 40, ["s:0", "x:9"], 2)
    with pytest.raises(RefillRejected, match=r"ids named twice \['s:1'\]"):
        state.refill("c", 40, ["s:1", "s:1"], 3)
    with pytest.raises(RefillRejected, match="free_tokens must be >= 0"):
        state.refill("c", -1, [], 4)
    c = state.counts()
    assert (c.completed, c.in_flight) == (0, 2)


def test_the_producer_is_fenced(redis_client):
    state = RefillState(redis_client, f"job{next(_jobs)}", lease_ms=1000)
    assert state.hold_producer("a", 200)
    assert not state.hold_producer("b", 200)
    assert state.enqueue("a", 1, False, make_requests([(3, 3)]))
    time.sleep(0.25)
    assert state.hold_producer("b", 5000)
    assert not state.enqueue("a", 2, False, make_requests([(3, 3), (4, 4)]))
    assert state.enqueue("b", 2, True, make_requests([(3, 3), (4, 4)]))  # s:0 not added twice
    c = state.counts()
    assert (c.enqueued, c.waiting, c.exhausted) == (2, 2, True)
    assert state.cursor() == 2
