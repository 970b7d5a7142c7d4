"""Scale requests and Opens around a reconfiguration, over real gRPC: every invalid request gets
a precise status code and changes nothing; a second switch is refused while the first one's old
ranks still drain; ranks of the ended world get END(reconfigure) in-band; positions the new
world cannot honour are refused; `odb-pipeline scale` and `status` show it all."""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from elastic_helpers import samples, served
from support.waiting import wait_for

from pipeline.cli import main
from pipeline.coordinator import RedisJobState
from pipeline.jobstate import ScaleReason
from trainer_client import BatchStream, Reconfigured, StreamError
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc
from trainer_client.wire_format import WIRE_VERSION

TOKEN = "s3cret"
MD = (("authorization", f"Bearer {TOKEN}"),)


def _scale(address: str, world_size: int, job: str = "sr", md=MD) -> pb.ScaleReply:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DataServiceStub(ch).Scale(
            pb.ScaleRequest(job_id=job, world_size=world_size), metadata=md, timeout=30)


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def _get(address: str) -> pb.JobStatus:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DataServiceStub(ch).GetJob(pb.GetJobRequest(job_id="sr"), metadata=MD,
                                                  timeout=10)


class Held:
    """A rank that takes one batch, then holds (its stream open and its lease live) until
    released, then consumes to its END."""

    def __init__(self, address: str, rank: int, world: int) -> None:
        # (Heartbeats well within the lease: a held rank stays live on a loaded machine.)
        self.stream = BatchStream(address, "sr", rank, world, token=TOKEN, prefetch=1,
                                  heartbeat_s=0.5, tensors="numpy")
        self.steps: list[int] = []
        self.gate = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for b in self.stream:
                self.steps.append(b.info.step)
                self.gate.wait()
        except BaseException as exc:
            self.error = exc


def test_invalid_scale_requests_get_precise_codes(redis_client, redis_url, capsys):
    with served(redis_url, "sr", 2, samples(600), token=TOKEN,
                job={"max_world_size": 16}) as svc:
        a = svc.address
        before = RedisJobState.attach(redis_url, "sr").worlds()
        for bad in (0, -3, 17):
            code, details = _code(lambda bad=bad: _scale(a, bad))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "[1, 16]" in details
        assert _code(lambda: _scale(a, 3, job="nope"))[0] == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: _scale(a, 3, md=()))[0] == grpc.StatusCode.UNAUTHENTICATED
        bad_md = (("authorization", "Bearer wrong"),)
        assert _code(lambda: _scale(a, 3, md=bad_md))[0] == grpc.StatusCode.UNAUTHENTICATED
        same = _scale(a, 2)  # the current size: nothing to do (an idempotent retry)
        assert not same.changed and same.world.world_size == 2
        assert RedisJobState.attach(redis_url, "sr").worlds() == before
        # The CLI: one-line errors, exit 2.
        assert main(["scale", "--endpoint", a, "--job", "nope", "--world-size", "3",
                     "--token", TOKEN]) == 2
        assert "NOT_FOUND" in capsys.readouterr().err
        assert main(["scale", "--endpoint", a, "--job", "sr", "--world-size", "0"]) == 2
        assert "--world-size must be >= 1" in capsys.readouterr().err


def _consume(address: str, world: int) -> list[str]:
    got: list[list[str]] = [[] for _ in range(world)]

    def rank(r: int) -> None:
        with BatchStream(address, "sr", r, world, token=TOKEN, tensors="numpy") as s:
            got[r] = [i for b in s for i in b.info.sample_ids]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return [i for ids in got for i in ids]


@pytest.mark.parametrize("elastic", [False, True])
def test_a_finished_job_keeps_its_world(redis_client, redis_url, capsys, elastic):
    """#42: `scale` moved a finished job onto another world (status then showed it). A finished
    job's world is what it ran: Scale, and an elastic job's Open with another size, are refused
    (the Open's status says final: the client does not retry it)."""
    items = samples(120)
    with served(redis_url, "sr", 2, items, token=TOKEN, job={"elastic": elastic}) as svc:
        a = svc.address
        assert sorted(_consume(a, 2)) == sorted(s.sample_id for s in items)
        state = RedisJobState.attach(redis_url, "sr")
        wait_for(lambda: state.acked_all() == [e for e in state.epoch_ends()[-1].final_step],
                 30, "both ranks' last acks")
        before = state.worlds()
        code, details = _code(lambda: _scale(a, 1))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "job 'sr' has finished (every rank acknowledged its last step)" in details
        assert main(["scale", "--endpoint", a, "--job", "sr", "--world-size", "1",
                     "--token", TOKEN]) == 2
        assert "has finished" in capsys.readouterr().err
        if elastic:
            with BatchStream(a, "sr", 0, 1, token=TOKEN, reconnect_timeout=60) as s, \
                    pytest.raises(StreamError, match="has finished") as err:
                list(s)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and s.reconnects == 0
        assert state.worlds() == before and state.head().world_size == 2


