"""Online batch forming over a bounded window of measured samples.

The window holds about `lookahead_tokens` tokens of samples (and at most `max_window_samples`
samples), sorted by length. Bounding tokens rather than samples makes a batch take the same share
of the window whatever the lengths: a window of short samples holds many candidates, one of long
documents holds few (and its memory follows the tokens). Arrivals are staged in a list and merged
in chunks (one vectorised sort per chunk, not one insert per sample); when either bound is
reached the former cuts batches until 1/16 of each bound is free again.

Which batch to cut (padded collate): for every sample j of the sorted window, the best batch with
j as its longest sample is the run of the k = budget // len(j) samples just below it (any other
choice adds padding). Its score is `(real - padding) / (k * len(j))`: the batch measured against
the best batch its longest sample allows. A long sample that must go alone scores 1 at once (it
can never get better, so it does not sit in the window), a dense run of short samples scores
close to 1, a run that spans a sparse length range (or is short of k samples) scores low and
waits for more of its kind. The former cuts the best-scoring runs; the window shifts toward
the samples still waiting, which is what keeps the efficiency near the offline oracle's
(an absolute score — real tokens minus padding — kept long samples waiting for nothing: on
heavy-tailed data half the window's tokens were such stragglers).

At the end of an epoch nothing waits for better company: `flush` cuts what is held longest
first, the GMT oracle's greedy cut, which needs the fewest batches for a given set of samples
(padded cost without a visual cap; the exchange argument: any batch holding the longest sample
can take the next longest ones instead without breaking the budget). Cutting the last window
by score left fragments behind: on epochs the window holds almost whole, 3% more batches than
the oracle (bench/planner_bench.py, "epoch sizes").

With `pad_to_multiple` the former works on the lengths as sent (each rounded up to the
multiple: `CostModel.sent_length`), so its batches fit the budget padding included.

Packed collate has no padding: it is bin packing, done best-fit-decreasing on the window (the
longest sample, then repeatedly the longest that still fits).

Padded cutting works in rounds: one O(window) numpy scoring pass, then the best-scoring runs
that do not overlap each other are cut together (a cut leaves runs elsewhere unchanged); the
next round rescores. Packed cutting is one O(window) pass per batch. The per-sample Python work
is one list append.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.types import MeasuredSample

_EMPTY = np.zeros(0, dtype=np.int64)


class BatchFormer:
    """Window of in-budget samples -> batches (lists of samples) under the policy's caps.

    Every sample given to `add` must fit a batch on its own (the step planner applies the
    over-budget policy first). Deterministic: ties are broken by arrival order.
    """

    def __init__(self, policy: BatchingPolicy) -> None:
        self.policy = policy
        self._budget = policy.token_budget
        self._vcap = policy.max_visual_tokens
        self._padded = policy.cost_model.padded
        self._multiple = policy.cost_model.pad_to_multiple
        self._sent = policy.cost_model.sent_length
        self._max_alone = policy.max_alone_tokens  # n fits alone iff n <= this (padded)
        self._cap_samples = policy.max_window_samples
        # Merge and cut in chunks: cut down to 15/16 of either bound so the next arrivals fit.
        self._target_samples = self._cap_samples - max(1, self._cap_samples // 16)
        self.limit_tokens(policy.lookahead_tokens)
        self._lens = _EMPTY  # sorted ascending by (length, seq)
        self._vis = _EMPTY
        self._seqs = _EMPTY
        self._km1 = _EMPTY
        self._inv_ideal = np.zeros(0)
        self._pos = np.arange(1025, dtype=np.int64)
        self._objs: dict[int, MeasuredSample] = {}
        self._pending: list[MeasuredSample] = []
        self._tokens = 0  # tokens held (window + pending)
        self._next_seq = 0

    def limit_tokens(self, cap: int) -> None:
        """Bound the window at `cap` tokens (at most `lookahead_tokens`, at least one budget):
        the planner's ramp at an epoch's start. Takes effect at the next arrival."""
        self._cap_tokens = max(self._budget, min(int(cap), self.policy.lookahead_tokens))
        self._target_tokens = self._cap_tokens - max(1, self._cap_tokens // 16)

    def __len__(self) -> int:
        return len(self._lens) + len(self._pending)

    @property
    def tokens(self) -> int:
        """Tokens held: what `lookahead_tokens` bounds."""
        return self._tokens

    def samples(self) -> list[MeasuredSample]:
        """Samples held, in arrival order (for snapshots: re-adding them restores the window)."""
        held = [self._objs[int(s)] for s in np.sort(self._seqs)]
        return held + list(self._pending)

    def add(self, sample: MeasuredSample) -> list[list[MeasuredSample]]:
        """Take one sample; returns the batches cut because the window filled (often none)."""
        if not 0 < sample.num_tokens <= self._max_alone or (
            self._vcap is not None and sample.num_visual_tokens > self._vcap
        ):
            raise ValueError(f"sample does not fit a batch on its own: {sample!r}")
        self._pending.append(sample)
        m = self._multiple
        self._tokens += sample.num_tokens if m == 1 else -(-sample.num_tokens // m) * m
        if self._tokens < self._cap_tokens and len(self) < self._cap_samples:
            return []
        self._merge()
        out: list[list[MeasuredSample]] = []
        while self._tokens > self._target_tokens or len(self._lens) > self._target_samples:
            out.extend(self._cut_round(self._tokens - self._target_tokens,
                                       len(self._lens) - self._target_samples))
        return out

    def flush(self, also: Sequence[MeasuredSample] = ()) -> list[list[MeasuredSample]]:
        """Cut everything held, and the samples `also` (formed batches given back: whatever
        their number, they join the window whole), into batches (end of epoch).

        Padded: longest first, each batch the longest sample left and the samples just below
        it that fit (GMT's cut, see the module docstring). Packed: best-fit-decreasing.
        """
        self._pending.extend(also)
        self._tokens += sum(self._sent(x.num_tokens) for x in also)
        self._merge()
        if not self._padded:
            out: list[list[MeasuredSample]] = []
            while len(self._lens):
                out.append(self._cut_packed())
            return out
        # A run's start depends only on the samples below it, so one scoring pass serves the
        # whole walk down the window.
        start = self._score_padded()[0].tolist()
        seqs = self._seqs.tolist()
        out = []
        hi = len(seqs)
        while hi:
            lo = start[hi - 1]
            out.append([self._objs.pop(s) for s in seqs[lo:hi]])
            hi = lo
        self._keep(np.zeros(len(seqs), dtype=bool))
        return out

    # -- internals ---------------------------------------------------------------------------

    def _merge(self) -> None:
        if not self._pending:
            return
        n = len(self._pending)
        seqs = np.arange(self._next_seq, self._next_seq + n, dtype=np.int64)
        self._objs.update(
            zip(range(self._next_seq, self._next_seq + n), self._pending, strict=True)
        )
        self._next_seq += n
        lens = np.fromiter((s.num_tokens for s in self._pending), dtype=np.int64, count=n)
        if self._multiple > 1:  # the lengths as sent: every cost below is on them
            lens = -(-lens // self._multiple) * self._multiple
        vis = np.fromiter((s.num_visual_tokens for s in self._pending), dtype=np.int64, count=n)
        self._pending = []
        # k - 1 per sample, k = how many samples of its length fit the budget (>= 1); and the
        # reciprocal of its ideal batch's padded size k * len.
        km1 = self._budget // lens - 1
        inv_ideal = 1.0 / ((km1 + 1) * lens)
        all_lens = np.concatenate((self._lens, lens))
        # A stable sort by length is the (length, seq) order: the window is already in that
        # order and every new seq is larger. Timsort merges the two sorted runs in O(n).
        order = np.argsort(all_lens, kind="stable")
        self._lens = all_lens[order]
        self._seqs = np.concatenate((self._seqs, seqs))[order]
        self._vis = np.concatenate((self._vis, vis))[order]
        self._km1 = np.concatenate((self._km1, km1))[order]
        self._inv_ideal = np.concatenate((self._inv_ideal, inv_ideal))[order]
        if len(self._pos) <= len(self._lens):
            self._pos = np.arange(2 * len(self._lens) + 1, dtype=np.int64)

    def _cut_round(self, need_tokens: int, need_samples: int) -> list[list[MeasuredSample]]:
        """Cut batches holding at least `need_tokens` tokens and `need_samples` samples, or as
        many as one scoring pass allows.

        Padded: one scoring pass, then the best-scoring runs that do not overlap the ones already
        taken (a run elsewhere in the window is unchanged by a cut), so the O(window) numpy work
        is shared by several batches. The next round rescores what is left.
        """
        if not self._padded:
            return [self._cut_packed()]
        start, score, cs = self._score_padded()
        n = len(score)
        # Only the best candidates can be taken: runs overlap their neighbours, so each cut
        # skips some. Sorting the top `m` (ties: shorter run end first) instead of all of them
        # keeps the round O(window) in numpy; a round that runs short is followed by another.
        m = min(n, 64 + 4 * max(need_samples, need_tokens // max(1, int(cs[-1]) // n)))
        top = np.argpartition(-score, m - 1)[:m] if m < n else np.arange(n)
        order = top[np.lexsort((top, -score[top]))].tolist()
        starts = start.tolist()
        taken = bytearray(n)
        runs: list[tuple[int, int]] = []
        got_tokens = got_samples = 0
        for j in order:
            lo = starts[j]
            if taken.find(1, lo, j + 1) != -1:
                continue
            taken[lo : j + 1] = b"\x01" * (j + 1 - lo)
            runs.append((lo, j + 1))
            got_tokens += int(cs[j + 1] - cs[lo])
            got_samples += j + 1 - lo
            if got_tokens >= need_tokens and got_samples >= need_samples:
                break
        seqs = self._seqs
        out = [[self._objs.pop(s) for s in seqs[lo:hi].tolist()] for lo, hi in runs]
        self._keep(np.frombuffer(bytes(taken), dtype=np.uint8) == 0)
        return out

    def _cut_packed(self) -> list[MeasuredSample]:
        idx = self._pick_packed()
        seqs = self._seqs[idx].tolist()
        keep = np.ones(len(self._lens), dtype=bool)
        keep[idx] = False
        self._keep(keep)
        return [self._objs.pop(s) for s in seqs]

    def _keep(self, keep: np.ndarray) -> None:
        """Keep the window's samples where `keep` is True (the others were cut)."""
        self._tokens -= int(self._lens[~keep].sum())
        self._lens = self._lens[keep]
        self._vis = self._vis[keep]
        self._seqs = self._seqs[keep]
        self._km1 = self._km1[keep]
        self._inv_ideal = self._inv_ideal[keep]

    def _score_padded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each j: the start of the best run ending at j, that run's score; and the prefix
        sums of the lengths."""
        lens = self._lens
        n = len(lens)
        cs = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=cs[1:])
        pos = self._pos[:n]
        start = pos - self._km1
        np.maximum(start, 0, out=start)
        if self._vcap is not None:
            cv = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(self._vis, out=cv[1:])
            # Smallest start s with cv[j+1] - cv[s] <= cap (cv is non-decreasing).
            start = np.maximum(start, np.searchsorted(cv, cv[1:] - self._vcap, side="left"))
        real = cs[1:] - cs[start]
        # (real - padding) / ideal, padding = count * len(j) - real: see the module docstring.
        score = (2 * real - (pos - start + 1) * lens) * self._inv_ideal
        return start, score, cs

    def _pick_packed(self) -> np.ndarray:
        lens = self._lens.tolist()
        vis = self._vis
        n = len(lens)
        picks = [n - 1]
        room = self._budget - lens[-1]
        vroom = None if self._vcap is None else self._vcap - int(vis[-1])
        hi = n - 1
        while room > 0 and hi > 0:
            i = bisect_right(lens, room, 0, hi) - 1
            if i < 0:
                break
            if vroom is not None and int(vis[i]) > vroom:
                hi = i  # too many visual tokens; try the next shorter one
                continue
            picks.append(i)
            room -= lens[i]
            if vroom is not None:
                vroom -= int(vis[i])
            hi = i
        return np.array(sorted(picks), dtype=np.int64)
