"""A step's formed batches spread over the ranks of a world: splitting, fillers, balance.

Pure. The step planner decides which formed batches a step holds; this module only decides
which rank runs which of them, and it owns the two moves that keep every rank busy:
- `split_to_fill`: a formed batch cut in two (its samples are length-sorted: each half pads no
  more than the whole, and a subset of a valid batch is valid), the biggest first, until there
  are enough batches;
- `filler_of`: a one-sample copy of the step's shortest sample, run with zero loss weight by a
  rank that has nothing else (it keeps that rank's collectives in step).

`split_step` is a global step's placement (`BatchingPolicy.global_token_budget`): its formed
batches become micro-batches on the W ranks, balanced by cost (longest-processing-time first:
each batch, the costliest first, goes to the rank with the least cost so far), so that every
rank has at least one micro-batch and DDP's all-reduce (on each rank's last micro-batch) runs
once per step on every rank. Whole batches balance only as well as their number divides by W
(8 batches on 5 ranks: max/mean 1.25), so the heaviest rank then hands a piece of one of its
batches (a run of its length-sorted samples) to the lightest, while that lowers the step's
slowest rank by more than `REBALANCE_GAIN` of the mean (at most 2(W - 1) pieces a step).
Which samples the step holds never depends on W; only this placement does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from pipeline.planner.rank_balancer import rank_order
from pipeline.planner.types import PendingBatch

Placed = tuple[PendingBatch, bool]  # (micro-batch, is a filler)

# A piece moves to the lightest rank only when it lowers the slowest rank's cost by more than
# this share of the mean rank cost: a smaller gain is not worth another micro-batch (a forward
# pass of its own).
REBALANCE_GAIN = 0.01


def split_to_fill(pool: Sequence[PendingBatch], need: int) -> list[PendingBatch]:
    """Split the pool's biggest plain batches until `need` more exist (or none can split).
    The halves keep their batch's place in the list (first half) or go to its end."""
    pool = list(pool)
    heap = [(-len(pb.samples), i) for i, pb in enumerate(pool) if not pb.over_budget]
    heapq.heapify(heap)
    while need > 0 and heap and -heap[0][0] >= 2:
        _, i = heapq.heappop(heap)
        s = pool[i].samples
        half = len(s) // 2  # samples are length-sorted: each half pads no more than the whole
        pool[i] = PendingBatch(s[:half])
        pool.append(PendingBatch(s[half:]))
        heapq.heappush(heap, (-half, i))
        heapq.heappush(heap, (-(len(s) - half), len(pool) - 1))
        need -= 1
    return pool


def filler_of(group: Sequence[PendingBatch]) -> PendingBatch:
    """A one-sample batch copying the group's shortest sample (the cheapest to run), with its
    truncation and over-budget flag; ties: the first in group order."""
    best = None
    for pb in group:
        for s, n in zip(pb.samples, pb.lengths(), strict=True):
            if best is None or n < best[0]:
                best = (n, s, pb)
    if best is None:
        raise ValueError("a filler copies a sample of its step: the step has none")
    _, s, pb = best
    return PendingBatch(
        (s,),
        over_budget=pb.over_budget,
        truncated_to=tuple(t for t in pb.truncated_to if t[0] == s.sample_id),
    )


