"""Turning a pool of batches into steps whose per-rank costs are balanced.

A DDP step takes as long as its slowest rank, so the W batches of a step should cost about the
same. Sorting the pool by compute cost and cutting it into consecutive runs of W puts
similar-cost batches together (optimal for minimising the sum over steps of the per-step maximum,
given the batches). Which rank gets which batch of a step is a seeded permutation, so no rank is
systematically the heaviest.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def group_by_cost(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Indices of `costs` grouped into runs of `world_size`, heaviest first.

    Ties are broken by index (the pool's formation order), so the grouping is deterministic.
    The last group is short when len(costs) is not a multiple of world_size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    return [order[i : i + world_size] for i in range(0, len(order), world_size)]


def rank_order(seed: int, step: int, n: int) -> list[int]:
    """Deterministic permutation of range(n) for one step: which rank gets the i-th batch."""
    ranks = list(range(n))
    if n > 1:
        random.Random(f"odb-rank-order:{seed}:{step}").shuffle(ranks)
    return ranks
