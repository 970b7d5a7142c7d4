"""The rank stream without a server (`rank_stream.RankStreams` on the test's own event loop):
every rank gets its batches within its credits and its END, exactly once across ranks; a stream
that must end raises a domain error (never a gRPC status: only the adapter knows those, and
the domain modules do not import grpc)."""

from __future__ import annotations

import ast
import asyncio
from collections import Counter
from pathlib import Path

import pytest
from stream_harness import StreamClient, StreamJob

from pipeline.errors import AckAheadOfPlan, BadRequest, PositionUnavailable, RankHeld


@pytest.fixture
def job():
    j = StreamJob(world_size=2, samples=40)
    yield j
    j.close()


def test_every_rank_gets_its_batches_and_its_end_exactly_once(job):
    async def main():
        clients = [StreamClient(job, r) for r in range(2)]
        got = await asyncio.gather(*(c.consume() for c in clients))
        outcomes = [await c.outcome() for c in clients]
        return got, outcomes

    got, outcomes = job.run(main())
    assert outcomes == [None, None]  # both ended cleanly after their final END
    ids = Counter(i for msgs in got for m in msgs if m.WhichOneof("kind") == "batch"
                  for i in m.batch.sample_ids)
    assert sorted(ids) == sorted(str(s.sample_id) for s in job.samples)
    assert set(ids.values()) == {1}
    for r, msgs in enumerate(got):
        assert all(m.batch.rank == r and m.batch.info.world_size == 2
                   for m in msgs if m.WhichOneof("kind") == "batch")
        end = msgs[-1].end
        assert end.job_done and end.final_step == max(m.batch.step for m in msgs[:-1])
        assert job.state.acked(r) >= end.final_step


def test_a_stream_never_sends_beyond_the_clients_credits(job):
    async def main():
        c = StreamClient(job, 0, credits=1)
        first = await c.next()
        with pytest.raises(TimeoutError):
            await c.next(timeout=0.5)  # no credit left: nothing more comes
        c.ack(first.batch.step, credits=1)
        second = await c.next()
        c.close()
        await c.outcome()
        return first.batch.step, second.batch.step

    first, second = job.run(main())
    assert second > first


@pytest.mark.parametrize(("open_kw", "error", "text"), [
    ({"rank": 2}, BadRequest, "rank 2 is outside [0, 2)"),
    ({"resume_step": -3}, BadRequest, "resume_step must be >= 0"),
    ({"resume_step": 10_000}, PositionUnavailable, "beyond the plan"),
], ids=["rank", "negative-position", "position-beyond-the-plan"])
def test_a_refused_open_raises_a_domain_error(job, open_kw, error, text):
    async def main():
        rank = open_kw.pop("rank", 0)
        return await StreamClient(job, rank, **open_kw).outcome()

    exc = job.run(main())
    assert isinstance(exc, error) and text in str(exc)


def test_an_ack_past_the_plan_and_a_held_rank_end_the_stream_with_their_errors():
    job = StreamJob(world_size=2, samples=400)  # more than a few credits' worth of steps

    async def main():
        c = StreamClient(job, 0, credits=1)
        await c.next()
        other = await StreamClient(job, 0, client_id="someone-else").outcome()
        c.ack(10_000)
        return other, await c.outcome()

    try:
        other, mine = job.run(main())
    finally:
        job.close()
    assert isinstance(other, RankHeld) and "retry after the lease lapses" in str(other)
    assert isinstance(mine, AckAheadOfPlan) and "only steps through" in str(mine)


DOMAIN = ["rank_stream.py", "rank_cursor.py", "liveness.py", "world_open.py", "scaling.py",
          "stream_io.py", "job_runtime.py"]


@pytest.mark.parametrize("module", DOMAIN)
def test_only_the_adapter_knows_grpc(module):
    """The stream, its policies and the world rules raise domain errors; `data_server.py` (the
    adapter) is the one place that turns them into status codes."""
    path = Path(__file__).parents[2] / "pipeline" / "service" / module
    tree = ast.parse(path.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom)}
    assert "grpc" not in imported
