"""A small local vocabulary over the Qwen tokenizer's ids: the most frequent ids of the training
text keep their own entry, every other id is UNK. The service speaks Qwen ids (the real tokenizer
and chat template); the tiny model only needs a few thousand."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

PAD, MASK, UNK = 0, 1, 2
SPECIAL = 3


class Vocab:
    def __init__(self, qwen_ids: list[int]) -> None:
        self.qwen_ids = list(qwen_ids)  # local id - SPECIAL -> Qwen id
        self._local = {q: i + SPECIAL for i, q in enumerate(self.qwen_ids)}
        self._lut: np.ndarray | None = None

    @classmethod
    def fit(cls, sequences: Iterable[np.ndarray], size: int) -> Vocab:
        counts: Counter[int] = Counter()
        for s in sequences:
            counts.update(s.tolist())
        return cls([q for q, _ in counts.most_common(size - SPECIAL)])

    def __len__(self) -> int:
        return len(self.qwen_ids) + SPECIAL

    def encode(self, qwen: np.ndarray) -> np.ndarray:
        return np.array([self._local.get(int(q), UNK) for q in qwen], dtype=np.int64)

    def decode(self, local: np.ndarray) -> np.ndarray:
        table = np.array([-1] * SPECIAL + self.qwen_ids, dtype=np.int64)
        return table[local]
