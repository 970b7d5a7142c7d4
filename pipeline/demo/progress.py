"""The demo's progress on stderr: which phase it is in, and how far a measurable phase has got.

Start-up phases (starting Redis, starting Ray, starting the service, preparing the fixed-size
batches) print a line when they begin and their duration when they end. While trainer ranks run,
one bar per measured phase: `preprocessing` (source rows the producer turned into samples or
quarantined) and `training` (samples the ranks trained on). Nothing sits at 0% unexplained.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO


@dataclass(frozen=True)
class Measure:
    """One measured phase at one moment: `done` of `total` `unit`s."""

    phase: str
    unit: str
    done: int
    total: int


def preprocessing_measure(rows: int, samples_in: int, quarantined: int,
                          planned: bool) -> Measure:
    """Rows preprocessed of `rows` (source rows x epochs): the producer's counters, complete
    once the job is fully planned (quarantine counts a bad record once over all epochs)."""
    done = rows if planned else min(rows, samples_in + quarantined)
    return Measure("preprocessing", "row", done, rows)


def training_measure(trained: int, expected: int) -> Measure:
    return Measure("training", "sample", min(trained, expected), expected)


class Progress:
    def __init__(self, out: TextIO = sys.stderr) -> None:
        self.out = out

    def say(self, text: str) -> None:
        print(f"demo: {text}", file=self.out, flush=True)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A phase without a measure: its name now, its duration at the end."""
        self.say(f"{name} ...")
        t0 = time.monotonic()
        yield
        self.say(f"{name}: done in {time.monotonic() - t0:.1f} s")

    @contextmanager
    def bars(self, label: str) -> Iterator[Bars]:
        bars = Bars(label, self.out)
        try:
            yield bars
        finally:
            bars.close()


class Bars:
    """One tqdm bar per measured phase, created at its first measure."""

    def __init__(self, label: str, out: TextIO) -> None:
        self.label, self.out = label, out
        self._bars: dict[str, Any] = {}

    def show(self, measures: list[Measure]) -> None:
        from tqdm import tqdm

        for m in measures:
            bar = self._bars.get(m.phase)
            if bar is None:
                bar = self._bars[m.phase] = tqdm(
                    total=m.total, desc=f"{m.phase} ({self.label})", unit=m.unit,
                    file=self.out, position=len(self._bars), leave=True, dynamic_ncols=True)
            if bar.total != m.total:
                bar.total = m.total
            bar.update(m.done - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