def test_a_second_switch_waits_for_the_first_and_old_ranks_end_in_band(redis_client, redis_url,
                                                                       capsys):
    with served(redis_url, "sr", 2, samples(900), token=TOKEN) as svc:
        a = svc.address
        # The plan runs ahead of the ranks' credits before they open, so each held stream waits
        # for a credit with steps left to send, and drains only when its rank moves on. (A
        # stream already sent all that was published learns of the switch at once and leaves
        # with its END(reconfigure): nothing would be left to drain.)
        state = svc.runtimes["sr"].state
        wait_for(lambda: state.published_through() >= 5, 30, "the plan to run ahead")
        held = [Held(a, r, 2) for r in range(2)]
        wait_for(lambda: all(h.steps for h in held), 30, "both ranks' first batch")
        assert main(["scale", "--endpoint", a, "--job", "sr", "--world-size", "1",
                     "--token", TOKEN, "--json"]) == 0
        first = json.loads(capsys.readouterr().out)
        b = first["previous"]["last_step"]
        assert first["changed"] and first["previous"]["rank_last_steps"] == [b, b]
        # The old ranks hold their streams: the switch is in progress until they drained.
        wait_for(lambda: state.world_timings(1).adopted_at is not None, 30, "the new plan")
        code, details = _code(lambda: _scale(a, 3))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "draining" in details
        assert _get(a).reconfiguring
        assert main(["scale", "--endpoint", a, "--job", "sr", "--world-size", "3",
                     "--token", TOKEN]) == 2
        assert "FAILED_PRECONDITION" in capsys.readouterr().err
        for h in held:
            h.gate.set()
        for h in held:
            h.thread.join(30)
            assert h.error is None, h.error
            end = h.stream.last_end
            assert (end.reason, end.world_size, end.final_step) == ("reconfigure", 1, b)
            assert not h.stream.done and h.steps[-1] == b
            with pytest.raises(Reconfigured, match="BatchStream"):
                next(iter(h.stream))
            h.stream.close()
        wait_for(lambda: not _get(a).reconfiguring, 10, "the old ranks to have left")
        # A rank of the ended world that comes back without a state: END(reconfigure) at once.
        with BatchStream(a, "sr", 0, 2, token=TOKEN, tensors="numpy") as late:
            assert list(late) == [] and late.last_end.reason == "reconfigure"
        # Not elastic: a third size is refused, naming the way to reconfigure.
        with BatchStream(a, "sr", 0, 5, token=TOKEN, tensors="numpy") as wrong:
            with pytest.raises(Exception) as err:
                list(wrong)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "world sizes so far: 2 -> 1" in err.value.details
            assert "scale" in err.value.details
        # A position inside the old world (before its boundary) cannot be honoured.
        with grpc.insecure_channel(a) as ch:
            call = pb_grpc.DataServiceStub(ch).Stream(iter([pb.ClientMessage(open=pb.Open(
                job_id="sr", rank=0, world_size=1, resume_step=0, resume_epoch=0,
                client_id="x", credits=1, wire_version=WIRE_VERSION))]), metadata=MD)
            code, details = _code(lambda: next(call))
        assert code == grpc.StatusCode.OUT_OF_RANGE and "inside world 0" in details
        # The next switch is accepted now; status shows the history.
        assert _scale(a, 3).changed
        assert main(["status", "--endpoint", a, "--job", "sr", "--token", TOKEN]) == 0
        out = capsys.readouterr().out
        assert f"world sizes: 2 [0-{b}] -> 1 [" in out and "-> 3 [" in out
        st = _get(a)
        assert [w.world_size for w in st.worlds] == [2, 1, 3]
        assert [w.reason for w in st.worlds] == ["initial", "scale", "scale"]
        assert st.worlds[0].last_step == b and st.world_size == 3


