"""`ComputeClock` in one process: the window it times (the model's forward to the end of its
backward) and what it leaves out, on a real module and real autograd. Under DDP, with one rank
slower than the other, it leaves out the wait in the all-reduce: the loader run of
tests/client/test_adapters_ddp.py."""

from __future__ import annotations

import time

import pytest
import torch

from trainer_client.compute_clock import ComputeClock, stopping_before_each

FORWARD_S = 0.05


class SleepyModel(torch.nn.Module):
    """A forward that takes at least `sleep_s`."""

    def __init__(self, sleep_s: float = 0.0, device: str = "cpu") -> None:
        super().__init__()
        self.sleep_s = sleep_s
        self.lin = torch.nn.Linear(4, 4, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return self.lin(x).sum()


class Reports(list):
    def __call__(self, batch: object, seconds: float) -> None:
        self.append((batch, seconds))

    @property
    def batches(self) -> list:
        return [b for b, _ in self]


def test_a_step_is_timed_from_its_forward_to_the_end_of_its_backward():
    model, reports = SleepyModel(FORWARD_S), Reports()
    clock = ComputeClock(reports)
    clock.attach(model)
    x = torch.ones(2, 4)
    clock.start("b0")
    time.sleep(0.05)  # between start and the forward (a late peer in DDP's broadcast): not timed
    began = time.perf_counter()
    model(x).backward()
    model(x).backward()  # a second backward in the same step (accumulation): the end is its end
    ended = time.perf_counter()
    time.sleep(0.05)  # the optimizer step, logging: not timed
    clock.stop()
    ((batch, seconds),) = reports
    assert batch == "b0"
    assert 2 * FORWARD_S <= seconds <= ended - began


def test_steps_without_backward_report_nothing_and_close_detaches():
    model, reports = SleepyModel(), Reports()
    clock = ComputeClock(reports)
    clock.attach(model)
    clock.attach(model)  # attached once: one report per step, not two
    x = torch.ones(2, 4)
    model(x).backward()  # no step started: not timed
    clock.start("eval")
    with torch.no_grad():
        model(x)
    clock.stop()
    clock.start("a")
    model(x).backward()
    clock.start("b")  # stops "a"
    model(x).backward()
    clock.close()  # stops "b", then removes the hooks
    clock.start("c")
    model(x).backward()
    clock.stop()
    assert reports.batches == ["a", "b"]
    assert model.lin.weight._post_accumulate_grad_hooks in (None, {})


def test_each_step_is_reported_before_the_next_batch_is_taken():
    """What the adapters rely on: a stream's take acks with the reports made before it."""
    model, reports = SleepyModel(), Reports()
    clock = ComputeClock(reports)
    clock.attach(model)
    reported_at_take = []

    def batches():
        for name in ("a", "b", "c"):
            reported_at_take.append(reports.batches)
            yield name

    for batch in stopping_before_each(batches(), clock):
        clock.start(batch)
        model(torch.ones(2, 4)).backward()
    assert reported_at_take == [[], ["a"], ["a", "b"]]
    assert reports.batches == ["a", "b", "c"]  # the last one when the iteration ended


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_kernels_count_where_they_ran():
    """Device events, not host time: a kernel spinning on the GPU is counted though the host
    only queued it."""
    model, reports = SleepyModel(FORWARD_S, "cuda"), Reports()
    clock = ComputeClock(reports)
    clock.attach(model)
    spin = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spin[0].record()
    torch.cuda._sleep(200_000_000)
    spin[1].record()
    spin[1].synchronize()
    spin_s = spin[0].elapsed_time(spin[1]) / 1000
    clock.start("g")
    loss = model(torch.ones(2, 4, device="cuda"))
    torch.cuda._sleep(200_000_000)  # queued work the backward waits behind on the stream
    loss.backward()
    clock.flush()
    ((batch, seconds),) = reports
    assert batch == "g" and seconds >= FORWARD_S + 0.9 * spin_s
