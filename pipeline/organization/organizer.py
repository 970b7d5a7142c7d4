"""One SDO job's organization: its graph over the samples, and the planner window it plans with
(`lookahead_tokens` from `locality`) and the repeat gap that goes with that window.

Members of the graph are the samples preprocessing produced (`MeasuredSample`s of the job's
first epoch) that also have a vector: a record quarantined by preprocessing or by the embedding
stage never enters it. The graph is cached beside the embeddings (keyed by its members and k),
so a restarted producer plans on the very same graph (its ledger carries the graph's digest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import JobConfig
from pipeline.organization import embedding_cache
from pipeline.organization.embedding_table import EmbeddingTable
from pipeline.organization.knn_graph import KnnGraph, build_knn_graph
from pipeline.organization.locality import planner_lookahead, repeat_gap
from pipeline.planner.types import MeasuredSample


@dataclass(frozen=True)
class Organization:
    graph: KnnGraph
    lookahead_tokens: int  # the planner window `locality` asks for
    repeat_gap: int  # visits between two visits of one sample (see `locality.repeat_gap`)
    without_vector: int  # measured samples left out: their record got no vector


def organize(job: JobConfig, table: EmbeddingTable, measured: Sequence[MeasuredSample],
             table_file: Path | None = None) -> Organization:
    """Build (or read back) the graph over `measured` ∩ `table`; pick the planner window."""
    org = job.organization
    members = tuple(m.sample_id for m in measured if m.sample_id in table.row)
    if not members:
        raise ValueError("no sample has an embedding: nothing to organize")
    graph = None
    gpath = None
    if table_file is not None:
        gpath = embedding_cache.graph_path(table_file, members, org.knn_k)
        graph = embedding_cache.load_graph(gpath)
    if graph is None:
        rows = np.fromiter((table.row[s] for s in members), dtype=np.int64, count=len(members))
        graph = build_knn_graph(members, table.vectors[rows], org.knn_k)
        if gpath is not None:
            embedding_cache.save_graph(gpath, graph)
    policy = job.batching.policy()
    window = planner_lookahead(org.locality, policy.lookahead_tokens, policy.token_budget)
    mean = float(np.mean([m.num_tokens for m in measured if m.sample_id in table.row]))
    return Organization(graph, window, repeat_gap(window, mean), len(measured) - len(members))
