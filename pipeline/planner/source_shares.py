"""Each mixture source's share of what the planner emits: targets, running deficits, picking.

The epoch's order already interleaves the sources at their shares (pipeline/order/); the
planner's window then reorders ~128 budgets of samples by length, and a source with longer (or
more spread) samples lags: measured on two sources of equal length distributions but different
spread, the last tenth of an epoch held 0.59 of one source against its 0.50
(docs/data-order.md). `SourceShares` tells the planner, at the one point where it decides which
formed unit goes next (a step of a pool, a micro-batch of a global step), which of the candidate
units keeps every source closest to its target.

- Counted in samples (`mix_by: samples`) or in loss tokens (`mix_by: loss_tokens`).
- Targets, a share per source:
  - samples: each source's part of the stretch since the counts last changed (the epoch's
    start, or a mixture change: what was read before it plus the new counts of the rest, less
    what was emitted before it), fixed and exact: what the planner still holds of an old mix
    is spread over the rest;
  - loss tokens: each source's part of what the epoch has left to emit, a source's tokens
    being its count times its mean loss tokens so far (`observe`: every sample fed), since the
    tokens an epoch holds are known only once it is measured. Of what is left, so the error of
    an early estimate is spread over the rest of the epoch, never made up for in a burst.
- Deficits accumulate per unit taken against the targets in force when it is taken (a target
  that moves, a better estimate, steers what comes next without a jump); new counts start them
  again.
- `pick` returns the candidate whose taking leaves the smallest squared deficit; ties go to the
  first candidate (the planner's own order), so with one source, or equal candidates, nothing
  changes.

The mechanism was chosen from bench/order_bench.py's numbers (docs/data-order.md). Pure and
deterministic; `snapshot`/`restore` carry it in the planner's state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.planner.types import MeasuredSample

MIX_BY = ("samples", "loss_tokens")


class SourceShares:
    def __init__(self, sources: int, by: str = "samples") -> None:
        if sources < 1:
            raise ValueError(f"sources must be >= 1, got {sources}")
        if by not in MIX_BY:
            raise ValueError(f"by must be one of {MIX_BY}, got {by!r}")
        self.sources = sources
        self.by = by
        self._counts = [1.0] * sources  # the samples of each source the epoch holds
        self._fed_tokens = [0] * sources
        self._fed_samples = [0] * sources
        self.taken = [0] * sources  # samples or loss tokens taken this epoch, per source
        self.anchor = [0] * sources  # `taken` when the counts last changed
        self.deficit = [0.0] * sources  # taken - target share of what was taken, per source

    # -- targets ----------------------------------------------------------------------------

    def set_counts(self, counts: Sequence[int]) -> None:
        """The samples of each source the epoch holds (the order's counts; after a mixture
        change, what was read of each before it plus the rest's new counts). The same counts
        again (a restarted producer sets them once more) change nothing."""
        if len(counts) != self.sources or min(counts) < 0 or sum(counts) <= 0:
            raise ValueError(f"counts must be {self.sources} values >= 0 summing to > 0, got "
                             f"{list(counts)}")
        if [float(c) for c in counts] != self._counts:
            self._counts = [float(c) for c in counts]
            self.anchor = list(self.taken)
            self.deficit = [0.0] * self.sources

    def observe(self, sample: MeasuredSample) -> None:
        """A sample fed to the planner (its source's mean loss tokens, for token targets)."""
        self._fed_samples[sample.source] += 1
        self._fed_tokens[sample.source] += sample.loss_tokens

    def targets(self) -> list[float]:
        """Each source's target share of what goes next (summing to 1)."""
        if self.by == "samples":
            w = [max(0.0, c - a) for c, a in zip(self._counts, self.anchor, strict=True)]
        else:
            # A source's tokens: its count times its mean loss tokens so far (a source not yet
            # seen counts at the mean of those seen, so it is not starved before it is).
            seen = [t / n for t, n in zip(self._fed_tokens, self._fed_samples, strict=True) if n]
            fallback = sum(seen) / len(seen) if seen else 1.0
            w = [max(0.0, c * (t / n if n else fallback) - taken) for c, t, n, taken in
                 zip(self._counts, self._fed_tokens, self._fed_samples, self.taken,
                     strict=True)]
        total = sum(w)
        if total <= 0:
            return [1.0 / self.sources] * self.sources
        return [x / total for x in w]

    # -- picking ----------------------------------------------------------------------------

    def amounts(self, samples: Sequence[MeasuredSample]) -> list[int]:
        """What a unit of these samples adds per source (samples or loss tokens)."""
        out = [0] * self.sources
        for s in samples:
            out[s.source] += 1 if self.by == "samples" else s.loss_tokens
        return out

    def pick(self, candidates: Sequence[Sequence[MeasuredSample]]) -> int:
        """The index of the candidate whose taking leaves the smallest squared deficit (the
        first of equals)."""
        if not candidates:
            raise ValueError("no candidates to pick from")
        if self.sources == 1:
            return 0
        return self.pick_amounts([self.amounts(c) for c in candidates])

    def pick_amounts(self, amounts: Sequence[Sequence[int]]) -> int:
        """`pick` for candidates given by what each adds per source (`amounts`)."""
        a = np.asarray(amounts, dtype=np.float64).reshape(len(amounts), self.sources)
        t = np.asarray(self.targets())
        after = np.asarray(self.deficit) + a - t[None, :] * a.sum(axis=1, keepdims=True)
        score = (after * after).sum(axis=1)
        # The first of those within rounding of the best (float sums of the same integers).
        return int(np.flatnonzero(score <= score.min() + 1e-9)[0])

    def take(self, samples: Sequence[MeasuredSample]) -> None:
        """A unit of these samples was emitted: deficits move against the targets in force."""
        add = self.amounts(samples)
        total = sum(add)
        for i, t in enumerate(self.targets()):
            self.deficit[i] += add[i] - t * total
            self.taken[i] += add[i]

    def reset_epoch(self) -> None:
        """A new epoch: what was taken, deficits and token means start again (its counts come
        with it)."""
        self._fed_tokens = [0] * self.sources
        self._fed_samples = [0] * self.sources
        self.taken = [0] * self.sources
        self.anchor = [0] * self.sources
        self.deficit = [0.0] * self.sources

    # -- state ------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {"by": self.by, "counts": list(self._counts), "fed_tokens": list(self._fed_tokens),
                "fed_samples": list(self._fed_samples), "deficit": list(self.deficit),
                "taken": list(self.taken), "anchor": list(self.anchor)}

    @classmethod
    def restore(cls, d: dict) -> SourceShares:
        s = cls(len(d["counts"]), d["by"])
        s._counts = [float(x) for x in d["counts"]]
        s._fed_tokens = [int(x) for x in d["fed_tokens"]]
        s._fed_samples = [int(x) for x in d["fed_samples"]]
        s.deficit = [float(x) for x in d["deficit"]]
        s.taken = [int(x) for x in d["taken"]]
        s.anchor = [int(x) for x in d["anchor"]]
        return s
