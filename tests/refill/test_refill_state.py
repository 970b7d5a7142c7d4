"""`RefillState` on a real redis-server: the Lua scripts against the pure lease table, exactly
once under concurrent consumers, lease expiry and what a lapsed consumer learns, retried asks,
the fenced and idempotent producer, epochs, image payloads."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.coordinator.refill_state import RefillState, RequestPayload, SourcePosition
from pipeline.refill.leases import LeaseTable, RefillRejected
from pipeline.refill.request import RefillRequest, arrival_seq, request_id

_jobs = itertools.count()


def make_requests(costs: list[tuple[int, int]], epoch: int = 0) -> list[RequestPayload]:
    return [RequestPayload(RefillRequest(request_id(f"s:{i}", epoch), p, g,
                                         seq=arrival_seq(epoch, i)),
                           np.arange(p, dtype=np.int32) + i)
            for i, (p, g) in enumerate(costs)]


def at(row: int, epoch: int = 0) -> SourcePosition:
    return SourcePosition(epoch, row)


def filled(redis_client, costs, lease_seconds=30.0, job=None) -> RefillState:
    state = RefillState(redis_client, job or f"job{next(_jobs)}",
                        lease_ms=int(lease_seconds * 1000))
    assert state.hold_producer("p", 10_000)
    assert state.enqueue("p", at(0), at(len(costs)), True, make_requests(costs))
    return state


def with_lease(state: RefillState, lease_seconds: float) -> RefillState:
    """The same job's state for a consumer whose lease is `lease_seconds` (each ask names its
    own lease: a short one lapses on purpose, a long one never does in a test)."""
    return RefillState(state.client, state.keys.job_id, lease_ms=int(lease_seconds * 1000))


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
    model.enqueue(r.request for r in make_requests(cs))
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
        assert (got.completed, got.stale, got.revoked) == (want.completed, want.stale,
                                                           want.revoked)
        held[consumer] += [r.request.request_id for r in got.admitted]
    counts = state.counts()
    assert (counts.completed, counts.in_flight, counts.waiting, counts.readmitted) == (
        len(model.completed), model.in_flight, len(model.waiting), model.counters.readmitted)
    assert {e.epoch: e.completed for e in counts.by_epoch if e.completed} == \
        model.counters.completed_by_epoch


def test_concurrent_consumers_complete_every_request_exactly_once(redis_client, redis_url):
    rng = np.random.default_rng(0)
    cs = [(int(a), int(b)) for a, b in rng.integers(1, 120, size=(300, 2))]
    state = filled(redis_client, cs)
    seen: list[str] = []
    asks: list[tuple[int, int, list[str], list[str]]] = []  # (free, admitted cost, stale, revoked)
    lock = threading.Lock()

    def consume(name: str, seed: int) -> None:  # records; the test's thread asserts
        mine = RefillState.connect(redis_url, state.keys.job_id)
        r = np.random.default_rng(seed)
        held: list[str] = []
        n = 0
        try:
            while True:
                k = int(r.integers(0, len(held) + 1))
                free = int(r.integers(0, 600))
                res = mine.refill(name, free, held[:k], n)
                n += 1
                with lock:
                    asks.append((free, sum(x.request.cost for x in res.admitted),
                                 list(res.stale), list(res.revoked)))
                    seen.extend(res.completed)
                held = held[k:] + [x.request.request_id for x in res.admitted]
                if mine.counts().done:
                    break
        finally:
            mine.close()

    threads = [threading.Thread(target=consume, args=(f"c{i}", i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert asks and all(cost <= free and not stale and not revoked
                        for free, cost, stale, revoked in asks)
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
    assert state.enqueue("a", at(0), at(1), False, make_requests([(3, 3)]))
    time.sleep(0.25)
    assert state.hold_producer("b", 5000)
    assert not state.enqueue("a", at(1), at(2), False, make_requests([(3, 3), (4, 4)])[1:])
    # The new holder re-reads from the stored position: row 0 is not read again.
    assert not state.enqueue("b", at(0), at(2), True, make_requests([(3, 3), (4, 4)]))
    assert state.enqueue("b", at(1), at(2), True, make_requests([(3, 3), (4, 4)])[1:])
    c = state.counts()
    assert (c.enqueued, c.waiting, c.exhausted) == (2, 2, True)
    assert state.position() == at(2)


def test_a_retried_enqueue_adds_nothing_twice(redis_client):
    """redis-py re-sends an EVALSHA whose reply timed out: the batch was applied once already,
    its requests, quarantine records and counts must not be added again."""
    state = RefillState(redis_client, f"job{next(_jobs)}")
    assert state.hold_producer("p", 10_000)
    bad = [{"sample_id": "s:7", "reason": "bad_record", "detail": "no answer"}]
    batch = ("p", at(0), at(8), False, make_requests([(3, 3)] * 2), bad)
    assert state.enqueue(*batch)
    assert state.enqueue(*batch)  # the retry: acknowledged, nothing added
    c = state.counts()
    assert (c.enqueued, c.waiting, c.quarantined) == (2, 2, 1)
    assert c.quarantined_by_reason == {"bad_record": 1}
    assert c.by_epoch[0].quarantined == 1
    assert [q["sample_id"] for q in state.quarantine()] == ["s:7"]
    assert state.position() == at(8)
    # The next batch applies, and a batch from a position never stored is refused.
    assert not state.enqueue("p", at(9), at(10), False, [], bad)
    assert state.enqueue("p", at(8), at(10), False, [], bad)
    assert state.counts().quarantined == 2


def test_each_epoch_completes_every_request_once(redis_client):
    """epochs: 2: each sample's request of each epoch is its own request, admitted after the
    first epoch's, completed once, counted per epoch."""
    state = RefillState(redis_client, f"job{next(_jobs)}")
    assert state.hold_producer("p", 10_000)
    cs = [(5, 5)] * 3
    assert state.enqueue("p", at(0), at(0, epoch=1), False, make_requests(cs))
    assert state.enqueue("p", at(0, epoch=1), at(3, epoch=1), True, make_requests(cs, epoch=1))
    assert state.enqueue("p", at(0, epoch=1), at(3, epoch=1), True, make_requests(cs, epoch=1))
    got = state.refill("c", 40, [], 1)
    ids = [r.request.request_id for r in got.admitted]
    assert ids == ["s:0", "s:1", "s:2", "s:0@1"]  # the first epoch's first
    assert [r.request.epoch for r in got.admitted] == [0, 0, 0, 1]
    assert got.admitted[3].request.sample_id == "s:0"
    rest = state.refill("c", 40, ids, 2)
    assert state.refill("c", 0, [r.request.request_id for r in rest.admitted], 3).completed
    assert state.refill("c", 0, ids, 3).completed  # a retried report: the same reply
    assert sorted(state.completions()) == sorted(
        [f"s:{i}" for i in range(3)] + [f"s:{i}@1" for i in range(3)])
    c = state.counts()
    assert c.done and (c.enqueued, c.completed) == (6, 6)
    assert [(e.epoch, e.enqueued, e.completed) for e in c.by_epoch] == [(0, 3, 3), (1, 3, 3)]