def split_step(units: Sequence[PendingBatch], world_size: int,
               cost: Callable[[PendingBatch], float], *, seed: int, key: int
               ) -> list[list[Placed]]:
    """A global step's formed batches (in formation order) as each rank's micro-batches.

    Index = rank. Fewer batches than ranks: the biggest are split until there are enough; still
    fewer (fewer samples than ranks, or unsplittable over-budget batches): the ranks left get a
    filler each. Then longest-processing-time first by `cost` (ties: formation order), over the
    ranks in a seeded order (`rank_order(seed, key, W)`, so no rank is always the heaviest); a
    rank's micro-batches run in formation order. Deterministic in its arguments.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not units:
        raise ValueError("a step holds at least one formed batch")
    units = list(units)
    if len(units) < world_size:
        units = split_to_fill(units, world_size - len(units))
    ranks = rank_order(seed, key, world_size)
    out: list[list[tuple[float, PendingBatch]]] = [[] for _ in range(world_size)]
    # (load, micro-batches, position in the seeded order): an empty rank is always taken first.
    heap = [(0.0, 0, i) for i in range(world_size)]
    costs = [cost(u) for u in units]
    for i in sorted(range(len(units)), key=lambda i: (-costs[i], i)):
        load, count, pos = heapq.heappop(heap)
        out[ranks[pos]].append((i, units[i]))
        heapq.heappush(heap, (load + costs[i], count + 1, pos))
    _rebalance(out, cost)
    placed: list[list[Placed]] = [[(u, False) for _, u in sorted(got, key=lambda t: t[0])]
                                  for got in out]
    if any(not p for p in placed):
        filler = filler_of(units)
        for p in placed:
            if not p:
                p.append((filler, True))
    return placed


def _rebalance(out: list[list[tuple[float, PendingBatch]]],
               cost: Callable[[PendingBatch], float]) -> None:
    """Move pieces of the heaviest rank's batches to the lightest rank while that lowers the
    heavier of the two by more than `REBALANCE_GAIN` of the mean (see the module docstring).

    A piece is a run of a batch's length-sorted samples from either end; the batch's place in
    formation order is kept (key `i`) and the piece follows it (`i + 0.5`), so every rank's
    micro-batches still run in formation order. At most 2(W - 1) moves; each lowers the pair's
    heavier rank, so the step's slowest rank never gets slower."""
    w = len(out)
    if w < 2:
        return
    loads = [sum(cost(u) for _, u in got) for got in out]
    mean = sum(loads) / w
    if mean <= 0:
        return
    for _ in range(2 * (w - 1)):
        hi = max(range(w), key=lambda r: (loads[r], -r))
        lo = min(range(w), key=lambda r: (loads[r], r))
        best = None  # (new max of the pair, index in out[hi], kept piece, moved piece)
        for j, (_, u) in enumerate(out[hi]):
            if u.over_budget or len(u.samples) < 2:
                continue
            move = _best_piece(u, loads[hi] - cost(u), loads[lo], cost)
            if move is not None and (best is None or move[0] < best[0]):
                best = (move[0], j, move[1], move[2])
        if best is None or best[0] > loads[hi] - REBALANCE_GAIN * mean:
            return
        _, j, kept, moved = best
        key, _ = out[hi][j]
        out[hi][j] = (key, kept)
        out[lo].append((key + 0.5, moved))
        loads[hi] = sum(cost(u) for _, u in out[hi])
        loads[lo] = sum(cost(u) for _, u in out[lo])


def _best_piece(u: PendingBatch, rest_hi: float, load_lo: float,
                cost: Callable[[PendingBatch], float]
                ) -> tuple[float, PendingBatch, PendingBatch] | None:
    """The cut of `u` (kept on the heavy rank, whose other batches cost `rest_hi`; moved to the
    light one, loaded `load_lo`) that minimises the heavier of the two: for each end the piece
    comes from, a binary search over the cut (the moved piece grows with it)."""
    n = len(u.samples)
    best = None
    for from_end in (False, True):
        def cut(k: int, from_end: bool = from_end
                ) -> tuple[float, float, PendingBatch, PendingBatch]:
            a, b = _pieces(u, n - k if from_end else k)
            kept, moved = (a, b) if from_end else (b, a)
            return rest_hi + cost(kept), load_lo + cost(moved), kept, moved

        lo, hi = 1, n - 1  # k samples move; find the first k where the light rank gets heavier
        while lo < hi:
            mid = (lo + hi) // 2
            h, light, _, _ = cut(mid)
            if light >= h:
                hi = mid
            else:
                lo = mid + 1
        for k in {max(1, lo - 1), lo}:
            h, light, kept, moved = cut(k)
            worst = max(h, light)
            if best is None or worst < best[0]:
                best = (worst, kept, moved)
    return best


def _pieces(u: PendingBatch, k: int) -> tuple[PendingBatch, PendingBatch]:
    """`u` cut after its first `k` samples (each piece keeps its samples' truncation)."""
    def piece(samples: tuple) -> PendingBatch:
        ids = {s.sample_id for s in samples}
        return PendingBatch(samples, truncated_to=tuple(t for t in u.truncated_to if t[0] in ids))

    return piece(u.samples[:k]), piece(u.samples[k:])
