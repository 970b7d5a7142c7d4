"""The KNN graph over frozen embeddings: each sample's k most similar other samples (faiss).

Exact inner-product search (`IndexFlatIP`, vectors are L2-normalized so scores are cosines) up
to `EXACT_MAX_NODES` samples: deterministic, and fast enough there (n^2 * d multiply-adds in
BLAS). Above it an HNSW index (approximate; its multi-threaded build is not bit-reproducible, so
the organizer caches the graph beside the embeddings and the ledger records its `digest`: a
restart plans on the very same graph, or refuses to).

Owns the graph as a value; knows nothing of epochs, exposure or the planner.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pipeline.planner.types import SampleId

EXACT_MAX_NODES = 20_000
_HNSW_M = 32


@dataclass(frozen=True, eq=False)
class KnnGraph:
    """Node i is `ids[i]`; `neighbors[i]` its k nearest other nodes, most similar first.

    `neighbors` is int32 [n, k] (-1 pads a row when fewer than k others exist or were found),
    `similarity` float32 [n, k] the matching cosines.
    """

    ids: tuple[SampleId, ...]
    neighbors: np.ndarray
    similarity: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.ids)
        if self.neighbors.ndim != 2 or self.neighbors.shape[0] != n:
            raise ValueError(f"neighbors must be [{n}, k], got {self.neighbors.shape}")
        if self.similarity.shape != self.neighbors.shape:
            raise ValueError("similarity and neighbors must have the same shape")
        if len(set(self.ids)) != n:
            raise ValueError("graph ids must be unique")

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def k(self) -> int:
        return int(self.neighbors.shape[1])

    @cached_property
    def index(self) -> dict[SampleId, int]:
        return {sid: i for i, sid in enumerate(self.ids)}

    @cached_property
    def in_degree(self) -> np.ndarray:
        """How many neighbor lists name each node (hubs: far above k)."""
        nb = self.neighbors[self.neighbors >= 0]
        return np.bincount(nb, minlength=self.size).astype(np.int64)

    @cached_property
    def digest(self) -> str:
        """Hash of ids and edges: equal digests = the same graph (the ledger is tied to it)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(list(self.ids)).encode())
        h.update(np.ascontiguousarray(self.neighbors, dtype="<i4").tobytes())
        return h.hexdigest()


def build_knn_graph(ids: tuple[SampleId, ...], vectors: np.ndarray, k: int) -> KnnGraph:
    """The graph of `vectors` (float32 [n, d], rows L2-normalized, row i is `ids[i]`)."""
    import faiss

    n = len(ids)
    if vectors.ndim != 2 or vectors.shape[0] != n:
        raise ValueError(f"vectors must be [{n}, d], got {vectors.shape}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    kk = min(k, n - 1)
    if kk <= 0:
        empty = np.zeros((n, 0), dtype=np.int32)
        return KnnGraph(tuple(ids), empty, empty.astype(np.float32))
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    d = x.shape[1]
    if n <= EXACT_MAX_NODES:
        index = faiss.IndexFlatIP(d)
    else:
        index = faiss.IndexHNSWFlat(d, _HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        index.hnsw.efSearch = max(64, 2 * (kk + 1))
    index.add(x)
    sims, idx = index.search(x, kk + 1)
    # Drop each node from its own list; when duplicates outrank it (equal vectors), drop the
    # last hit instead. A stable argsort of "is self" moves self to the end, then cut.
    order = np.argsort(idx == np.arange(n)[:, None], axis=1, kind="stable")[:, :kk]
    nb = np.take_along_axis(idx, order, axis=1).astype(np.int32)
    sim = np.take_along_axis(sims, order, axis=1).astype(np.float32)
    sim[nb < 0] = -np.inf
    return KnnGraph(tuple(ids), nb, sim)
