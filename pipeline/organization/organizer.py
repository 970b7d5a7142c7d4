"""One SDO job's organization: its graph over the samples, and the planner window it plans with
(`lookahead_tokens` from `locality`) and the repeat gap that goes with that window.

Members of the graph are the samples preprocessing produced (`MeasuredSample`s of the job's
first epoch) that also have a vector: a record quarantined by preprocessing or by the embedding
stage never enters it. The graph is cached beside the embeddings (keyed by its members and k),
so a restarted producer plans on the very same graph (its ledger carries the graph's digest);
a serving producer also keeps `Organization.record()` in Redis and restores from it
(`restore_organization`), so a restart in a later epoch need not re-measure epoch 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import TrainingJobConfig
from pipeline.organization import embedding_cache
from pipeline.organization.embedding_table import EmbeddingTable
from pipeline.organization.knn_graph import KnnGraph, build_knn_graph
from pipeline.organization.locality import planner_lookahead, repeat_gap
from pipeline.planner.types import MeasuredSample

ORGANIZATION_VERSION = 1


@dataclass(frozen=True)
class Organization:
    graph: KnnGraph
    lookahead_tokens: int  # the planner window `locality` asks for
    repeat_gap: int  # visits between two visits of one sample (see `locality.repeat_gap`)
    without_vector: int  # measured samples left out: their record got no vector

    def record(self) -> dict:
        """What a restarted producer needs to plan on the very same graph (JSON-ready; the
        producer keeps it in Redis): the members in graph order and the graph's digest."""
        return {"version": ORGANIZATION_VERSION, "members": list(self.graph.ids),
                "graph_digest": self.graph.digest, "lookahead_tokens": self.lookahead_tokens,
                "repeat_gap": self.repeat_gap, "without_vector": self.without_vector}


def job_lookahead(job: TrainingJobConfig) -> int:
    """The planner window (tokens) an SDO job plans with: `locality` between the job's window
    and two budgets."""
    policy = job.batching.policy()
    return planner_lookahead(job.organization.locality, policy.lookahead_tokens,
                             policy.token_budget)


def _graph(job: TrainingJobConfig, table: EmbeddingTable, members: tuple,
           table_file: Path | None) -> KnnGraph:
    """The graph over `members` (rows of `table`): read from its cache file, else built."""
    k = job.organization.knn_k
    gpath = None if table_file is None else embedding_cache.graph_path(table_file, members, k)
    graph = None if gpath is None else embedding_cache.load_graph(gpath)
    if graph is None:
        rows = np.fromiter((table.row[s] for s in members), dtype=np.int64, count=len(members))
        graph = build_knn_graph(members, table.vectors[rows], k)
        if gpath is not None:
            embedding_cache.save_graph(gpath, graph)
    return graph


def organize(job: TrainingJobConfig, table: EmbeddingTable, measured: Sequence[MeasuredSample],
             table_file: Path | None = None) -> Organization:
    """Build (or read back) the graph over `measured` ∩ `table`; pick the planner window."""
    members = tuple(m.sample_id for m in measured if m.sample_id in table.row)
    if not members:
        raise ValueError("no sample has an embedding: nothing to organize")
    graph = _graph(job, table, members, table_file)
    window = job_lookahead(job)
    mean = float(np.mean([m.num_tokens for m in measured if m.sample_id in table.row]))
    return Organization(graph, window, repeat_gap(window, mean), len(measured) - len(members))


def restore_organization(job: TrainingJobConfig, table: EmbeddingTable, record: dict,
                         table_file: Path | None = None) -> Organization:
    """The organization of `record` (`Organization.record()`), on the same graph or an error:
    a graph that comes out different (other embeddings, a non-reproducible HNSW build without
    its cache file) would not match the job's ledger."""
    if record.get("version") != ORGANIZATION_VERSION:
        raise ValueError(f"organization record version {record.get('version')!r} is not "
                         f"{ORGANIZATION_VERSION}")
    members = tuple(record["members"])
    missing = [s for s in members if s not in table.row]
    if missing:
        raise ValueError(f"the job's KNN graph holds {len(missing)} sample(s) the embeddings "
                         f"do not (e.g. {missing[0]!r}): the dataset or its embeddings changed")
    graph = _graph(job, table, members, table_file)
    if graph.digest != record["graph_digest"]:
        raise ValueError("the KNN graph rebuilt from the embeddings differs from the job's "
                         f"(digest {graph.digest}, recorded {record['graph_digest']}): the "
                         "embeddings or the graph cache changed; start a new job")
    return Organization(graph, int(record["lookahead_tokens"]), int(record["repeat_gap"]),
                        int(record["without_vector"]))
