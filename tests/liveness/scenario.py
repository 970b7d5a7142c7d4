"""What every liveness scenario does around its fault: start the ranks, hold them mid-epoch
while the fault goes in, bound every wait, and check the end: every sample consumed exactly
once (the recorded ids, deduplicated by nothing) or the policy's clear error in its bound."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from support.waiting import wait_for

from liveness.contract import client_options
from liveness.rank_process import RankProcess

PREFETCH = 2  # the rank processes' BatchStream prefetch: batches a rank may hold unread
PAUSE_AFTER = 3  # ranks hold their 3rd batch "in training" until the fault is in


def start_ranks(out: Path, job: str, endpoints: dict[int, str], world: int, *,
                sleep: float = 0.05, **kw: object) -> list[RankProcess]:
    """One rank process per entry of `endpoints` (rank -> gRPC target), each pausing after
    PAUSE_AFTER batches until `release()`. Each is served by the first address of its target
    that answers (`pick_first`; the client's default, round_robin, would spread them), so a
    scenario knows which replica its fault takes away from which ranks."""
    options = {**client_options(), "load_balancing": "pick_first"}
    return [RankProcess(out, endpoints[r], job, r, world, options=options,
                        sleep=sleep, pause_after=PAUSE_AFTER, **kw)  # type: ignore[arg-type]
            for r in sorted(endpoints)]


def _explain(ranks: Iterable[RankProcess]) -> str:
    return "\n".join(f"--- rank {r.rank} (exit {r.proc.poll()}): last records "
                     f"{r.records()[-3:]}\n{r.output()[-1500:]}" for r in ranks)


def _wait(ranks: list[RankProcess], pred: Callable[[], bool], timeout: float, what: str) -> None:
    """`wait_for`, failing with the ranks' last records and output."""
    try:
        wait_for(pred, timeout, what, interval=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_explain(ranks)}") from None


def wait_paused(ranks: list[RankProcess], timeout: float = 120.0) -> None:
    """Until every rank holds its PAUSE_AFTER-th batch (the job is mid-epoch everywhere)."""
    _wait(ranks, lambda: all(r.last("paused") for r in ranks), timeout,
          "every rank to take its first batches")


def release(ranks: list[RankProcess]) -> None:
    """Let the paused ranks go on."""
    for r in ranks:
        r.go.touch()


def wait_ended(ranks: list[RankProcess], timeout: float, what: str = "the ranks to end") -> None:
    """Until every rank process exited."""
    _wait(ranks, lambda: all(r.finished() for r in ranks), timeout, what)


def assert_done(ranks: list[RankProcess]) -> None:
    for r in ranks:
        assert r.proc.returncode == 0 and r.last("done"), (
            f"rank {r.rank} did not finish the job:\n{_explain([r])}")


def wait_failed_over(ranks: list[RankProcess], since: float, bound: float, what: str) -> None:
    """By `since + bound`, every rank's stream broke (it reconnected) and it took a batch it
    cannot have held at `since` (beyond its paused batch and a full prefetch queue). Both: a
    replica cut from Redis still delivers the steps it had recorded grants for, so fresh
    batches alone do not show that it ended its streams (a fault lifted then never made
    them fail over)."""
    fresh = PAUSE_AFTER + PREFETCH + 1

    def failed_over(r: RankProcess) -> bool:
        taken = r.batches()
        return len(taken) >= fresh and taken[-1]["reconnects"] >= 1

    _wait(ranks, lambda: all(failed_over(r) for r in ranks), since + bound - time.time(), what)


def delivered_ids(ranks: Iterable[RankProcess]) -> Counter:
    """Every sample id every rank took, counted as taken (no deduplication)."""
    return Counter(i for r in ranks for b in r.batches() for i in b["ids"])


def assert_exactly_once(got: Counter, expected: set[str]) -> None:
    twice = {i: n for i, n in got.items() if n > 1}
    missing = expected - set(got)
    extra = set(got) - expected
    assert not twice and not missing and not extra, (
        f"{len(twice)} ids taken more than once (e.g. {list(twice.items())[:3]}), "
        f"{len(missing)} never taken (e.g. {sorted(missing)[:3]}), "
        f"{len(extra)} not in the epoch (e.g. {sorted(extra)[:3]})")


def kill_all(ranks: Iterable[RankProcess]) -> None:
    for r in ranks:
        r.kill()
