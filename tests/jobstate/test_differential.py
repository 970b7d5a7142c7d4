"""Both implementations, fed the same random sequence of calls, answer alike: the same return
values, the same refusals (error class) and the same state read back after every call.

The calls mix valid and invalid publications (conflicts, gaps, checkpoints out of order, stale
fences, ENDs, done), producer claims and releases, rank leases and acks, alone or as members of
groups that form, disagree on their size and share their acks, so a rule that one
implementation enforces and the other forgets shows up as a difference. No time passes inside a
sequence (every lease is long), so the two clocks never matter; lapses are the contract tests'.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.coordinator import RedisJobState
from pipeline.jobstate import JobState, MemoryJobState, Publication, QuarantineEntry, RankAck
from pipeline.jobstate.interface import Member
from pipeline.planner.types import EpochEnd

from .builders import make_step, publication

W = 3
_jobs = itertools.count()

# Numbers are relative to where the state stands (`first`: steps from published_through + 1 +
# first; `rows`/`epoch`: from the stored checkpoint), so most calls are near the valid edge.
publish_calls = st.fixed_dictionaries({
    "call": st.just("publish"),
    "first": st.sampled_from([-2, -1, 0, 0, 0, 0, 1]), "count": st.sampled_from([1, 2, 0, 3]),
    "salt": st.sampled_from(["", "", "", "x"]),
    "epoch": st.sampled_from([0, 0, 0, 1, -1]), "rows": st.sampled_from([1, 1, 2, 3, 0, -1]),
    "next_delta": st.sampled_from([0, 0, 0, -1, 1]),
    "end": st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(0, 1))),
    "samples_in": st.integers(0, 3),
    "quarantined": st.lists(st.sampled_from(["q1", "q2", "q3"]), max_size=2),
    "done": st.integers(0, 9).map(lambda x: x == 0),  # rarely: done ends the plan
    "fence": st.sampled_from(["current"] * 6 + ["previous"]),
})
producer_calls = st.one_of(
    st.fixed_dictionaries({"call": st.just("claim_producer"),
                           "holder": st.sampled_from(["a", "b"])}),
    st.fixed_dictionaries({"call": st.just("release_producer"),
                           "which": st.sampled_from(["current", "previous"])}),
)
# A rank's own lease (None) or a seat of a group of 2 or 3: groups form, disagree, share acks.
seats = st.one_of(st.none(), st.none(), st.tuples(st.integers(0, 2), st.sampled_from([2, 3])))
ack_calls = st.one_of(
    st.fixed_dictionaries({"call": st.just("ack"), "rank": st.sampled_from([0, 1, 2, W]),
                           "step": st.integers(-3, 1)}),
    st.fixed_dictionaries({"call": st.just("ack_many"), "acks": st.lists(
        st.tuples(st.integers(0, W), st.sampled_from(["c", "d", ""]), st.integers(-3, 1),
                  st.booleans(), seats),
        max_size=3)}),
    st.fixed_dictionaries({"call": st.just("grant"), "rank": st.integers(0, W),
                           "through": st.integers(-2, 1)}),
)
rank_calls = st.fixed_dictionaries({
    "call": st.sampled_from(["claim_rank", "heartbeat", "release_rank"]),
    "rank": st.integers(0, W - 1), "client": st.sampled_from(["c", "d", "e"]), "seat": seats,
    "claim": st.one_of(st.none(), st.integers(1, 3))})
_weighted = [publish_calls] * 6 + [ack_calls] * 2 + [rank_calls, producer_calls]
calls = st.lists(st.integers(0, len(_weighted) - 1).flatmap(lambda i: _weighted[i]),
                 min_size=5, max_size=30)


def _publication(c: dict, state: JobState) -> Publication:
    through = state.published_through()
    cp = state.load_checkpoint()
    first = max(0, through + 1 + c["first"])
    step_list = [make_step(n, W, epoch=n // 3, salt=c["salt"])
                 for n in range(first, first + c["count"])]
    base = step_list[-1].step + 1 if step_list else through + 1
    ends = ()
    if c["end"] is not None:
        e, variant = c["end"]
        ends = (EpochEnd(e, (3 * e + 2,) * (W - 1) + (3 * e + 2 - variant,), 3),)
    epoch = max(0, (cp.epoch if cp else 0) + c["epoch"])
    rows = max(0, (cp.samples_consumed if cp and cp.epoch == epoch else 0) + c["rows"])
    return publication(step_list, epoch=epoch, rows=rows,
                       next_step=max(0, base + c["next_delta"]), ends=ends,
                       samples_in=c["samples_in"],
                       quarantined=tuple(QuarantineEntry(q, f"r{q[-1]}") for q in
                                         c["quarantined"]), done=c["done"])


def _member(seat: tuple[int, int] | None) -> Member | None:
    return None if seat is None else Member(min(seat[0], seat[1] - 1), seat[1])


class Caller:
    """Applies the calls to one state, tracking the generations it was given."""

    def __init__(self, state: JobState) -> None:
        self.state = state
        self.gens: list[int] = []

    def gen(self, which: str) -> int:
        if not self.gens:
            return 0
        return self.gens[-1] if which == "current" or len(self.gens) < 2 else self.gens[-2]

    def apply(self, c: dict):
        s = self.state
        try:
            match c["call"]:
                case "publish":
                    return s.publish(_publication(c, s), fence=self.gen(c["fence"]))
                case "claim_producer":
                    gen = s.claim_producer(c["holder"], 600)
                    if gen is not None:
                        self.gens.append(gen)
                    return gen
                case "release_producer":
                    return s.release_producer(self.gen(c["which"]))
                case "ack":
                    return s.ack(c["rank"], s.published_through() + c["step"])
                case "ack_many":
                    through = s.published_through()
                    acks = [RankAck(r, client, through + d, renew, _member(seat))
                            for r, client, d, renew, seat in c["acks"]]
                    return [type(e).__name__ if e else None for e in s.ack_many(acks, 600)]
                case "grant":
                    (g,) = s.grant([(0, c["rank"], s.published_through() + c["through"])])
                    return type(g).__name__ if isinstance(g, Exception) else g
                case "claim_rank":
                    lease = s.claim_rank(c["rank"], c["client"], 600,
                                         member=_member(c["seat"]))
                    return lease.client_id, lease.claim
                case "heartbeat":
                    return s.heartbeat(c["rank"], c["client"], 600, member=_member(c["seat"]))
                case "release_rank":
                    return s.release_rank(c["rank"], c["client"], c["claim"],
                                          member=_member(c["seat"]))
        except Exception as exc:  # compared by class: both must refuse alike
            return type(exc).__name__

    def read(self, trimmed: int) -> dict:
        s = self.state
        lease = s.producer_lease()
        return {
            "through": s.published_through(),
            "steps": [s.get_step(n) for n in range(trimmed + 1, 9)],
            "ends": s.epoch_ends(), "done": s.is_done(), "checkpoint": s.load_checkpoint(),
            "counters": s.counters(), "quarantine": s.quarantine(), "acked": s.acked_all(),
            "producer": (lease.generation, lease.holder, lease.expires_at > 0) if lease else None,
            "holders": [h.client_id for h in s.rank_health()], "lapsed": s.lapsed_ranks(),
            "groups": [(g.rank, g.group_size, [(m.client_id, m.acked, m.released)
                                               for m in g.members]) for g in s.group_health()],
        }


@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(calls=calls)
def test_memory_and_redis_answer_every_call_alike(redis_url, calls):
    job = f"diff{next(_jobs)}"
    redis_state = RedisJobState(redis_url, job, config_hash="d", world_size=W)
    try:
        mem, red = Caller(MemoryJobState(job, W)), Caller(redis_state)
        for i, c in enumerate([{"call": "claim_producer", "holder": "a"}, *calls]):
            got_mem, got_red = mem.apply(c), red.apply(c)
            assert got_mem == got_red, (i, c)
            trimmed = redis_state.trimmed_through()
            assert mem.read(trimmed) == red.read(trimmed), (i, c)
    finally:
        redis_state.close()
