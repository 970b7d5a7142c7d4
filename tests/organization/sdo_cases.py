"""Clustered unit vectors and their KNN graph: the synthetic structure the SDO tests plan on."""

from __future__ import annotations

import numpy as np

from pipeline.organization.epoch_visits import plan_epoch_visits
from pipeline.organization.exposure_ledger import ExposureLedger
from pipeline.organization.knn_graph import KnnGraph, build_knn_graph


def clustered_vectors(n: int, *, clusters: int = 5, dim: int = 16, spread: float = 0.4,
                      seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(max(1, clusters), dim))
    x = centers[rng.integers(0, len(centers), n)] + spread * rng.normal(size=(n, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32)


def graph_of(n: int, k: int = 8, seed: int = 0, **kw) -> tuple[KnnGraph, np.ndarray]:
    x = clustered_vectors(n, seed=seed, **kw)
    return build_knn_graph(tuple(f"s{i}" for i in range(n)), x, k), x


def run_epochs(graph: KnnGraph, epochs: int, *, seed: int = 0, coverage_epochs: int = 2,
               visits_per_epoch: int | None = None, ledger: ExposureLedger | None = None,
               first_epoch: int = 0, repeat_gap: int = 256):
    """Plan `epochs` epochs; returns ([EpochVisits], final ledger)."""
    if ledger is None:
        ledger = ExposureLedger.initial(graph.digest, graph.size)
    out = []
    for e in range(first_epoch, first_epoch + epochs):
        v, ledger = plan_epoch_visits(graph, ledger, e, seed=seed,
                                      coverage_epochs=coverage_epochs,
                                      visits_per_epoch=visits_per_epoch,
                                      repeat_gap=repeat_gap)
        out.append(v)
    return out, ledger
