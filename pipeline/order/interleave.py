"""How positions are shared among sources: Webster's (Sainte-Laguë) interleave.

Sources with `counts[i]` positions each fill `sum(counts)` positions. Source i's k-th position
has the key (2k + 1) / (2 * counts[i]) (the middle of its k-th share of the line); positions
go in key order, ties to the lower source index. Every prefix of p positions then holds each
source within about one position of p * counts[i] / sum(counts) (its share), and a longer
prefix never holds fewer of any source (the rule is house-monotone), so the counts of any
prefix are well defined: `prefix_counts`. Exact integer arithmetic throughout: the result is
the same on every machine, for epochs of any size.

Pure: no I/O, no randomness (the order's randomness lives in epoch_order.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _lt(n: int, a: int, b: int) -> int:
    """#{k < n : (2k+1)/(2n) < a/b}: positions of a source of n keyed below a/b."""
    if n == 0:
        return 0
    # (2k+1) * b < 2 a n  <=>  k < (2an - b) / 2b
    return min(n, max(0, -((b - 2 * a * n) // (2 * b))))


def _le(n: int, a: int, b: int) -> int:
    """#{k < n : (2k+1)/(2n) <= a/b}."""
    if n == 0:
        return 0
    return min(n, max(0, (2 * a * n - b) // (2 * b) + 1))


def _rank(counts: Sequence[int], i: int, k: int) -> int:
    """Positions before source i's k-th: keys below its key, and equal keys of lower index."""
    a, b = 2 * k + 1, 2 * counts[i]
    return sum(_lt(n, a, b) if j >= i else _le(n, a, b) for j, n in enumerate(counts))


def prefix_counts(counts: Sequence[int], p: int) -> list[int]:
    """How many positions of each source the first `p` positions hold."""
    total = sum(counts)
    if p <= 0:
        return [0] * len(counts)
    if p >= total:
        return list(counts)
    q = p - 1  # the last position held: find its source i and ordinal k
    for i, n in enumerate(counts):
        if n == 0:
            continue
        lo, hi = 0, n - 1  # the largest k with rank(i, k) <= q, if any
        if _rank(counts, i, 0) > q:
            continue
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _rank(counts, i, mid) <= q:
                lo = mid
            else:
                hi = mid - 1
        if _rank(counts, i, lo) == q:
            a, b = 2 * lo + 1, 2 * n
            # Held: every key below a/b, and equal keys of sources up to i.
            return [_le(m, a, b) if j <= i else _lt(m, a, b) for j, m in enumerate(counts)]
    raise AssertionError("unreachable: some source holds position p - 1")


def merge_order(counts: Sequence[int]) -> np.ndarray:
    """The source of each of `sum(counts)` positions in key order (an int32 array), for one
    block (or one pass's files).

    Keys are float64 (one correctly rounded division each): equal fractions give equal floats,
    so the result is the same on every machine; for counts below 2**24, distinct keys (at least
    1/(4 n m) apart) also compare exactly as the fractions do."""
    keys = [(2 * np.arange(n, dtype=np.float64) + 1) / (2 * n) for n in counts]
    src = [np.full(n, i, dtype=np.int32) for i, n in enumerate(counts)]
    if not keys:
        return np.zeros(0, dtype=np.int32)
    k, s = np.concatenate(keys), np.concatenate(src)
    return s[np.lexsort((s, k))]
