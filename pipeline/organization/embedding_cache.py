"""The embedding cache: one file per (model, content), and the graph beside it.

Key: a hash of what the vectors depend on and nothing else: the model identity (name and
package version, or folder digest) or the column name, the text recipe, the row limit, and every
source file's name and bytes. Augmentation is not in it (embeddings are taken before it), so
every epoch and every job on the same data shares one file. Where: `organization.embedding.
cache_dir`, else `embeddings/` in the cache dir (`config.default_cache_dir()`: never beside the
data, so a dataset in a checkout leaves it clean). Files are written to a temporary name and
renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from pipeline.config import TrainingJobConfig, default_cache_dir
from pipeline.errors import UserError
from pipeline.organization.embedding_table import EmbeddingTable
from pipeline.organization.knn_graph import KnnGraph
from pipeline.preprocess.sample import QuarantinedRecord
from pipeline.preprocess.sources import SourceFile, open_input
from pipeline.quarantine import QuarantineReason

_READ = 8 * 1024 * 1024


def _file_digest(f: SourceFile, h) -> None:
    h.update(f"{f.source}\0".encode())
    with open_input(f.path) as src:
        while block := src.read(_READ):
            h.update(block)


def content_key(files: list[SourceFile], made_by: str, recipe: str, limit: int | None) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps([made_by, recipe, limit]).encode())
    for f in files:
        _file_digest(f, h)
    return h.hexdigest()


def cache_dir(job: TrainingJobConfig) -> Path:
    configured = job.organization.embedding.cache_dir
    return Path(configured).expanduser() if configured else Path(default_cache_dir(),
                                                                  "embeddings")


def table_path(folder: Path, made_by: str, key: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", made_by.split("@")[0].rsplit("/", 1)[-1])[:48]
    return folder / f"{slug}-{key}.npz"


def _write(path: Path, **arrays) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write the embedding cache {path}: {exc.strerror}; set "
                        "organization.embedding.cache_dir to a writable folder") from None


def save_table(path: Path, table: EmbeddingTable) -> None:
    q = [[r.source, r.row, r.reason.value, r.detail] for r in table.quarantined]
    _write(path, vectors=table.vectors,
           meta=np.array(json.dumps({"ids": list(table.ids), "made_by": table.made_by,
                                     "quarantined": q})))


def load_table(path: Path) -> EmbeddingTable | None:
    """The cached table, or None when there is none (a damaged file counts as none)."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            vectors = z["vectors"]
        return EmbeddingTable(tuple(meta["ids"]), vectors, meta["made_by"],
                              tuple(QuarantinedRecord(s, r, QuarantineReason(why), detail)
                                    for s, r, why, detail in meta["quarantined"]))
    except (OSError, ValueError, KeyError):
        return None


def graph_path(table_file: Path, ids: tuple, k: int) -> Path:
    h = hashlib.blake2b(json.dumps(list(ids)).encode(), digest_size=8).hexdigest()
    return table_file.with_name(f"{table_file.stem}.knn{k}-{h}.npz")


def save_graph(path: Path, graph: KnnGraph) -> None:
    _write(path, neighbors=graph.neighbors, similarity=graph.similarity,
           ids=np.array(json.dumps(list(graph.ids))))


def load_graph(path: Path) -> KnnGraph | None:
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            return KnnGraph(tuple(json.loads(str(z["ids"]))), z["neighbors"], z["similarity"])
    except (OSError, ValueError, KeyError):
        return None
