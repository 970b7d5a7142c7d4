"""Samples already in memory (tokenized elsewhere, or synthetic token arrays): a real source for
tests and benchmarks where Ray is not the point.

It yields the same samples in the same order every time an epoch is (re)read, and
`get(sample_id, epoch)` returns exactly the payload that `iter_epoch(epoch)` yielded (the
production path, Ray Data preprocessing, keeps that promise through `SampleStore`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord

SourceItem = ProcessedSample | QuarantinedRecord


class ArraySource:
    """In-memory samples; identical in every epoch (no augmentation)."""

    def __init__(self, items: Sequence[SourceItem]) -> None:
        self._items = list(items)
        self._by_id = {s.sample_id: s for s in self._items if isinstance(s, ProcessedSample)}

    def __len__(self) -> int:
        return len(self._items)

    def iter_epoch(self, epoch: int, start_row: int = 0) -> Iterator[SourceItem]:
        return iter(self._items[start_row:])

    def get(self, sample_id: str, epoch: int) -> ProcessedSample:
        try:
            return self._by_id[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id!r} is not in this source") from None

    def close(self) -> None:
        pass


def synthetic_samples(
    n: int, *, seed: int = 0, min_len: int = 16, max_len: int = 512, vocab: int = 32000,
    source: str = "synthetic", lengths: Sequence[int] | None = None,
) -> list[ProcessedSample]:
    """Deterministic token arrays with log-uniform lengths; labels mask the first third."""
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = np.exp(rng.uniform(np.log(min_len), np.log(max_len), size=n)).astype(int)
    out = []
    for row, length in enumerate(lengths):
        ids = rng.integers(1, vocab, size=int(length), dtype=np.int32)
        labels = ids.copy()
        labels[: int(length) // 3] = -100
        out.append(ProcessedSample(f"{source}:{row}", source, row, ids, labels,
                                   cost=int(length)))
    return out
