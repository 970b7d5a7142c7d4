"""The embedding stage on real data with the real packaged model, under the real Ray: vectors
are the model's, computed once and read back from the cache; a named column is read and
checked record by record; bad settings fail in one line naming the setting."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.config import TrainingJobConfig
from pipeline.organization import embedding_cache
from pipeline.organization.embed_stage import EmbeddingError, embed_dataset
from pipeline.organization.embedding_text import conversation_text, decode_record
from pipeline.organization.encoder import Encoder, EncoderError
from pipeline.preprocess.records import parse_record
from pipeline.sample_data import IMAGES_DIR, SAMPLE_CHATS

FIRST, ROWS = 50, 24  # rows 53 (no assistant turn) and 89 (bad UTF-8) are in 50..89


def _job(path, **embedding) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({
        "job_id": "t", "world_size": 1, "source": {"paths": [str(path)]},
        "organization": {"kind": "sdo", "embedding": embedding}})


@pytest.fixture(autouse=True)
def _cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def chats(tmp_path):
    lines = SAMPLE_CHATS.read_bytes().split(b"\n")[FIRST:FIRST + 40]
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b"\n".join(lines[:ROWS]) + b"\n" + lines[39] + b"\n")
    (tmp_path / "images").symlink_to(IMAGES_DIR)
    return path


def test_model_embeddings_are_computed_once_then_read_from_the_cache(chats, ray_session):
    job = _job(chats)
    first = embed_dataset(job)
    t = first.table
    assert not first.cached and first.path.is_file()
    # In the cache dir, never beside the data (a dataset in a checkout leaves it clean).
    assert first.path.parent == chats.parent / "cache" / "odb-pipeline" / "embeddings"
    assert t.dim == 384 and len(t.ids) == ROWS - 1
    assert np.allclose(np.linalg.norm(t.vectors, axis=1), 1.0, atol=1e-5)
    assert {(q.row, q.reason) for q in t.quarantined} == {(3, "missing_roles"),
                                                          (ROWS, "bad_utf8")}
    assert f"{chats}:3" not in t.row
    # The vectors are what the model says for the record's turns.
    raw = chats.read_bytes().split(b"\n")[0]
    want = Encoder("all-MiniLM-L6-v2").encode([conversation_text(parse_record(
        decode_record(raw)))])[0]
    assert float(t.vector(f"{chats}:0") @ want) > 0.999

    # Mark the cache: a second run returns the marked vectors, so it computed nothing.
    marked = np.zeros_like(t.vectors)
    marked[:, 0] = 1.0
    embedding_cache.save_table(first.path, type(t)(t.ids, marked, t.made_by, t.quarantined))
    second = embed_dataset(job)
    assert second.cached and second.path == first.path
    assert np.array_equal(second.table.vectors, marked)
    assert second.table.quarantined == t.quarantined

    # Other content or another row limit is another key.
    chats.write_bytes(chats.read_bytes() + chats.read_bytes().split(b"\n")[0] + b"\n")
    assert embed_dataset(job, limit=5).path != first.path


def test_column_vectors_are_checked_record_by_record(tmp_path, ray_session):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": "a"}], "emb": [1.0, float(i), 0.5]}
            for i in range(6)]
    rows[1]["emb"] = [1.0, float("nan"), 0.0]
    rows[2]["emb"] = [[1.0, 2.0], [3.0]]
    rows[3]["emb"] = [1.0, 2.0]
    del rows[4]["emb"]
    path = tmp_path / "vec.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = embed_dataset(_job(path, column="emb")).table
    assert t.ids == (f"{path}:0", f"{path}:5") and t.dim == 3 and t.made_by == "column:emb"
    why = {q.row: q.detail for q in t.quarantined}
    assert all(q.reason == "bad_embedding" for q in t.quarantined)
    assert set(why) == {1, 2, 3, 4}
    assert "NaN" in why[1] and "ragged" in why[2] and "expected dimension 3" in why[3]
    assert "no field 'emb'" in why[4]


def test_a_column_no_record_has_names_the_setting(tmp_path, ray_session):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    with pytest.raises(EmbeddingError, match=r"organization\.embedding\.column 'vec'"):
        embed_dataset(_job(path, column="vec"))


def test_a_model_that_cannot_be_loaded_names_the_setting(tmp_path, chats, ray_session):
    with pytest.raises(EncoderError, match=r"organization\.embedding\.model 'no-such-model'"):
        embed_dataset(_job(chats, model="no-such-model"))
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(EncoderError, match=r"organization\.embedding\.model .*cannot load"):
        embed_dataset(_job(chats, model=str(broken)))


def test_config_takes_one_embedding_source():
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="one of model or column"):
        load_config(overrides={"jobs": [{
            "job_id": "a", "world_size": 1, "source": {"paths": ["x"]},
            "organization": {"embedding": {"model": "m", "column": "c"}}}]})
    with pytest.raises(ConfigError, match="locality"):
        load_config(overrides={"jobs": [{
            "job_id": "a", "world_size": 1, "source": {"paths": ["x"]},
            "organization": {"locality": 1.5}}]})