def test_a_fully_planned_job_cannot_move_once_a_live_rank_was_sent_its_last_batch(
        redis_client, redis_url):
    """(Otherwise it moves: test_elastic_processes.py, tests/elastic/test_reopen_state.py.)"""
    with served(redis_url, "sr", 2, samples(30), token=TOKEN) as svc:
        st = svc.runtimes["sr"].state
        wait_for(st.is_done, 30, "the plan")
        last = st.epoch_ends()[-1].final_step[0]
        stream = BatchStream(svc.address, "sr", 0, 2, token=TOKEN, prefetch=16,
                             tensors="numpy")
        next(iter(stream))
        wait_for(lambda: st.grant([(0, 0, -1)])[0].through >= last, 30,
                 "rank 0 to be sent its last batch")
        code, details = _code(lambda: _scale(svc.address, 3))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "fully planned" in details
        assert "ranks [0]" in details  # rank 1 never came: its batches cannot move
        stream.close()


def test_an_aligned_loader_does_not_mistake_a_world_end_for_the_epochs(redis_client, redis_url):
    """Runtimes without Join (StreamLoader, HF, Lightning) read the end of a pass as the end of
    the epoch: a world that ends mid-epoch raises `Reconfigured` instead, so the worker restarts
    as a rank of the new world from its checkpoint rather than skipping the epoch's rest."""
    from trainer_client import StreamLoader

    with served(redis_url, "sr", 1, samples(900), token=TOKEN) as svc:
        stream = BatchStream(svc.address, "sr", 0, 1, token=TOKEN, prefetch=1, tensors="numpy")
        loader = StreamLoader(stream, align=True)
        it = iter(loader)
        taken = [next(it).info.step]
        assert _scale(svc.address, 2).changed
        with pytest.raises(Reconfigured) as err:
            for b in it:
                taken.append(b.info.step)
        assert err.value.world_size == 2
        assert taken == list(range(len(taken)))  # every batch up to the boundary, in order
        assert stream.last_end.final_step == taken[-1]
        stream.close()


def test_a_group_back_at_the_previous_size_is_a_new_world_not_the_old_one(redis_client,
                                                                          redis_url):
    """2 -> 1 -> 2 on an elastic job (a node lost, then back): an Open with the previous
    world's size is a rank of that world draining, unless it restores a position past the
    current world's first step, which no rank of the previous world can hold: then it is a new
    world of that size. Every sample once across the three worlds."""
    items = samples(600)
    with served(redis_url, "sr", 2, items, token=TOKEN, lease_seconds=1.0,
                job={"elastic": True}) as svc:
        a = svc.address

        def opened(rank: int, world: int, state: dict | None = None) -> BatchStream:
            s = BatchStream(a, "sr", rank, world, token=TOKEN, prefetch=1, heartbeat_s=0.25,
                            tensors="numpy")
            if state is not None:
                s.load_state_dict(state)
            return s

        def take(stream: BatchStream, n: int | None) -> list[str]:
            it, ids = iter(stream), []
            for _ in range(n) if n is not None else iter(int, 1):
                batch = next(it, None)
                if batch is None:
                    break
                ids += batch.info.sample_ids
            return ids

        trained, first = [], [opened(r, 2) for r in range(2)]
        for s in first:
            trained += take(s, 3)  # steps 0-2 on both ranks, then the node is lost
        lost_at = first[0].state_dict()
        for s in first:
            s.close()
        alone = opened(0, 1, lost_at)  # the Open that moves the job once the leases lapsed
        trained += take(alone, 3)
        state = RedisJobState.attach(redis_url, "sr")
        w1 = state.worlds()[1]
        assert (w1.world_size, w1.first_step) == (1, alone.next_step - 3)
        # The previous size without a position (or with one at most the current world's first
        # step) is still a rank of the ended world: END(reconfigure) at once, nothing moves.
        with opened(0, 2) as late:
            assert list(late) == [] and late.last_end.reason == "reconfigure"
        with opened(1, 2, lost_at) as late:
            assert list(late) == [] and late.last_end.world_size == 1
        back_at = alone.state_dict()
        alone.close()
        back = [opened(r, 2, back_at) for r in range(2)]
        with ThreadPoolExecutor(2) as pool:  # both ranks at once: neither runs far ahead
            for ids in pool.map(lambda s: take(s, None), back):
                trained += ids
        for s in back:
            assert s.done
            s.close()
        worlds = state.worlds()
        assert [w.world_size for w in worlds] == [2, 1, 2]
        assert [w.reason for w in worlds] == [ScaleReason.INITIAL, ScaleReason.ELASTIC,
                                              ScaleReason.ELASTIC]
        assert worlds[0].last_steps == (2, 2)
        assert worlds[1].last_steps == (back_at["next_step"] - 1,)
        assert Counter(trained) == Counter(s.sample_id for s in items)
