"""Model-parallel groups through the rank stream without a server (`RankStreams` on the test's
own event loop): W=2 data-parallel ranks x 2 members receive identical batches at every step
and every sample once across the DP ranks, with one payload fetch per batch; a member that
resumes alone gets its group's position; a lost member is its rank's loss to the failure
policy, its own group's peer included; bad seats, a group on a job without pad_to_multiple and
members that disagree on the group size are refused at Open."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from stream_harness import StreamClient, StreamJob

from pipeline.errors import BadRequest, GroupRefused, RankTimedOut
from pipeline.service.data_server import status_of
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

PADDED = {"batching": {"pad_to_multiple": 8, "collate": "packed"}}


def member(job: StreamJob, rank: int, index: int, size: int = 2, **kw) -> StreamClient:
    kw.setdefault("client_id", f"c{rank}.{index}")
    return StreamClient(job, rank, group_size=size, group_rank=index, **kw)


async def lockstep(group: list[StreamClient]) -> list[list[pb.ServerMessage]]:
    """The group's members take each message together (as members of one model do: their
    collectives keep them in step) and ack it, until the job's final END."""
    got: list[list[pb.ServerMessage]] = [[] for _ in group]
    while True:
        msgs = await asyncio.gather(*(c.next() for c in group))
        for mine, m, c in zip(got, msgs, group, strict=True):
            mine.append(m)
            info = m.batch.info
            if m.WhichOneof("kind") == "batch" and info.micro_index == max(0, info.micro_count
                                                                           - 1):
                c.ack(m.batch.step)  # (a global step: once its last micro-batch is taken)
        if all(m.WhichOneof("kind") == "end" and m.end.job_done for m in msgs):
            for c in group:
                c.close()
            return got


@pytest.mark.parametrize("global_steps", [False, True], ids=["steps", "global-steps"])
def test_members_get_identical_batches_and_every_sample_once_with_one_fetch_per_batch(
        global_steps):
    """With global steps, every micro-batch of every step, and one fetch per (step, rank)."""
    batching = {**PADDED["batching"], "global_token_budget": 3 * 2048} if global_steps else (
        PADDED["batching"])
    job = StreamJob(world_size=2, samples=120 if global_steps else 60, batching=batching)
    try:
        async def main():
            groups = [[member(job, r, j) for j in range(2)] for r in range(2)]
            got = await asyncio.gather(*(lockstep(g) for g in groups))
            return got, [await c.outcome() for g in groups for c in g]

        got, outcomes = job.run(main())
    finally:
        job.close()
    assert outcomes == [None] * 4
    micros = [m.batch.info.micro_count for g in got for m in g[0] if m.WhichOneof("kind")
              == "batch"]
    assert (max(micros) > 1) == global_steps  # several micro-batches per step and rank
    for r, (first, second) in enumerate(got):
        assert len(first) == len(second) > 1
        for a, b in zip(first, second, strict=True):  # byte-identical, step by step
            assert a.SerializeToString() == b.SerializeToString()
            if a.WhichOneof("kind") == "batch":
                assert a.batch.rank == r
                cu = next(t for t in a.batch.tensors if t.name == "cu_seqlens")
                assert all(int(x) % 8 == 0 for x in memoryview(cu.data).cast("i"))
    ids = Counter(i for msgs in (got[0][0], got[1][0]) for m in msgs
                  if m.WhichOneof("kind") == "batch" for i in m.batch.sample_ids)
    assert sorted(ids) == sorted(str(s.sample_id) for s in job.samples)
    assert set(ids.values()) == {1}, "exactly once across the data-parallel ranks"
    # One payload fetch per batch for the group's two members on this replica.
    fetched = job.rt.payloads.fetched_by_rank()
    for r in range(2):
        delivered = sum(len(m.batch.sample_ids) for m in got[r][0]
                        if m.WhichOneof("kind") == "batch")
        assert fetched[r] == delivered
    # Both members acked through the end: the rank's cursor is the group's.
    assert [job.state.acked(r) for r in range(2)] == [
        max(m.batch.step for m in got[r][0] if m.WhichOneof("kind") == "batch") for r in (0, 1)]


