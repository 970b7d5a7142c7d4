"""The two schedulers the benchmark compares, on the same model, requests and capacity.

- `static_batches`: requests in arrival order fill a batch up to the capacity (token cost
  prompt + planned generation, the service's rule); the batch runs until its last member
  finishes (finished members stay in it, as in any static-batch engine), then the next batch.
- `refill_through_service`: one `trainer_client.RefillStream` to the real service; after every
  step the members that finished their last block leave at once (block-grained eviction) and
  the freed capacity is offered back (`refill(free_tokens, finished)`), so new requests join the
  very next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mdlm.decode import BLOCK, Decoding, step
from mdlm.model import MaskedDiffusionLM
from trainer_client import RefillStream, Request

Starter = Callable[[Request], Decoding]


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    seconds: float
    steps: int            # forward steps (each one batched forward per bucket)
    work_tokens: int      # positions computed, padding and finished members included
    generated_tokens: int
    request_steps: int = 0  # denoising steps summed over requests (convergence)
    blocks: int = 0
    refill_calls: int = 0
    refill_seconds: float = 0.0

    def summary(self) -> dict:
        n = len(self.outputs)
        return {"requests": n, "seconds": round(self.seconds, 3),
                "requests_per_s": n / self.seconds,
                "tokens_per_s": self.generated_tokens / self.seconds,
                "steps": self.steps, "work_tokens": self.work_tokens,
                "generated_tokens": self.generated_tokens,
                "steps_per_block": self.request_steps / max(1, self.blocks),
                "work_tokens_per_request": self.work_tokens / max(1, n),
                "refill_calls": self.refill_calls,
                "refill_seconds": round(self.refill_seconds, 3)}


def static_batches(model: MaskedDiffusionLM, requests: list[Request], capacity: int,
                   begin: Starter) -> RunResult:
    outputs: dict[str, list[int]] = {}
    steps = work = req_steps = 0
    t0 = time.perf_counter()
    i = 0
    while i < len(requests):
        batch: list[Decoding] = []
        used = 0
        while i < len(requests) and (not batch or used + requests[i].cost <= capacity):
            batch.append(begin(requests[i]))
            used += requests[i].cost
            i += 1
        while not all(d.done for d in batch):
            work += step(model, batch)
            steps += 1
        outputs.update({d.request_id: d.output() for d in batch})
        req_steps += sum(d.steps for d in batch)
    seconds = time.perf_counter() - t0
    return RunResult(outputs, seconds, steps, work, sum(r.generation_tokens for r in requests),
                     req_steps, sum(r.generation_tokens for r in requests) // BLOCK)


def refill_through_service(model: MaskedDiffusionLM, endpoint: str, job: str, capacity: int,
                           begin: Starter, token: str | None = None) -> RunResult:
    outputs: dict[str, list[int]] = {}
    active: list[Decoding] = []
    steps = work = calls = generated = req_steps = 0
    rpc = 0.0
    t0 = time.perf_counter()
    with RefillStream(endpoint, job, token=token, consumer_id=f"bench-{job}") as stream:
        finished: list[str] = []
        while True:
            free = capacity - sum(d.cost for d in active)
            c0 = time.perf_counter()
            got = stream.refill(free, finished)
            rpc += time.perf_counter() - c0
            calls += 1
            finished = []
            active += [begin(r) for r in got]
            generated += sum(r.generation_tokens for r in got)
            if not active:
                if stream.exhausted:
                    break
                time.sleep(0.001)  # others hold the rest (none in this bench)
                continue
            work += step(model, active)
            steps += 1
            for d in [d for d in active if d.done]:
                outputs[d.request_id] = d.output()
                req_steps += d.steps
                finished.append(d.request_id)
            active = [d for d in active if not d.done]
        if finished:  # report the last ones
            stream.refill(0, finished)
            calls += 1
    seconds = time.perf_counter() - t0
    return RunResult(outputs, seconds, steps, work, generated, req_steps, generated // BLOCK,
                     calls, rpc)
