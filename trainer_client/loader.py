"""`StreamLoader`: a rank's stream as a dataloader — one epoch per pass, checkpointable with
torchdata `StatefulDataLoader`'s conventions, optionally aligned for runtimes without Join.

    loader = StreamLoader(stream, align=True)
    for epoch in range(epochs):
        for batch in loader:                # StreamBatch; batch.info.filler on filler steps
            ...
    ckpt["data"] = loader.state_dict()      # restore: loader.load_state_dict(ckpt["data"])

State (StatefulDataLoader's behaviour and key names where they mean the same thing):
`state_dict()` may be called at any time, before the first pass too, and describes the batches
yielded so far; `load_state_dict(sd)` takes effect at the next `iter()`, and `{}` changes
nothing. `_num_yielded` counts the batches (fillers included) the current pass yielded,
`_iterator_finished` whether it ran to the epoch's end: a pass after a finished one starts the
next epoch, and so does the first pass after loading a finished state. `dataset_state` is the
stream's own `state_dict()`; `odb_*` keys hold the pass's place in the plan. One difference:
the stream cannot rewind, so a new pass over an unfinished epoch continues it rather than
starting it again, and a resumed pass that finds nothing left of its epoch goes on with the
next one (an empty pass would read as the end of the data). An aligned loader's state is the
same on every rank, so runtimes that checkpoint from rank 0 only (Lightning) restore every rank
from it. Each yielded batch carries
`batch.loader_state`, the state right after it: a runtime that fetches ahead of the step it
trains (Lightning prefetches one batch) checkpoints the state of the batch it trained instead.

Alignment (`align=True`): in join mode ranks may end an epoch at different steps. Trainers that
cannot wrap their loop in torch's `Join` (the HF Trainer, Lightning) instead get *filler* steps
after their END, up to the epoch's last global step (known from the END: the epoch's first step
+ its step count): a tiny batch with no samples, `info.filler = True` and loss scale 0. The rank
runs forward and backward on it, so its collectives (gradient all-reduce, the runtime's own
logging gathers) meet those of the ranks still training; its gradients are zero, so the step's
gradient is exactly that of the real samples (`causal_lm_loss` / `loss_scale` count the rank
in the world size as DDP does). Every sample is still delivered exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from trainer_client.batch_stream import BatchStream, Reconfigured
from trainer_client.decode import BatchInfo, StreamBatch

_NUM_YIELDED = "_num_yielded"
_ITERATOR_FINISHED = "_iterator_finished"
_DATASET_STATE = "dataset_state"
# The pass's place in the plan, the same on every rank of an aligned loader.
_EPOCH = "odb_epoch"
_FIRST_STEP = "odb_epoch_first_step"
_NEXT_STEP = "odb_next_step"  # the global step the pass yields next (real or filler; of a
# global step with micro-batches left, that step: a resume restarts it at its first)
_LAST_STEP = "odb_epoch_last_step"  # known once this rank saw the epoch's END
_JOB_DONE = "odb_job_done"
_COLLATE = "odb_collate"


def filler_batch(step: int, epoch: int, rank: int, world_size: int, collate: str,
                 tensors: str) -> StreamBatch:
    """A two-token batch whose one label teaches nothing (loss scale 0): a well-formed input
    for any causal LM, so every loss formulation stays finite; `* 0` makes its gradient zero."""
    arrays: dict[str, np.ndarray] = {
        "input_ids": np.zeros((1, 2), np.int32),
        "labels": np.array([[-100, 0]], np.int32),
    }
    if collate == "packed":
        arrays.update(position_ids=np.array([[0, 1]], np.int32),
                      cu_seqlens=np.array([0, 2], np.int32),
                      max_seqlen=np.array(2, np.int32))
    else:
        arrays["attention_mask"] = np.ones((1, 2), np.bool_)
    if tensors == "torch":
        import torch

        out = StreamBatch((k, torch.from_numpy(v)) for k, v in arrays.items())
    else:
        out = StreamBatch(arrays)
    out.info = BatchInfo(step=step, epoch=epoch, rank=rank, world_size=world_size,
                         sample_ids=(), step_samples=0, step_tokens=0, rank_samples=0,
                         rank_tokens=0, step_loss_tokens=0, rank_loss_tokens=0, collate=collate,
                         over_budget=False, filler=True)
    return out


class StreamLoader:
    def __init__(self, stream: BatchStream, *, align: bool = False) -> None:
        self.stream = stream
        self.align = align
        self._num_yielded = 0
        self._finished = True  # no pass yet: the first one starts the stream's current epoch
        self._epoch = stream.epoch
        self._first_step = 0
        self._next_step = 0
        self._last_step: int | None = None
        self._collate = "padded"
        self._pending: dict[str, Any] | None = None
        self._resumed = False  # restored mid-epoch, no pass has run since

    # --- StatefulDataLoader conventions ---
    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:  # loaded, not yet iterated: that state still holds
            return dict(self._pending)
        return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        return {_NUM_YIELDED: self._num_yielded, _ITERATOR_FINISHED: self._finished,
                _DATASET_STATE: self.stream.state_dict(), _EPOCH: self._epoch,
                _FIRST_STEP: self._first_step, _NEXT_STEP: self._next_step,
                _LAST_STEP: self._last_step, _JOB_DONE: self.stream.done and self._finished,
                _COLLATE: self._collate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore at the next `iter()`. An aligned loader's position is the same on every rank
        (all run the same global steps), so any rank's state restores any rank: the stream
        reopens at the pass's next global step and the server sends this rank whatever it has
        left there (its batches, or at once its END and then fillers)."""
        if state == {}:
            return
        missing = {_NUM_YIELDED, _ITERATOR_FINISHED, _DATASET_STATE, _EPOCH, _FIRST_STEP,
                   _NEXT_STEP} - set(state)
        if missing:
            raise ValueError(f"StreamLoader state lacks {sorted(missing)}")
        self._pending = dict(state)

    # --- iteration ---
    def __iter__(self) -> Iterator[StreamBatch]:
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None
            self._resumed = not self._finished
        if self._finished:
            self._start_epoch()
        return self._pass()

    def _start_epoch(self) -> None:
        self._num_yielded = 0
        self._finished = False
        self._epoch = self.stream.epoch
        self._first_step = self.stream.epoch_first_step
        self._next_step = max(self._first_step, self.stream.next_step)
        self._last_step = None

    def _restore(self, state: dict[str, Any]) -> None:
        self._num_yielded = int(state[_NUM_YIELDED])
        self._finished = bool(state[_ITERATOR_FINISHED])
        self._epoch = int(state[_EPOCH])
        self._first_step = int(state[_FIRST_STEP])
        self._next_step = int(state[_NEXT_STEP])
        self._last_step = state.get(_LAST_STEP)
        self._collate = state.get(_COLLATE, "padded")
        if not self.align:
            self.stream.load_state_dict(state[_DATASET_STATE])
            return
        s = self.stream
        position = {"job": s.job, "rank": s.rank, "world_size": s.world_size,
                    "next_step": self._next_step}
        if self._finished:  # the next pass starts the next epoch where this one ended
            position.update(epoch=self._epoch + 1, epoch_first_step=self._next_step,
                            done=bool(state.get(_JOB_DONE, False)))
        else:
            position.update(epoch=self._epoch, epoch_first_step=self._first_step, done=False)
        s.load_state_dict(position)

    def _pass(self) -> Iterator[StreamBatch]:
        # Read when the pass runs: a runtime may create iterators it never advances.
        resumed, self._resumed = self._resumed, False
        before = self._num_yielded
        yield from self._epoch_items()
        if resumed and self._num_yielded == before and not self.stream.done:
            # Resumed right after an epoch's last step: nothing was left of it, and an empty
            # pass reads as "no more data" to trainers (HF stops). Go on with the next epoch.
            self._start_epoch()
            yield from self._epoch_items()

    def _epoch_items(self) -> Iterator[StreamBatch]:
        s = self.stream
        if s.epoch == self._epoch:  # else the END was seen: only fillers can be left
            seen = s.last_end
            for batch in s:
                self._num_yielded += 1
                # (a step with micro-batches left stays next: a resume restarts it)
                self._next_step = batch.info.step + (1 if batch.info.last_micro else 0)
                self._collate = batch.info.collate
                batch.loader_state = self._snapshot()
                yield batch
            end = s.last_end
            if end is not None and end is not seen and end.reason == "reconfigure":
                # The world ended mid-epoch (docs/elastic.md): not the epoch's end for the
                # runtime; the worker restarts as a rank of the new world from its checkpoint.
                raise Reconfigured(s.job, s.rank, end.world_size)
            if end is not None and end is not seen and end.epoch == self._epoch:
                self._last_step = end.last_step
        if self.align and self._last_step is not None:
            while self._next_step <= self._last_step:
                step = self._next_step
                self._num_yielded += 1
                self._next_step += 1
                filler = filler_batch(step, self._epoch, s.rank, s.world_size, self._collate,
                                      s.tensors)
                filler.loader_state = self._snapshot()
                yield filler
        self._finished = True