def test_a_lapsed_consumer_is_told_what_was_taken_from_it(redis_client):
    """The loser of a lapsed lease learns it at its very next ask (`revoked`), not only when it
    reports the request finished (`stale`); both as the pure lease table says."""
    state = filled(redis_client, [(10, 10)] * 4)
    slow, live = with_lease(state, 0.3), with_lease(state, 60)
    model = LeaseTable(lease_ms=300)
    model.enqueue(r.request for r in make_requests([(10, 10)] * 4))
    got = slow.refill("slow", 40, [], 1)
    assert [r.request.request_id for r in got.admitted] == [
        r.request_id for r in model.refill("slow", 40, [], 0).admitted] == ["s:0", "s:1"]
    time.sleep(0.4)
    heir = live.refill("heir", 20, [], 1)  # the lapse: s:0 goes to the heir
    model.lease_ms = 60_000
    assert [r.request.request_id for r in heir.admitted] == [
        r.request_id for r in model.refill("heir", 20, [], 1000).admitted] == ["s:0"]
    # The slow consumer reports s:1 finished (nobody took it: it completes) and learns s:0 is
    # no longer its own; its lease is renewed, and it gets s:2 and s:3.
    back = live.refill("slow", 40, ["s:1"], 2)
    want = model.refill("slow", 40, ["s:1"], 1001)
    assert (back.completed, back.stale, back.revoked) == (want.completed, want.stale,
                                                          want.revoked) == (["s:1"], [], ["s:0"])
    assert [r.request.request_id for r in back.admitted] == ["s:2", "s:3"]
    assert live.refill("slow", 0, ["s:0"], 3).stale == ["s:0"]  # too late: the heir's
    c = state.counts()
    assert (c.lease_lapses, c.readmitted) == (model.counters.lease_lapses,
                                              model.counters.readmitted) == (1, 2)


def test_image_payloads_travel_whole(redis_client):
    state = RefillState(redis_client, f"job{next(_jobs)}")
    assert state.hold_producer("p", 10_000)
    pixels = np.arange(2 * 6 * 1176, dtype=np.uint8).reshape(12, 1176)
    grid = np.array([[1, 2, 2], [1, 2, 4]], dtype=np.int64)
    (req,) = make_requests([(4, 4)])
    assert state.enqueue("p", at(0), at(1), True,
                         [RequestPayload(req.request, req.input_ids, pixels, grid)])
    (got,) = state.refill("c", 100, [], 1).admitted
    assert got.pixel_values.dtype == np.uint8 and (got.pixel_values == pixels).all()
    assert (got.image_grid_thw == grid).all() and got.image_grid_thw.dtype == np.int64
