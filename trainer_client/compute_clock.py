"""`ComputeClock`: how long a batch took to compute on this rank (forward + backward), measured
inside the training step, without the time spent waiting for the other ranks. What compute
balancing (docs/compute-balancing.md) needs, and what the adapters report by themselves.

    clock = ComputeClock(stream.report_compute)   # called as report(batch, seconds)
    clock.attach(ddp_model)                       # once: the model whose backward is timed
    for batch in stream:
        clock.start(batch)
        loss = compute_loss(ddp_model, batch.to_model_inputs(device))
        loss.backward()
        clock.stop()                              # any time before the next start
        opt.step(); opt.zero_grad()
    clock.flush()                                 # device timings still pending are reported

Why not the step's wall time: under DDP the gradient all-reduce overlaps backward and
`loss.backward()` returns only once every rank's gradients are summed, so a fast rank's step
lasts as long as the slowest rank's, which is exactly what balancing must not learn. DDP
launches its all-reduces from autograd hooks as gradients become ready, and waits for them in a
callback it queues on the autograd engine when its last gradient bucket is ready. The clock
hooks every parameter (`register_post_accumulate_grad_hook`): at the first gradient accumulated
in a timed step it queues a callback of its own, which the engine runs first (callbacks run in
the order queued), when this rank's backward has computed its last gradient and before DDP's
wait. No DDP communication hook is taken, so a user's hook stays in place, and the same clock
times a model without DDP and `no_sync()` micro-steps.

What is measured: from the start of the model's forward (for a DDP model, its inner module's
forward: after DDP's buffer broadcast, a collective that waits for late ranks) or, when no
forward of the attached model runs, from `start()`, to the end of the last backward pass before
`stop()`. A step with no backward reports nothing. On an accelerator (CUDA) both ends are
device events recorded on the current stream, so kernels count where they ran, not where they
were queued; their reading waits until the end event completed (checked at each start and
stop, forced by `flush()`), so the clock never stalls the host. That CUDA path has never run:
its test is skipped without a GPU, and no machine this project is built and tested on has one
(only the host-clock path is tested). Models whose parameters are replaced after `attach`
(FSDP's flat parameters) are not timed.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.autograd.variable import Variable
from torch.nn.parallel import DistributedDataParallel

Report = Callable[[Any, float], None]


class ComputeClock:
    """Times one batch at a time; `report(batch, seconds)` receives each measurement."""

    def __init__(self, report: Report) -> None:
        self._report = report
        self._handles: list[Any] = []
        self._seen: dict[int, weakref.ref] = {}  # models attached, modules and params hooked
        self._device: torch.device | None = None  # events on it; None: the host's clock
        self._current_stream: Callable[[torch.device], Any] = lambda _device: None
        self._batch: Any = None  # the batch being timed
        self._armed_at: float | torch.Event = 0.0  # start(): the start if no forward follows
        self._start: float | torch.Event | None = None  # the first forward's start
        self._end: float | torch.Event | None = None  # the last backward's end
        self._end_queued = False  # this backward's end callback is queued
        self._pending: deque[tuple[Any, torch.Event, torch.Event]] = deque()

    def attach(self, model: torch.nn.Module) -> None:
        """Time the forward and backward passes of `model` (a DDP-wrapped model or not). Call
        again for another model; a model already attached is left as it is."""
        if not self._first_time(model):
            return
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        if inner is model or self._first_time(inner):
            self._handles.append(inner.register_forward_pre_hook(self._on_forward))
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            warnings.warn(f"ComputeClock: {type(model).__name__} has no parameter that requires "
                          "grad: its steps are not timed", stacklevel=2)
        for param in trainable:
            if self._first_time(param):
                self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))
                if self._device is None and param.device.type not in ("cpu", "meta"):
                    self._use_device(param.device)

    def start(self, batch: Any) -> None:
        """Begin timing `batch` (a batch still being timed is stopped first)."""
        self.stop()
        self._report_completed()
        self._batch, self._start, self._end = batch, None, None
        self._end_queued = False  # (a backward that raised never ran its callback)
        self._armed_at = self._now()

    def stop(self) -> None:
        """The batch's step is over: its compute is reported (on an accelerator, once its end
        event completed). Nothing is reported when no backward ran since `start`."""
        batch, self._batch = self._batch, None
        if batch is None or self._end is None:
            return
        start = self._armed_at if self._start is None else self._start
        if isinstance(start, float):
            self._report(batch, self._end - start)  # type: ignore[operator]
            return
        self._pending.append((batch, start, self._end))  # type: ignore[arg-type]
        self._report_completed()

    def flush(self) -> None:
        """Stop, and report every measurement still waiting for its device (this waits)."""
        self.stop()
        while self._pending:
            batch, start, end = self._pending.popleft()
            end.synchronize()
            self._report(batch, start.elapsed_time(end) / 1000.0)

    def close(self) -> None:
        """Flush, then remove every hook: the models run as if never attached."""
        self.flush()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()

    # --- internals ---
    def _first_time(self, obj: Any) -> bool:
        """Whether `obj` is met for the first time (by identity: a tensor's `==` is
        elementwise, and an id alone could be a dead object's)."""
        seen = self._seen.get(id(obj))
        if seen is not None and seen() is obj:
            return False
        self._seen[id(obj)] = weakref.ref(obj)
        return True

    def _use_device(self, device: torch.device) -> None:
        current_stream = getattr(torch.get_device_module(device), "current_stream", None)
        if current_stream is None:
            warnings.warn(f"ComputeClock: no streams on {device.type}: timed by the host's "
                          "clock, which may miss work still queued on the device", stacklevel=3)
            return
        self._device, self._current_stream = device, current_stream

    def _now(self) -> float | torch.Event:
        if self._device is None:
            return time.perf_counter()
        event = torch.Event(self._device, enable_timing=True)
        event.record(self._current_stream(self._device))  # after the work queued so far
        return event

    def _on_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        if self._batch is not None and self._start is None:
            self._start = self._now()

    def _on_grad(self, _param: torch.Tensor) -> None:
        if self._batch is not None and not self._end_queued:
            self._end_queued = True
            Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        # Runs before DDP's own end-of-backward callback, which waits for the all-reduce.
        self._end_queued = False
        if self._batch is not None:
            self._end = self._now()

    def _report_completed(self) -> None:
        while self._pending and self._pending[0][2].query():
            batch, start, end = self._pending.popleft()
            self._report(batch, start.elapsed_time(end) / 1000.0)


def stopping_before_each(batches: Iterable[Any], clock: ComputeClock) -> Iterator[Any]:
    """`batches`, with `clock` stopped before each next batch is taken and when the iteration
    ends: the step trained on the batch before is over by then, and a report made before a
    stream's take rides on that take's ack."""
    it = iter(batches)
    try:
        while True:
            clock.stop()
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch
    finally:
        clock.stop()
