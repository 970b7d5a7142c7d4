"""The rank stream without a server (`rank_stream.RankStreams` on the test's own event loop):
every rank gets its batches within its credits and its END, exactly once across ranks; a stream
that must end raises a domain error (never a gRPC status: only the adapter knows those, and
the domain modules do not import grpc). Leases live on the client's evidence only (Open, Ack,
Heartbeat), a stream fenced out by another client ends, an ack never names a step the rank was
not sent, request fields are capped, and a replica that cannot reach the job's state ends its
streams within `state_timeout_seconds`."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from stream_harness import StreamClient, StreamJob
from support.waiting import wait_for

from pipeline.coordinator import RedisJobState
from pipeline.errors import (
    AckNotDelivered,
    BadRequest,
    PositionUnavailable,
    RankHeld,
    RankTimedOut,
    ReplicaUnavailable,
)
from pipeline.redis_server import LocalRedis
from pipeline.service.data_server import job_status
from trainer_client.wire.odb.v1 import data_service_pb2 as pb


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


def _held_plan(job: StreamJob) -> int:
    """The producer planned as far as its back-pressure lets it with no rank acking (each rank
    has a batch in every step: `max_ahead` + 1 steps); the published plan's last step."""
    held = job.rt.host.settings.max_ahead
    wait_for(lambda: job.state.published_through() >= held, 30, "the producer held")
    assert job.state.published_through() == held
    return held


def test_an_open_past_the_plan_waits_while_the_producer_publishes_towards_it():
    """A client resumes at a step the plan does not hold (Redis lost publications it had
    received: the producer publishes them again, after its backoff and a replay). Its stream
    opens and waits for the step while the plan grows, however long that takes beyond
    `resume_grace_s` (#40 item 5: the Open waited `resume_grace_s` in all and answered
    OUT_OF_RANGE, which the client does not retry)."""
    job = StreamJob(world_size=2, samples=2000, resume_grace_s=1.0,
                    batching={"pool_steps": 1})  # a step per ack (no pool of steps)

    async def main():
        through = _held_plan(job)
        target = through + 6
        c = StreamClient(job, 0, credits=1, resume_step=target, resume_epoch=0)
        t0 = time.monotonic()
        grew = []
        for n in range(0, through + 7):  # the plan grows a step per 0.4 s: 2.4 s to reach it
            if c.task.done() or job.state.published_through() >= target:
                break
            for r in range(2):
                job.state.ack(r, n)  # (room for the producer's back-pressure: one more step)
            await asyncio.sleep(0.4)
            grew.append(job.state.published_through())
        msg = await c.next()
        c.close()
        return target, msg, time.monotonic() - t0, grew

    try:
        target, msg, waited, grew = job.run(main())
    finally:
        job.close()
    assert msg.batch.step == target and waited > 1.0 + 0.4, (waited, grew)


def test_an_open_past_the_plan_ends_out_of_range_when_the_plan_stops_growing():
    """... and the wait is bounded: `resume_grace_s` with nothing new published (the position
    was never delivered, or the producer cannot get there) ends it OUT_OF_RANGE."""
    job = StreamJob(world_size=2, samples=2000, resume_grace_s=1.0,
                    batching={"pool_steps": 1})

    async def main():
        through = _held_plan(job)
        c = StreamClient(job, 0, credits=1, resume_step=through + 6, resume_epoch=0)
        t0 = time.monotonic()
        return await c.outcome(timeout=30), time.monotonic() - t0

    try:
        exc, waited = job.run(main())
    finally:
        job.close()
    assert isinstance(exc, PositionUnavailable) and "beyond the plan" in str(exc), exc
    assert 1.0 <= waited < 1.0 + 5.0


@pytest.fixture
def long_job():
    j = StreamJob(world_size=2, samples=400, lease_seconds=0.6)  # many credits' worth of steps
    yield j
    j.close()


@pytest.mark.parametrize("ahead", [1, 10_000], ids=["published-not-sent", "past-the-plan"])
def test_an_ack_of_a_step_the_rank_was_not_sent_ends_the_stream_and_moves_nothing(long_job,
                                                                                 ahead):
    job = long_job

    async def main():
        c = StreamClient(job, 0, credits=1)
        first = (await c.next()).batch.step
        await asyncio.sleep(0.2)  # the producer publishes on: step first + 1 exists
        other = await StreamClient(job, 0, client_id="someone-else").outcome()
        c.ack(first + ahead)
        return first, other, await c.outcome()

    first, other, mine = job.run(main())
    assert job.state.published_through() > first
    assert isinstance(other, RankHeld) and "retry after the lease lapses" in str(other)
    assert isinstance(mine, AckNotDelivered) and "acked after it was delivered" in str(mine)
    assert job.state.acked(0) == -1  # the cursor never skipped the undelivered step


