"""The Ray Data stage that computes a dataset's frozen embeddings once, or reads them from the
column the job names; the cache makes every later run (and every epoch) a file read.

Plan: the same chunks of whole rows as preprocessing (`sources.plan_chunks`), one chunk per
block, mapped by an actor pool (the model loads once per actor). Each row becomes a vector or a
quarantined record with its reason; the driver collects them in stream order into an
`EmbeddingTable`. Column vectors take the dimension most rows have; rows of another dimension
are quarantined as `bad_embedding`. Setting errors (a column no record has, a model that does not
load) raise `EmbeddingError`/`EncoderError` naming the setting. Ray must be initialized.
"""

from __future__ import annotations

import pickle
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.config import TrainingJobConfig
from pipeline.errors import UserError
from pipeline.organization import embedding_cache
from pipeline.organization.embedding_table import (
    BAD_EMBEDDING,
    BadVector,
    EmbeddingTable,
    check_vector,
)
from pipeline.organization.embedding_text import TEXT_RECIPE, conversation_text, decode_record
from pipeline.organization.encoder import DEFAULT_MODEL, Encoder, EncoderError, resolve_model
from pipeline.preprocess.process import make_sample_id
from pipeline.preprocess.records import RecordError, parse_record
from pipeline.preprocess.sample import QuarantinedRecord
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
from pipeline.quarantine import QuarantineReason

CHUNK_ROWS = 256
_SCHEMA = pa.schema([("sample_id", pa.string()), ("vector", pa.binary()),
                     ("reason", pa.string()), ("detail", pa.string())])


class EmbeddingError(UserError):
    """The embedding settings cannot work for this dataset; names the setting."""


@dataclass(frozen=True)
class Embeddings:
    table: EmbeddingTable
    path: Path  # the cache file
    cached: bool  # True: read from the cache, nothing computed


class _EmbedChunks:
    """Ray Data callable class: rows of a chunk -> (sample_id, vector | reason)."""

    def __init__(self, model: str | None, column: str | None) -> None:
        self.column = column
        self.encoder = None if column else Encoder(model or DEFAULT_MODEL)

    def _row(self, raw) -> tuple[str | None, np.ndarray | None]:
        rec = decode_record(raw)
        if self.column is not None:
            if self.column not in rec:
                raise BadVector(f"no field {self.column!r}")
            return None, check_vector(rec[self.column])
        return conversation_text(parse_record(rec)), None

    def __call__(self, batch: pa.Table) -> pa.Table:
        sids, vecs, reasons, details = [], [], [], []
        texts: list[str] = []
        slots: list[int] = []
        for blob in batch.column("chunk").to_pylist():
            chunk = pickle.loads(blob)
            for row, raw in read_chunk(chunk):
                sids.append(make_sample_id(chunk.file.source, row))
                reason = detail = ""
                vec = b""
                try:
                    text, v = self._row(raw)
                    if v is not None:
                        vec = v.tobytes()
                    else:
                        texts.append(text or "")
                        slots.append(len(vecs))
                except RecordError as exc:
                    reason, detail = exc.reason.value, exc.detail
                except BadVector as exc:
                    reason, detail = BAD_EMBEDDING.value, f"column {self.column!r}: {exc}"
                vecs.append(vec)
                reasons.append(reason)
                details.append(detail)
        if self.encoder is not None and texts:
            for slot, v in zip(slots, self.encoder.encode(texts), strict=True):
                try:
                    vecs[slot] = check_vector(v, self.encoder.dim).tobytes()
                except BadVector as exc:  # a model that yields NaN for some input
                    reasons[slot], details[slot] = BAD_EMBEDDING.value, f"model output {exc}"
        return pa.table([sids, vecs, reasons, details], schema=_SCHEMA)


def _quarantine(sid: str, reason: str, detail: str) -> QuarantinedRecord:
    source, _, row = sid.rpartition(":")
    return QuarantinedRecord(source, int(row), QuarantineReason(reason), detail)


