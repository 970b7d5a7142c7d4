"""4 -> 2 -> 4 ranks in one epoch, in one process over loopback gRPC: every step and END knows
its world (`WorldStamp`), so the first and the last world (both of 4 ranks) are never taken for
one another. Every sample once across the three worlds; each batch's `world_size` is its
world's; the old ranks get END(reconfigure) naming the next size, the last world the epoch's
END naming its 4 ranks."""

from __future__ import annotations

import threading
from collections import Counter

import grpc
from service_helpers import job_dict, service_config, serving
from support.waiting import wait_for

from pipeline.planner.types import WorldStamp
from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchStream
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc


class Rank:
    """Consumes one stream to its END; holds after `hold_after` batches until released."""

    def __init__(self, address: str, rank: int, world: int, hold_after: int | None) -> None:
        self.stream = BatchStream(address, "w", rank, world, prefetch=2, tensors="numpy")
        self.batches: list = []
        self.hold_after = hold_after
        self.gate = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for b in self.stream:
                self.batches.append(b.info)
                if len(self.batches) == self.hold_after:
                    self.gate.wait(60)
        except BaseException as exc:
            self.error = exc

    def finish(self) -> pb.End:
        self.gate.set()
        self.thread.join(60)
        assert self.error is None and not self.thread.is_alive()
        self.stream.close()
        return self.stream.last_end


def scale(address: str, n: int) -> pb.ScaleReply:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DataServiceStub(ch).Scale(pb.ScaleRequest(job_id="w", world_size=n),
                                                 timeout=30)


def test_four_then_two_then_four_ranks_in_one_epoch():
    items = synthetic_samples(3000, max_len=300, seed=4)
    cfg = service_config(job_dict("w", 4, batching={"token_budget": 1024}))
    with serving(cfg, {"w": items}) as svc:
        worlds: list[list[Rank]] = []
        for size, hold in ((4, 3), (2, 3), (4, None)):
            ranks = [Rank(svc.address, r, size, hold) for r in range(size)]
            worlds.append(ranks)
            if hold is None:
                break
            wait_for(lambda ranks=ranks, n=hold: all(len(r.batches) >= n for r in ranks), 30,
                     f"every rank of {size} to take {hold} batches")
            reply = scale(svc.address, {4: 2, 2: 4}[size])
            assert reply.changed
            for r in ranks:
                end = r.finish()
                assert (end.reason, end.world_size) == ("reconfigure", {4: 2, 2: 4}[size])
        ends = [r.finish() for r in worlds[2]]
        state = svc.runtimes["w"].state
        assert [w.world_size for w in state.worlds()] == [4, 2, 4]
        (end0,) = state.epoch_ends()
        assert end0.world == WorldStamp(2, 4)  # the epoch ended in the last world
        assert all(e.reason == "epoch" and e.job_done for e in ends)
        seen = Counter()
        for g, ranks in enumerate(worlds):
            w = state.worlds()[g]
            for r in ranks:
                for info in r.batches:
                    assert info.world_size == w.world_size  # stamped: the world that runs it
                    assert info.step >= w.first_step
                    assert w.last_steps is None or info.step <= w.last_steps[info.rank]
                    seen.update(info.sample_ids)
        assert sorted(seen) == sorted(str(s.sample_id) for s in items)
        assert set(seen.values()) == {1}