def test_a_connected_but_silent_client_loses_its_lease_and_a_heartbeat_renews_it(long_job):
    job = long_job

    async def main():
        c = StreamClient(job, 0, credits=1)
        await c.next()
        renewed = []
        for _ in range(4):  # 1.2 s of heartbeats, twice the lease: the lease holds
            await asyncio.sleep(0.3)
            c.heartbeat()
            await asyncio.sleep(0.05)
            renewed.append(job.state.rank_health()[0].lapsed)
        await asyncio.sleep(0.9)  # connected, nothing sent for longer than the lease
        silent = job.state.rank_health()[0]
        c.heartbeat()  # back: the same client retakes its lease (not a lapse of another)
        await asyncio.sleep(0.1)
        back = job.state.rank_health()[0]
        c.close()
        return renewed, silent, back

    renewed, silent, back = job.run(main())
    assert renewed == [False] * 4
    assert silent.lapsed and silent.client_id == "c0"
    assert not back.lapsed and back.client_id == "c0"
    assert job.state.counters().lease_lapses == 0


def test_a_stream_whose_rank_another_client_took_ends_at_its_next_heartbeat(long_job):
    job = long_job

    async def main():
        c = StreamClient(job, 0, credits=1)
        await c.next()
        await asyncio.sleep(0.9)  # lapsed: a restarted trainer's new client takes the rank
        job.state.claim_rank(0, "the-new-client", 30)
        c.heartbeat()
        return await c.outcome()

    exc = job.run(main())
    assert isinstance(exc, RankHeld) and "the-new-client" in str(exc)
    assert job.state.rank_health()[0].client_id == "the-new-client"


def test_a_vanished_clients_rank_is_taken_over_at_once_on_its_replica(long_job):
    """A trainer killed and restarted (a new client id) on the replica its stream vanished from
    takes its rank over at once, without waiting out the lease."""
    job = long_job

    async def main():
        old = StreamClient(job, 0, credits=1, client_id="old")
        await old.next()
        await old.vanish()
        new = StreamClient(job, 0, credits=1, client_id="new")
        return (await new.next()).WhichOneof("kind")

    assert job.run(main()) == "batch"
    assert job.state.rank_health()[0].client_id == "new"


def test_a_vanished_client_that_reclaimed_its_rank_on_another_replica_keeps_it():
    """Client A's stream vanishes from replica 1 and A re-claims its rank on replica 2 (failover
    keeps the client id). A's lease is live: client B opening the rank on replica 1 is refused
    (`RankHeld`), and A's stream goes on: two clients never hold one rank (#40 item 3)."""
    job = StreamJob(world_size=2, samples=400, lease_seconds=30)
    replica2 = job.replica()

    async def main():
        a1 = StreamClient(job, 0, credits=1, client_id="A")
        await a1.next()
        await a1.vanish()  # on replica 1: it may be dead, for all replica 1 knows
        a2 = StreamClient(job, 0, credits=1, client_id="A", streams=replica2)
        first = (await a2.next()).batch.step
        b = StreamClient(job, 0, credits=1, client_id="B")
        try:
            got = (await b.next()).WhichOneof("kind")  # a batch: B would hold A's rank too
        except RankHeld as exc:
            got = exc
        a2.ack(first)
        second = (await a2.next()).batch.step
        a2.close()
        return got, first, second

    try:
        got, first, second = job.run(main())
    finally:
        job.close()
    assert isinstance(got, RankHeld) and "'A'" in str(got), got
    assert second > first
    assert job.state.rank_health()[0].client_id == "A"


@pytest.mark.parametrize(("open_kw", "ack", "text"), [
    ({"credits": 70_000}, None, "credits must be in [0, 65536]"),
    ({"client_id": "x" * 257}, None, "client_id must be at most 256 characters"),
    ({}, 70_000, "Ack credits must be in [0, 65536]"),
    ({}, -1, "Ack credits must be in [0, 65536]"),
], ids=["open-credits", "client-id", "ack-credits", "negative-ack-credits"])
def test_request_fields_are_capped(long_job, open_kw, ack, text):
    job = long_job

    async def main():
        c = StreamClient(job, 0, **open_kw)
        if ack is not None:
            await c.next()
            c.send(pb.ClientMessage(ack=pb.Ack(consumed_step=-1, credits=ack)))
        return await c.outcome()

    exc = job.run(main())
    assert isinstance(exc, BadRequest) and text in str(exc)


