"""Frozen embeddings of a dataset as a value, and the checks every vector passes.

`EmbeddingTable`: sample ids, one unit-length float32 row each, the model (or column) that made
them, and the records that got no vector with their reason (`QuarantinedRecord`, reason
`bad_embedding` for a vector that is missing, ragged, of the wrong dimension, NaN/inf or zero;
the preprocessing reasons for a record that does not parse). A quarantined record never enters
the KNN graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from pipeline.preprocess.sample import QuarantinedRecord
from pipeline.quarantine import QuarantineReason

BAD_EMBEDDING = QuarantineReason.BAD_EMBEDDING


class BadVector(ValueError):
    """One record's vector is unusable; the message says why (the caller names the record)."""


def check_vector(value: Any, dim: int | None = None) -> np.ndarray:
    """A flat list of finite numbers, not all zero (and `dim` long) -> unit float32 vector."""
    if value is None:
        raise BadVector("no vector")
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise BadVector(f"expected a list of numbers, got {type(value).__name__}")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise BadVector("ragged or not numeric (expected a flat list of numbers)") from None
    if arr.ndim != 1:
        raise BadVector(f"expected a flat list of numbers, got shape {arr.shape}")
    if dim is not None and len(arr) != dim:
        raise BadVector(f"{len(arr)} values, expected dimension {dim}")
    if len(arr) == 0:
        raise BadVector("empty vector")
    if not np.isfinite(arr).all():
        raise BadVector("holds NaN or infinite values")
    norm = math.sqrt(float(arr @ arr))
    if norm == 0.0:
        raise BadVector("all zeros (no direction)")
    return (arr / norm).astype(np.float32)


@dataclass(frozen=True, eq=False)
class EmbeddingTable:
    ids: tuple[str, ...]
    vectors: np.ndarray  # float32 [n, dim], unit rows
    made_by: str  # model identity, or "column:<name>"
    quarantined: tuple[QuarantinedRecord, ...] = ()

    def __post_init__(self) -> None:
        if self.vectors.ndim != 2 or self.vectors.shape[0] != len(self.ids):
            raise ValueError(f"vectors must be [{len(self.ids)}, dim], got {self.vectors.shape}")

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    @cached_property
    def row(self) -> dict[str, int]:
        return {sid: i for i, sid in enumerate(self.ids)}

    def vector(self, sample_id: str) -> np.ndarray:
        return self.vectors[self.row[sample_id]]
