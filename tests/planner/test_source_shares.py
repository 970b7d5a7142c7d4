"""`SourceShares`, the planner's share control: it picks the unit that keeps every source
closest to its target, bounds the running deficit whenever the candidates allow it, moves
targets without a jump, and replays identically from a snapshot."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.planner.source_shares import SourceShares
from pipeline.planner.types import MeasuredSample

SETTINGS = settings(max_examples=150, deadline=None)


def sample(source: int, loss: int = 10, n: int = 0) -> MeasuredSample:
    return MeasuredSample(f"{source}:{n}", max(loss, 1), 0, loss, source)


units = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 50)), min_size=1, max_size=6)


def as_unit(spec) -> list[MeasuredSample]:
    return [sample(s, loss, i) for i, (s, loss) in enumerate(spec)]


@SETTINGS
@given(st.sampled_from(["samples", "loss_tokens"]), st.lists(units, min_size=1, max_size=8),
       st.lists(st.integers(0, 5), min_size=3, max_size=3).filter(lambda c: sum(c) > 0))
def test_pick_takes_the_candidate_with_the_smallest_deficit_after_it(by, candidates, counts):
    sh = SourceShares(3, by)
    sh.set_counts(counts)
    sh.take(as_unit([(0, 7), (1, 3)]))
    cands = [as_unit(c) for c in candidates]
    shares = sh.targets()

    def after(c):
        add = sh.amounts(c)
        return sum((d + a - t * sum(add)) ** 2 for d, a, t in zip(sh.deficit, add, shares,
                                                                    strict=True))

    got = sh.pick(cands)
    assert after(cands[got]) <= min(after(c) for c in cands) + 1e-6
    assert all(after(cands[i]) > after(cands[got]) - 1e-6 for i in range(got))  # first of equals


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["samples", "loss_tokens"]), st.integers(1, 30), st.data())
def test_the_deficit_stays_within_one_unit_when_every_source_is_on_offer(by, m, data):
    """With a single-source unit of each source among the candidates (each at most m), greedy
    picking keeps every source's running deficit within m: the share of any stretch of units is
    off by at most 2m over its total."""
    counts = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=3))
    k = len(counts)
    sh = SourceShares(k, by)
    sh.set_counts([1000 * c for c in counts])  # (more than is taken: no source runs out)
    for _ in range(60):
        cands = [[sample(i, data.draw(st.integers(1, m)))] for i in range(k)]
        extra = data.draw(st.lists(units, max_size=3))
        cands += [[s for s in as_unit(u) if s.source < k] or [sample(0, 1)] for u in extra]
        sh.take(cands[sh.pick(cands)])
        if by == "samples":
            assert max(abs(d) for d in sh.deficit) <= 1 + 1e-9
        else:
            assert max(abs(d) for d in sh.deficit) <= m + 1e-9


def test_token_targets_follow_the_counts_and_each_sources_mean_loss_tokens():
    sh = SourceShares(2, "loss_tokens")
    sh.set_counts([1, 3])
    assert sh.targets() == [0.25, 0.75]  # nothing seen yet: by the counts alone
    sh.set_counts([1, 1])
    for _ in range(10):
        sh.observe(sample(0, 30))
        sh.observe(sample(1, 10))
    assert sh.targets() == [0.75, 0.25]
    # A source not seen yet counts at the mean of those seen (it is not starved).
    three = SourceShares(3, "loss_tokens")
    three.set_counts([1, 1, 2])
    three.observe(sample(0, 10))
    assert three.targets() == [0.25, 0.25, 0.5]


def test_a_change_spreads_the_rest_of_the_epoch_at_the_new_shares():
    sh = SourceShares(2, "samples")
    sh.set_counts([25, 25])
    for i in range(10):
        sh.take([sample(0 if i < 6 else 1)])  # 6 and 4: source 0 ahead by one
    before = (list(sh.deficit), sh.targets())
    sh.set_counts([25, 25])  # the same counts again (a restarted producer): nothing moves
    assert (list(sh.deficit), sh.targets()) == before == ([1.0, -1.0], [0.5, 0.5])
    sh.set_counts([15, 35])  # a mix: the 40 left go 9:31 (the epoch ends as its counts say)
    assert sh.deficit == [0.0, 0.0] and sh.targets() == [9 / 40, 31 / 40]
    picks = []
    for _ in range(40):
        cands = [[sample(0)], [sample(1)]]
        i = sh.pick(cands)
        picks.append(i)
        sh.take(cands[i])
    assert sh.taken == [15, 35]
    # Every stretch of the rest holds the new shares (within a sample), from its first pick.
    assert all(abs(picks[:n].count(1) - 31 / 40 * n) <= 1 for n in range(1, 41))


@SETTINGS
@given(st.sampled_from(["samples", "loss_tokens"]), st.lists(units, min_size=2, max_size=12),
       st.integers(1, 10))
def test_a_snapshot_replays_the_same_picks(by, stream, cut):
    def run(sh, rounds):
        out = []
        for r in rounds:
            cands = [as_unit(u) for u in stream[r % len(stream):][:3]] or [as_unit(stream[0])]
            for c in cands:
                for s in c:
                    sh.observe(s)
            i = sh.pick(cands)
            sh.take(cands[i])
            out.append(i)
        return out

    a = SourceShares(3, by)
    a.set_counts([2, 1, 1])
    first = run(a, range(cut))
    b = SourceShares.restore(json.loads(json.dumps(a.snapshot())))
    assert run(a, range(cut, cut + 10)) == run(b, range(cut, cut + 10))
    assert first is not None


def test_one_source_or_equal_candidates_keep_the_planners_order():
    one = SourceShares(1)
    assert one.pick([[sample(0)], [sample(0)]]) == 0
    two = SourceShares(2)
    two.set_counts([1, 1])
    assert two.pick([[sample(0), sample(1)], [sample(1), sample(0)]]) == 0