def _collect(rows: list[tuple[str, bytes, str, str]], made_by: str,
             column: str | None) -> EmbeddingTable:
    quarantined: list[QuarantinedRecord] = []
    good: list[tuple[str, np.ndarray]] = []
    for sid, vec, reason, detail in rows:
        if reason:
            quarantined.append(_quarantine(sid, reason, detail))
        else:
            good.append((sid, np.frombuffer(vec, dtype=np.float32)))
    if column is not None:
        if rows and not good and all(q.reason == BAD_EMBEDDING for q in quarantined) and all(
                "no field" in q.detail for q in quarantined):
            raise EmbeddingError(f"organization.embedding.column {column!r}: no record has "
                                 f"this field (first record: {rows[0][0]})")
        dims = Counter(len(v) for _, v in good)
        if len(dims) > 1:
            dim = dims.most_common(1)[0][0]
            kept = []
            for sid, v in good:
                if len(v) == dim:
                    kept.append((sid, v))
                else:
                    quarantined.append(_quarantine(
                        sid, BAD_EMBEDDING, f"column {column!r}: {len(v)} values, expected "
                        f"dimension {dim} (what most records have)"))
            good = kept
    if not good:
        raise EmbeddingError("organization.embedding: no record got a usable vector "
                             f"({len(quarantined)} quarantined, e.g. "
                             f"{quarantined[0].sample_id if quarantined else 'none'})")
    ids = tuple(sid for sid, _ in good)
    vectors = np.stack([v for _, v in good]).astype(np.float32)
    quarantined.sort(key=lambda q: (q.source, q.row))
    return EmbeddingTable(ids, vectors, made_by, tuple(quarantined))


def embed_dataset(job: TrainingJobConfig, *, limit: int | None = None,
                  concurrency: int | None = None) -> Embeddings:
    """The job's embeddings: from the cache when present, else computed (and cached)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialized: call ray.init(...) before embedding")
    cfg = job.organization.embedding
    files = expand_sources(job.source)
    if cfg.column is not None:
        made_by = f"column:{cfg.column}"
    else:
        made_by, _ = resolve_model(cfg.model or DEFAULT_MODEL)  # fails fast, before Ray
    key = embedding_cache.content_key(files, made_by, TEXT_RECIPE, limit)
    path = embedding_cache.table_path(embedding_cache.cache_dir(job), made_by, key)
    table = embedding_cache.load_table(path)
    if table is not None:
        return Embeddings(table, path, cached=True)

    chunks = plan_chunks(files, CHUNK_ROWS, 0, limit)
    rows: list[tuple[str, bytes, str, str]] = []
    if chunks:
        ds = ray.data.from_items([{"chunk": pickle.dumps(c)} for c in chunks],
                                 override_num_blocks=len(chunks))
        ctx = ds.context
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        n = min(concurrency or max(1, int(ray.cluster_resources().get("CPU", 1))), len(chunks))
        # No actor restarts: a restartable actor whose constructor arguments are in the object
        # store (Ray Data puts every pool's there) makes Ray print "the actor restart will fail"
        # at every start; an embedding actor that dies fails the embedding, which its caller
        # retries (the cache keeps nothing half-made). (Ray 2.60 takes max_restarts as an extra
        # remote argument and warns that those are deprecated.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated")
            ds = ds.map_batches(_EmbedChunks, fn_constructor_args=(cfg.model, cfg.column),
                                compute=ray.data.ActorPoolStrategy(size=n), batch_size=1,
                                batch_format="pyarrow", num_cpus=1, max_restarts=0)
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                rows += zip(*(batch.column(c).to_pylist() for c in _SCHEMA.names), strict=True)
        except Exception as exc:
            # A model that fails to load in the actors arrives wrapped by Ray: say it in one line.
            msg = str(exc)
            if "EncoderError" in msg or "organization.embedding.model" in msg:
                line = next((ln for ln in msg.splitlines() if "organization.embedding" in ln),
                            msg.splitlines()[-1])
                raise EncoderError(line.split("EncoderError: ")[-1].strip()) from None
            raise
    table = _collect(rows, made_by, cfg.column)
    embedding_cache.save_table(path, table)
    return Embeddings(table, path, cached=False)
