"""Guarantee 11 through a real producer (real preprocessing of two sources in this process,
the bootstrap producer's feed; the job's state in memory): a mixture's counts are exact every
epoch, with every copy a sample of its own delivered once; each source keeps its share in every
tenth of an epoch; a `mix` request and a schedule entry take effect at one step boundary, are
recorded in the checkpoint and replay identically when the producer restarts from it; each
source's part of the plan is reported."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest

from pipeline.config import TrainingJobConfig
from pipeline.jobstate import MemoryJobState
from pipeline.order.cursor import OrderCursor
from pipeline.planner.types import Step
from pipeline.preprocess.process import split_sample_id
from pipeline.producer.local_feed import LocalFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings

FAST = ProducerSettings(lease_seconds=5.0, max_ahead=10**6, linger_seconds=0.0,
                        poll_seconds=0.01, retry_first_seconds=0.02, retry_cap_seconds=0.1)
ROWS = 400  # per source


def _chats(path: Path, tag: str, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(ROWS):
        words = int(rng.lognormvariate(3.3, 0.7)) + 1
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": f"{tag} {i}: " + "why " * rng.randint(1, 12)},
            {"role": "assistant", "content": f"{tag} answer {i} " + "word " * words}]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("mix")
    return _chats(d / "a.jsonl", "a", 1), _chats(d / "b.jsonl", "b", 2)


def _job(files, batching: dict | None = None, **source) -> TrainingJobConfig:
    a, b = files
    return TrainingJobConfig.model_validate({
        "job_id": "mix", "world_size": 2, "seed": 5, "epochs": 2,
        # A window and pool small against the epoch (as a real dataset's are).
        "batching": {"token_budget": 1024, "lookahead_tokens": 4096, "pool_steps": 8,
                     **(batching or {})},
        "source": {"mixture": [{"name": "a", "paths": [a]},
                               {"name": "b", "paths": [b], "repeat": 2}], **source}})


class _Hooked(LocalFeed):
    """The bootstrap feed, calling `hooks[n]()` as it hands out its n-th item (1-based, over
    the job): a `mix` request while the producer reads, a look at the status, a stop."""

    def __init__(self, job, hooks: dict) -> None:
        super().__init__(job)
        self.hooks, self.n = hooks, 0

    def iter_epoch(self, epoch: int, cursor: OrderCursor):
        for item in super().iter_epoch(epoch, cursor):
            self.n += 1
            if self.n in self.hooks:
                self.hooks[self.n]()
            yield item


def _run(job, state, feed) -> Outcome:
    return Producer(job, state, feed, holder="p", settings=FAST).run()


def _steps(state) -> list[Step]:
    return [state.get_step(n) for n in range(state.published_through() + 1)]


def _epoch_ids(steps, epoch: int) -> list[str]:
    return [str(s.sample_id) for st in steps if st.epoch == epoch for b in st.batches
            if not b.filler for s in b.samples]


def _source_of(sid: str) -> str:
    return "a" if split_sample_id(sid)[0].endswith("a.jsonl") else "b"


def test_counts_are_exact_and_each_tenth_holds_each_sources_share(files):
    job = _job(files)
    st = MemoryJobState("mix", 2)
    assert _run(job, st, LocalFeed(job)) is Outcome.DONE
    steps = _steps(st)
    for epoch in (0, 1):
        ids = _epoch_ids(steps, epoch)
        assert len(ids) == len(set(ids)) == 3 * ROWS  # every copy once
        keys = collections.Counter((_source_of(i), split_sample_id(i)[2]) for i in ids)
        assert keys == {("a", 0): ROWS, ("b", 0): ROWS, ("b", 1): ROWS}
        n = len(ids)
        for t in range(10):
            part = ids[n * t // 10: n * (t + 1) // 10]
            share = sum(_source_of(i) == "b" for i in part) / len(part)
            assert abs(share - 2 / 3) <= 0.05, (epoch, t, share)
    status = st.source_status()
    assert status.epoch == 1 and [s.name for s in status.sources] == ["a", "b"]
    assert [s.samples for s in status.sources] == [ROWS, 2 * ROWS]
    assert [round(s.target, 3) for s in status.sources] == [0.333, 0.667]


def test_a_mix_request_takes_effect_at_one_step_boundary_and_replays_after_a_restart(files):
    job = _job(files)
    ref = MemoryJobState("mix", 2)
    seen: dict = {}
    feed = _Hooked(job, {300: lambda: ref.request_mix({"a": 3.0, "b": 1.0}),
                         3 * ROWS + 1: lambda: seen.update(end0=ref.source_status())})
    assert _run(job, ref, feed) is Outcome.DONE
    steps = _steps(ref)
    ids = _epoch_ids(steps, 0)
    assert len(ids) == len(set(ids)) == 3 * ROWS  # the epoch keeps its size, each sample once
    (change,) = seen["end0"].changes  # recorded in the plan: its first step, by, weights
    by, weights = change[1], dict(change[2])
    assert (by, weights) == ("mix 1", {"a": 3.0, "b": 1.0})
    def share_a(first: int, last: int) -> float:
        ids = [i for st in steps if st.epoch == 0 and first <= st.step < last
               for b in st.batches for i in map(str, b.sample_ids)]
        return sum(_source_of(i) == "a" for i in ids) / len(ids)

    end0 = max(st.step for st in steps if st.epoch == 0)
    assert abs(share_a(0, change[0]) - 1 / 3) <= 0.05
    # From its step on, what the rest of the epoch holds (the planner's window and pool of the
    # old mix, then the new reads at 3:1) is spread level over the rest: no drift to its end.
    rest = share_a(change[0], end0 + 1)
    half = (change[0] + end0 + 1) // 2
    assert rest > 1 / 3 + 0.2
    assert abs(share_a(change[0], half) - rest) <= 0.05
    assert abs(share_a(half, end0 + 1) - rest) <= 0.05
    epoch1 = collections.Counter(_source_of(i) for i in _epoch_ids(steps, 1))
    assert epoch1 == {"a": 900, "b": 300}  # 3:1 of the epoch's 1,200 from its start

    # A producer stopped after the change (as a kill would stop it) and a successor from its
    # checkpoint: the same plan, step for step.
    st = MemoryJobState("mix", 2)
    hooks: dict = {300: lambda: st.request_mix({"a": 3.0, "b": 1.0})}
    first = Producer(job, st, _Hooked(job, hooks), holder="p1", settings=FAST)
    hooks[700] = first.stop
    assert first.run() is Outcome.STOPPED
    assert 0 < st.published_through() < len(steps) - 1
    cp = st.load_checkpoint()
    assert OrderCursor.restore(cp.samples_consumed, cp.order).mix_seq == 1
    assert _run(job, st, LocalFeed(job)) is Outcome.DONE
    assert _steps(st) == steps


def test_a_schedule_entry_changes_the_weights_from_its_step(files):
    job = _job(files, schedule=[{"from_step": 20, "weights": {"a": 1, "b": 0}}])
    st = MemoryJobState("mix", 2)
    seen: dict = {}
    feed = _Hooked(job, {3 * ROWS + 1: lambda: seen.update(end0=st.source_status())})
    assert _run(job, st, feed) is Outcome.DONE
    steps = _steps(st)
    ids = _epoch_ids(steps, 0)
    assert len(ids) == len(set(ids)) == 3 * ROWS
    ((step, by, weights),) = seen["end0"].changes
    assert step >= 20 and by == "schedule 0" and dict(weights) == {"a": 1.0, "b": 0.0}

    def share_b(first: int, last: int) -> float:
        got = [i for s_ in steps if s_.epoch == 0 and first <= s_.step < last
               for b in s_.batches for i in map(str, b.sample_ids)]
        return sum(_source_of(i) == "b" for i in got) / len(got)

    assert share_b(step, 10**9) < share_b(0, step) - 0.2  # b is read no more from there on
    epoch1 = collections.Counter(_source_of(i) for i in _epoch_ids(steps, 1))
    assert epoch1 == {"a": 3 * ROWS}  # b left out of the next epoch; a's rows thrice (#1, #2)
    assert len(set(_epoch_ids(steps, 1))) == 3 * ROWS


@pytest.mark.parametrize("global_budget", [None, 4096])
def test_mixed_by_loss_tokens_every_window_of_ten_steps_holds_each_sources_token_share(
        files, global_budget):
    job = _job(files, {"global_token_budget": global_budget}, mix_by="loss_tokens")
    st = MemoryJobState("mix", 2)
    assert _run(job, st, LocalFeed(job)) is Outcome.DONE
    steps = [s for s in _steps(st) if s.epoch == 0]
    tokens = [[sum(s.loss_tokens for b in st_.batches if not b.filler for s in b.samples
                   if _source_of(str(s.sample_id)) == src) for src in "ab"] for st_ in steps]
    share = sum(t[1] for t in tokens) / sum(sum(t) for t in tokens)
    worst = max(abs(sum(t[1] for t in tokens[i:i + 10]) / sum(sum(t) for t in tokens[i:i + 10])
                    - share) for i in range(len(tokens) - 9))
    assert worst <= 0.02
