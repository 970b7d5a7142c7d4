"""The GMT oracle: the whole epoch sorted by length, cut greedily longest-first under a token
budget (padded cost: a batch's longest sample times its size). Offline — it sees the epoch —
so it is a bound for online batching, not a loader."""

from __future__ import annotations


def gmt_batches(lengths: list[int], budget: int) -> list[list[int]]:
    s = sorted(lengths, reverse=True)
    out, i = [], 0
    while i < len(s):
        k = max(1, budget // s[i])
        out.append(s[i : i + k])
        i += k
    return out