def test_a_replica_that_cannot_reach_the_jobs_state_ends_its_streams_within_the_bound():
    """Redis frozen (SIGSTOP: the socket stays open, nothing answers): the stream ends with
    `ReplicaUnavailable` within `state_timeout_seconds`, so its client reconnects (to another
    replica, if it has one); nothing it sent was beyond the rank's recorded grant."""
    with LocalRedis() as redis:
        state = RedisJobState(redis.url, "j", config_hash="x", world_size=2)
        job = StreamJob(world_size=2, samples=400, state=state, state_timeout_seconds=1.0)

        async def main():
            c = StreamClient(job, 0, credits=1)
            first = (await c.next()).batch.step
            os.kill(redis.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                c.ack(first, credits=1)
                got = [m.batch.step async for m in c.messages_until_end()]
                return first, got, await c.outcome(), time.monotonic() - t0
            finally:
                os.kill(redis.proc.pid, signal.SIGCONT)

        try:
            first, got, exc, waited = job.run(main())
            granted = state.grant([(0, 0, -1)])[0].through
        finally:
            job.close()
            state.close()
    assert isinstance(exc, ReplicaUnavailable) and "could not reach the job's state" in str(exc)
    assert waited < 1.0 + 3.0  # the bound, plus slack for a loaded machine
    assert all(n <= granted for n in [first, *got])


def test_a_rank_whose_stream_the_server_ended_is_judged_dead_once_its_trainer_is_gone():
    """A stream the server ends with an error the client does not retry (here a bad Ack:
    INVALID_ARGUMENT) leaves its trainer to exit. The rank is then gone like any dead rank: its
    lease lapses and, under `fail`, the other ranks' streams end `RankTimedOut` naming it
    (Guarantee 4; a released lease was neither lapsed nor never claimed: they waited forever)."""
    job = StreamJob(world_size=2, samples=400, lease_seconds=0.5, rank_timeout_seconds=0.5)

    async def main():
        bad, other = StreamClient(job, 0, credits=1), StreamClient(job, 1, credits=1)
        await bad.next()
        await other.next()
        bad.send(pb.ClientMessage(ack=pb.Ack(consumed_step=-1, credits=70_000)))
        ended = await bad.outcome()  # ... and its trainer exits: nothing more from rank 0
        t0 = time.monotonic()
        got = [m async for m in other.messages_until_end()]  # rank 1 takes no more batches
        return ended, await other.outcome(timeout=30), time.monotonic() - t0, got

    try:
        ended, exc, waited, got = job.run(main())
    finally:
        job.close()
    assert isinstance(ended, BadRequest)
    assert isinstance(exc, RankTimedOut) and "rank 0 has been gone" in str(exc), exc
    assert waited < 0.5 + 0.5 + 5.0  # lease + rank timeout, plus slack for a loaded machine
    assert got == []  # it held its one credit's batch: the stream only waited


def test_a_status_read_never_reconfigures_a_job_under_shrink():
    """GetJob's answer (`data_server.job_status`) while a rank has been gone past the timeout
    under `shrink`: a read, with no side effect; the rank streams make the switch."""
    job = StreamJob(world_size=2, samples=40, policy="shrink", rank_timeout_seconds=0.3)
    try:
        job.state.claim_rank(0, "c0", 60)
        job.state.claim_rank(1, "c1", 0.2)  # never renewed: gone
        wait_for(lambda: 1 in job.rt.dead_ranks(0.3), 10, "rank 1 gone past the timeout")
        status = job_status(job.rt, "replica", job.streams.policy, open_=True)
        assert len(job.state.worlds()) == 1 and job.state.head().world_size == 2
        assert status.world_size == 2
    finally:
        job.close()


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


def test_global_steps_go_one_micro_batch_per_message_within_credits_fetched_once_per_rank():
    """A global step's micro-batches (docs/global-steps.md) each spend a credit; a rank's
    payloads of a step are fetched once for all its micro-batches; every sample once."""
    job = StreamJob(world_size=3, samples=200, batching={"global_token_budget": 8192})

    async def consume(c: StreamClient) -> list:
        got = []
        while True:
            msg = await c.next()
            got.append(msg)
            if msg.WhichOneof("kind") == "batch":
                i = msg.batch.info
                # Acknowledged once the step's last micro-batch was taken (as BatchStream does).
                c.ack(msg.batch.step - (i.micro_index < i.micro_count - 1))
            elif msg.end.job_done:
                c.close()
                return got

    async def main():
        one = StreamClient(job, 0, credits=1)
        first = await one.next()
        with pytest.raises(TimeoutError):
            await one.next(timeout=0.5)  # a micro-batch spent the one credit
        one.ack(first.batch.step - 1)
        rest = await consume(one)
        others = await asyncio.gather(*(consume(StreamClient(job, r)) for r in (1, 2)))
        return [[first, *rest], *others]

    try:
        got = job.run(main())
        plan = [job.state.get_step(n) for n in range(job.state.published_through() + 1)]
        ids = Counter()
        for r, msgs in enumerate(got):
            batches = [m.batch for m in msgs if m.WhichOneof("kind") == "batch"]
            sent = [(b.step, b.info.micro_index) for b in batches]
            want = [(s.step, b.micro) for s in plan for b in s.micros_for(r)]
            assert sent == want, f"rank {r}: every micro-batch of its steps, in order"
            for b in batches:
                step = plan[b.step]
                assert b.info.micro_count == len(step.micros_for(r))
                assert b.info.optimizer_step == step.info.optimizer_step
                assert b.info.step_samples == step.info.step_samples  # the whole step's
                mine = step.micros_for(r)[b.info.micro_index]
                assert list(b.sample_ids) == [str(i) for i in mine.sample_ids]
                if not b.filler:
                    ids.update(b.sample_ids)
            fetched = sum(len(s.rank_samples(r)) for s in plan)
            assert job.rt.payloads.fetched_by_rank()[r] == fetched  # once per (step, rank)
        assert ids == Counter(str(s.sample_id) for s in job.samples)
        assert any(len(s.micros_for(r)) > 1 for s in plan for r in range(3))
    finally:
        job.close()