def test_a_member_that_resumes_alone_gets_its_groups_position():
    job = StreamJob(world_size=1, samples=200, prefetch=2, **PADDED)
    try:
        async def main():
            a, b = member(job, 0, 0), member(job, 0, 1)
            seen: dict[int, bytes] = {}
            for _ in range(3):  # three steps in lockstep, acked by both
                ma, mb = await a.next(), await b.next()
                assert ma.SerializeToString() == mb.SerializeToString()
                seen[ma.batch.step] = ma.SerializeToString()
                a.ack(ma.batch.step)
                b.ack(mb.batch.step)
            ma = await a.next()  # a takes the 4th and 5th and acks them; b dies before
            a.ack(ma.batch.step)
            seen[ma.batch.step] = ma.SerializeToString()
            ma = await a.next()
            a.ack(ma.batch.step)
            seen[ma.batch.step] = ma.SerializeToString()
            await asyncio.sleep(0.3)  # (the acks are recorded)
            b.task.cancel()  # killed: its stream vanishes, its seat stays held
            await asyncio.gather(b.task, return_exceptions=True)
            # A new process for member 1 (a new client id, no state of its own).
            b2 = member(job, 0, 1, client_id="c0.1-restarted", resume_step=-1)
            first = await b2.next()
            group_position = job.state.acked(0) + 1
            for c in (a, b2):
                c.close()
            await asyncio.gather(a.outcome(), b2.outcome())
            return first, group_position, seen

        first, position, seen = job.run(main())
    finally:
        job.close()
    assert position == 3, "the group's cursor is its slowest member's: b acked through 2"
    assert first.batch.step == position
    assert first.SerializeToString() == seen[position], "the batch its peer had, byte-identical"


def test_a_lost_member_is_its_ranks_loss_to_every_stream_its_peer_included():
    """`fail`: member 1 of rank 1 goes silent (no ack, no heartbeat): its seat's lease lapses
    and with it the group's; after the rank timeout every other stream ends ABORTED naming
    rank 1, member 0 of rank 1 too."""
    job = StreamJob(world_size=2, samples=400, lease_seconds=0.6, rank_timeout_seconds=0.6,
                    prefetch=1, **PADDED)
    try:
        async def main():
            clients = {(r, j): member(job, r, j) for r in range(2) for j in range(2)}
            silent = clients[(1, 1)]
            for c in clients.values():
                await c.next()
            start = time.monotonic()

            async def beat(c: StreamClient) -> BaseException | None:
                while not c.task.done():
                    c.heartbeat()
                    await asyncio.sleep(0.1)
                return await c.outcome()

            outcomes = await asyncio.gather(*(beat(c) for k, c in clients.items()
                                              if c is not silent))
            elapsed = time.monotonic() - start
            silent.task.cancel()
            return outcomes, elapsed

        outcomes, elapsed = job.run(main(), timeout=30)
    finally:
        job.close()
    assert all(isinstance(o, RankTimedOut) and "rank 1 has been gone" in str(o)
               for o in outcomes), outcomes
    assert 0.6 + 0.6 <= elapsed < 10


@pytest.mark.parametrize(("kw", "error", "text"), [
    ({"group_size": 2, "group_rank": 2}, BadRequest, "group_rank must be in [0, group_size)"),
    ({"group_size": 2, "group_rank": -1}, BadRequest, "group_rank must be in [0, group_size)"),
    ({"group_size": 1025, "group_rank": 0}, BadRequest, "group_size in [1, 1024]"),
    ({"group_size": 2, "client_id": "group:2"}, BadRequest, "must not start with 'group:'"),
])
def test_a_bad_seat_is_refused_at_open(kw, error, text):
    job = StreamJob(world_size=2, **PADDED)
    try:
        async def main():
            return await StreamClient(job, 0, **kw).outcome()

        out = job.run(main())
    finally:
        job.close()
    assert isinstance(out, error) and text in str(out)
    assert status_of(out).name == "INVALID_ARGUMENT"


def test_a_group_needs_pad_to_multiple_and_members_agreeing_on_its_size():
    unpadded = StreamJob(world_size=2)
    try:
        async def open_group():
            return await member(unpadded, 0, 0).outcome()

        out = unpadded.run(open_group())
    finally:
        unpadded.close()
    assert isinstance(out, GroupRefused) and status_of(out).name == "FAILED_PRECONDITION"
    assert str(out).startswith("group refused") and "batching.pad_to_multiple" in str(out)

    job = StreamJob(world_size=2, **PADDED)
    try:
        async def disagree():
            a = member(job, 0, 0, size=2)
            await a.next()
            other = await member(job, 0, 1, size=4, client_id="x").outcome()
            alone = await StreamClient(job, 0, client_id="y").outcome()
            a.close()
            await a.outcome()
            return other, alone

        other, alone = job.run(disagree())
    finally:
        job.close()
    for out, size in ((other, 4), (alone, 1)):
        assert isinstance(out, GroupRefused) and status_of(out).name == "FAILED_PRECONDITION"
        assert str(out).startswith("group_size mismatch")
        assert "group of 2, member 0 (client 'c0.0')" in str(out)
        assert f"opened it with group_size {size}" in str(out)
