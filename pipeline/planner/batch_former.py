"""Online batch forming over a bounded window of measured samples.

The former keeps up to `buffer_size` samples sorted by length. Arrivals are staged in a list and
merged in chunks (one vectorised sort per chunk, not one insert per sample), and when the window
is full it cuts batches until there is room for the next chunk.

Which batch to cut (padded collate): for every sample j of the sorted window, the best batch with
j as its longest sample is the run of the k = budget // len(j) samples just below it (any other
choice adds padding). Its score is its real tokens `sum(len)` minus 4x its padding: unused budget
costs batches, padding costs batches *and* efficiency. The former cuts the best-scoring run. A
wide window is dense, so such runs are almost padding-free; samples from sparse lengths
(the long tail) wait until enough of their kind accumulate — the window shifts toward them, which
is what keeps the efficiency near the offline oracle's.

Packed collate has no padding: it is bin packing, done best-fit-decreasing on the window (the
longest sample, then repeatedly the longest that still fits).

Padded cutting works in rounds: one O(window) numpy scoring pass, then the best-scoring runs
that do not overlap each other are cut together (a cut leaves runs elsewhere unchanged); the
next round rescores. Packed cutting is one O(window) pass per batch. The per-sample Python work
is one list append.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from pipeline.planner.policy import BatchingPolicy
from pipeline.planner.types import MeasuredSample

_EMPTY = np.zeros(0, dtype=np.int64)
_PADDING_WEIGHT = 4


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
        self._cap = policy.buffer_size
        # Merge and cut in chunks: cut down to `cap - chunk` so the next `chunk` arrivals fit.
        self._chunk = max(1, self._cap // 16)
        self._lens = _EMPTY  # sorted ascending by (length, seq)
        self._vis = _EMPTY
        self._seqs = _EMPTY
        self._km1 = _EMPTY
        self._pos = np.arange(self._cap + 1, dtype=np.int64)
        self._objs: dict[int, MeasuredSample] = {}
        self._pending: list[MeasuredSample] = []
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._lens) + len(self._pending)

    def samples(self) -> list[MeasuredSample]:
        """Samples held, in arrival order (for snapshots: re-adding them restores the window)."""
        held = [self._objs[int(s)] for s in np.sort(self._seqs)]
        return held + list(self._pending)

    def add(self, sample: MeasuredSample) -> list[list[MeasuredSample]]:
        """Take one sample; returns the batches cut because the window filled (often none)."""
        if not 0 < sample.num_tokens <= self._budget or (
            self._vcap is not None and sample.num_visual_tokens > self._vcap
        ):
            raise ValueError(f"sample does not fit a batch on its own: {sample!r}")
        self._pending.append(sample)
        if len(self._lens) + len(self._pending) < self._cap:
            return []
        self._merge()
        out: list[list[MeasuredSample]] = []
        target = max(0, self._cap - self._chunk)
        while len(self._lens) > target:
            out.extend(self._cut_round(len(self._lens) - target))
        return out

    def flush(self) -> list[list[MeasuredSample]]:
        """Cut everything held into batches (end of epoch)."""
        self._merge()
        out: list[list[MeasuredSample]] = []
        while len(self._lens):
            out.extend(self._cut_round(len(self._lens)))
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
        vis = np.fromiter((s.num_visual_tokens for s in self._pending), dtype=np.int64, count=n)
        self._pending = []
        all_lens = np.concatenate((self._lens, lens))
        all_seqs = np.concatenate((self._seqs, seqs))
        order = np.lexsort((all_seqs, all_lens))
        self._lens = all_lens[order]
        self._seqs = all_seqs[order]
        self._vis = np.concatenate((self._vis, vis))[order]
        # k - 1 per sample, k = how many samples of its length fit the budget (>= 1).
        self._km1 = self._budget // self._lens - 1
        if len(self._pos) <= len(self._lens):
            self._pos = np.arange(2 * len(self._lens) + 1, dtype=np.int64)

    def _cut_round(self, need: int) -> list[list[MeasuredSample]]:
        """Cut batches holding at least `need` samples, or as many as one scoring pass allows.

        Padded: one scoring pass, then the best-scoring runs that do not overlap the ones already
        taken (a run elsewhere in the window is unchanged by a cut), so the O(window) numpy work
        is shared by several batches. The next round rescores what is left.
        """
        if not self._padded:
            return [self._cut_packed()]
        start, score = self._score_padded()
        order = np.argsort(-score, kind="stable").tolist()  # ties: shorter run end first
        starts = start.tolist()
        taken = bytearray(len(starts))
        runs: list[tuple[int, int]] = []
        got = 0
        for j in order:
            lo = starts[j]
            if taken.find(1, lo, j + 1) != -1:
                continue
            taken[lo : j + 1] = b"\x01" * (j + 1 - lo)
            runs.append((lo, j + 1))
            got += j + 1 - lo
            if got >= need:
                break
        keep = np.frombuffer(bytes(taken), dtype=np.uint8) == 0
        seqs = self._seqs.tolist()
        out = [[self._objs.pop(s) for s in seqs[lo:hi]] for lo, hi in runs]
        self._lens = self._lens[keep]
        self._vis = self._vis[keep]
        self._seqs = self._seqs[keep]
        self._km1 = self._km1[keep]
        return out

    def _cut_packed(self) -> list[MeasuredSample]:
        idx = self._pick_packed()
        seqs = self._seqs[idx].tolist()
        keep = np.ones(len(self._lens), dtype=bool)
        keep[idx] = False
        self._lens = self._lens[keep]
        self._vis = self._vis[keep]
        self._seqs = self._seqs[keep]
        self._km1 = self._km1[keep]
        return [self._objs.pop(s) for s in seqs]

    def _score_padded(self) -> tuple[np.ndarray, np.ndarray]:
        """For each j: the start of the best run ending at j, and that run's score."""
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
        # score = real - w * padding, padding = count * len(j) - real. Padding is weighted above
        # budget slack: slack only costs batches, padding costs batches *and* efficiency
        # (measured: w=4 -> 0.988-0.994 padding efficiency at buffer 2048 with <= 1% more
        # batches than the global-sort oracle).
        score = (1 + _PADDING_WEIGHT) * real - _PADDING_WEIGHT * (pos - start + 1) * lens
        return start, score

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
