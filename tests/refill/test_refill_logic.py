"""Pure refill logic: the cost rule, admission under a budget, the lease table (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.refill.admission import admit
from pipeline.refill.leases import LeaseTable, RefillRejected
from pipeline.refill.request import RefillRequest, price


def req(i: int, prompt: int, gen: int, over: bool = False) -> RefillRequest:
    return RefillRequest(f"r{i}", prompt, gen, seq=i, over_budget=over)


requests = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), max_size=40).map(
    lambda xs: [req(i, p, g) for i, (p, g) in enumerate(xs)])


# --- the cost rule ---
def test_cost_is_prompt_plus_planned_generation():
    p = price("a", 0, 100, 28, max_request_tokens=None, over_budget="quarantine")
    assert p.request is not None and p.request.cost == 128


@pytest.mark.parametrize("policy,expect", [
    ("quarantine", None), ("alone", (100, 50, True)), ("truncate", (100, 20, False))])
def test_over_budget_policies(policy, expect):
    p = price("a", 0, 100, 50, max_request_tokens=120, over_budget=policy)
    if expect is None:
        assert p.request is None and p.reason == "over_budget" and "> max_request_tokens 120" \
            in p.detail
    else:
        assert p.request is not None
        assert (p.request.prompt_tokens, p.request.generation_tokens,
                p.request.over_budget) == expect


def test_truncate_cannot_fit_a_prompt_over_the_limit():
    p = price("a", 0, 130, 5, max_request_tokens=120, over_budget="truncate")
    assert p.request is None and p.reason == "over_budget"


def test_empty_prompt_or_generation_is_invalid():
    assert price("a", 0, 0, 5, None, "quarantine").reason == "invalid_size"
    assert price("a", 0, 5, 0, None, "quarantine").reason == "invalid_size"


# --- admission ---
@given(requests, st.integers(0, 2000))
def test_admission_never_exceeds_the_offer_and_is_longest_waiting_first(waiting, free):
    got = admit(list(reversed(waiting)), free)  # input order must not matter
    assert sum(r.cost for r in got) <= free
    assert [r.seq for r in got] == sorted(r.seq for r in got)
    assert len({r.request_id for r in got}) == len(got)
    # Greedy in arrival order: a request that was passed over did not fit what was left then.
    left, chosen = free, {r.request_id for r in got}
    for r in sorted(waiting, key=lambda r: r.seq):
        if r.request_id in chosen:
            left -= r.cost
        elif left > 0:
            assert r.cost > left


def test_admission_skips_a_big_one_for_smaller_ones_behind_it():
    got = admit([req(0, 50, 50), req(1, 400, 400), req(2, 10, 10)], 200)
    assert [r.request_id for r in got] == ["r0", "r2"]


def test_flagged_request_goes_alone_and_only_to_an_idle_consumer():
    waiting = [req(0, 500, 500, over=True), req(1, 10, 10)]
    assert [r.request_id for r in admit(waiting, 100, consumer_idle=True)] == ["r0"]
    assert [r.request_id for r in admit(waiting, 100, consumer_idle=False)] == ["r1"]


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="free_tokens must be >= 0"):
        admit([], -1)


# --- the lease table ---
ops = st.lists(st.tuples(st.sampled_from(["refill", "open", "tick"]), st.integers(0, 2),
                         st.integers(0, 900), st.integers(0, 5)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(requests, ops)
def test_every_request_is_in_one_place_and_completes_exactly_once(waiting, script):
    table = LeaseTable(lease_ms=1000)
    table.enqueue(waiting)
    table.enqueue(waiting)  # a producer re-reading rows adds nothing
    held: dict[str, list[str]] = {f"c{i}": [] for i in range(3)}
    now = 0
    completions: list[str] = []
    for op, c, free, k in script:
        consumer = f"c{c}"
        if op == "tick":
            now += 700
            continue
        if op == "open":  # a restart: it lost what it held
            table.open(consumer, [], now)
            held[consumer] = []
            continue
        before = set(held[consumer])
        finished, held[consumer] = held[consumer][:k], held[consumer][k:]
        out = table.refill(consumer, free, finished, now)
        assert sum(r.cost for r in out.admitted) <= free
        completions += out.completed
        assert set(out.completed) | set(out.stale) <= set(finished)
        # What a lapse took from it, told once: never what it reports or gets back now.
        assert set(out.revoked) <= before - set(finished) - {r.request_id for r in out.admitted}
        assert not any(table.leased.get(rid, (None, ""))[1] == consumer for rid in out.revoked)
        held[consumer] = [rid for rid in held[consumer] if rid not in out.revoked]
        # A lapsed lease can come back to the consumer that still holds it: the same id, held once.
        held[consumer] += [r.request_id for r in out.admitted
                           if r.request_id not in held[consumer]]
        ids = [*table.waiting, *table.leased, *table.completed]
        assert sorted(ids) == sorted(r.request_id for r in waiting)  # nothing lost or doubled
    assert len(completions) == len(set(completions)) == len(table.completed)


def test_a_silent_consumer_loses_its_leases_to_another():
    table = LeaseTable(lease_ms=1000)
    table.enqueue([req(0, 10, 10), req(1, 10, 10), req(2, 10, 10)])
    assert [r.request_id for r in table.refill("a", 40, [], 0).admitted] == ["r0", "r1"]
    got = table.refill("b", 100, [], 1500)  # a's lease passed: r0, r1 go first again
    assert [r.request_id for r in got.admitted] == ["r0", "r1", "r2"]
    assert table.counters.readmitted == 2
    late = table.refill("a", 0, ["r0"], 1600)
    assert late.stale == ["r0"] and late.completed == []
    assert table.refill("b", 0, ["r0", "r1", "r2"], 1700).completed == ["r0", "r1", "r2"]


def test_a_finish_after_the_lease_lapsed_counts_if_nobody_else_took_it():
    table = LeaseTable(lease_ms=1000)
    table.enqueue([req(0, 10, 10)])
    table.refill("a", 40, [], 0)
    out = table.refill("a", 0, ["r0"], 5000)
    assert out.completed == ["r0"]
    assert table.refill("a", 0, ["r0"], 5100).completed == []  # a retried report: no change


def test_unknown_or_repeated_ids_reject_the_whole_report():
    table = LeaseTable(lease_ms=1000)
    table.enqueue([req(0, 10, 10)])
    table.refill("a", 40, [], 0)
    with pytest.raises(RefillRejected, match=r"unknown request ids \['nope'\]"):
        table.refill("a", 40, ["r0", "nope"], 1)
    with pytest.raises(RefillRejected, match=r"ids named twice \['r0'\]"):
        table.refill("a", 40, ["r0", "r0"], 1)
    assert "r0" in table.leased  # nothing applied
