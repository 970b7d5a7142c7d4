"""The GMT oracle: the bound online batching is measured against (benchmarks, tests).

It sees the whole epoch, sorts it by length and cuts greedily longest-first under a token budget
(padded cost: a batch's longest sample times its size). For a given set of samples that is the
fewest batches any batching can reach (`BatchFormer.flush` cuts an epoch's last window the same
way). Offline, so a bound, not a loader.
"""

from __future__ import annotations


def gmt_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """The lengths cut into batches, longest first: each batch the longest length left and the
    next longest ones while `count * longest <= budget` (a length over the budget goes alone)."""
    s = sorted(lengths, reverse=True)
    out, i = [], 0
    while i < len(s):
        k = max(1, budget // s[i])
        out.append(s[i : i + k])
        i += k
    return out
