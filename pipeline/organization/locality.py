"""The `locality` knob and its measure.

Knob: SDO feeds the ordinary planner in traversal order; the planner's online window (bounded
in tokens: `lookahead_tokens`) then decides how far the order may be re-sorted by length. A
window of two budgets keeps each batch a run of neighboring visits (locality); the job's full
window (128 budgets by default) sorts by length over many regions (padding efficiency).
`locality` in [0, 1] interpolates the window geometrically between the two: 0 = the job's
`batching.lookahead_tokens`, 1 = 2 x `token_budget`.

Measure: the mean pairwise cosine of the embeddings within a batch, averaged over the batches
with two or more samples (`batch_locality`); `pair_baseline` is the same figure for random pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np


def planner_lookahead(locality: float, lookahead_tokens: int, token_budget: int) -> int:
    """The planner window (tokens) for `locality` (see the module docstring)."""
    if not 0.0 <= locality <= 1.0:
        raise ValueError(f"organization.locality must be in [0, 1], got {locality}")
    lo = 2 * token_budget
    hi = max(lo, lookahead_tokens)
    return max(token_budget, round(hi ** (1.0 - locality) * lo ** locality))


def repeat_gap(lookahead_tokens: int, mean_tokens: float) -> int:
    """Visits between two visits of one sample: twice the samples a window holds, so the first
    has normally left the window (been cut into a batch) before the second arrives."""
    return max(1, math.ceil(2 * lookahead_tokens / max(1.0, mean_tokens)))


def _mean_pair_cosine(rows: np.ndarray) -> float:
    # Rows are unit vectors: sum over pairs i != j of v_i.v_j = |sum v|^2 - b.
    b = len(rows)
    s = rows.sum(axis=0, dtype=np.float64)
    return float((s @ s - b) / (b * (b - 1)))


def batch_locality(batches: Iterable[Sequence], vector_of: Callable[[object], np.ndarray],
                   ) -> float | None:
    """Mean over batches (>= 2 distinct samples) of the mean pairwise cosine of the distinct
    samples inside the batch (two visits of one sample would score a cosine of 1: counted by
    `batches_with_repeats` instead); None when no batch has two. `vector_of(sample_id)` gives
    a sample's unit embedding."""
    vals = []
    for b in batches:
        distinct = list(dict.fromkeys(b))
        if len(distinct) > 1:
            vals.append(_mean_pair_cosine(np.stack([vector_of(i) for i in distinct])))
    return float(np.mean(vals)) if vals else None


def batches_with_repeats(batches: Iterable[Sequence]) -> int:
    """Batches that hold one sample more than once (two visits in one batch)."""
    return sum(len(set(b)) < len(b) for b in batches)


def pair_baseline(vectors: np.ndarray) -> float | None:
    """Mean cosine over all pairs of distinct samples: what random batches score on average."""
    return _mean_pair_cosine(vectors) if len(vectors) > 1 else None
