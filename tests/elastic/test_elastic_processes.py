"""Elastic world size mid-epoch with real processes, real Redis and real gRPC (docs/elastic.md).

Every rank is its own process consuming at its own pace and saving its state_dict after every
batch, like a trainer worker. Whatever the switch (an operator's `odb-pipeline scale`, the Scale
call, a rank killed under `rank_failure_policy: shrink`, a torchrun-style restart of every worker
with a new WORLD_SIZE on an `elastic` job), the union of what the ranks consumed is the epoch
exactly once, every step of each world reached all of that world's ranks, and every batch's
loss-scale totals are its step's."""

from __future__ import annotations

import json
import signal

import grpc
import pytest
from elastic_helpers import (
    RankProc,
    assert_exactly_once,
    check_global_steps,
    check_worlds,
    global_reference,
    samples,
    scale_cli,
    served,
)
from support.waiting import wait_for

from pipeline.coordinator import RedisJobState
from pipeline.jobstate import ScaleReason
from pipeline.observability.status_view import ServiceView
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


def _progress(ranks: list[RankProc], n: int) -> bool:
    return all(len(r.batches()) >= n for r in ranks)


# Global steps (docs/global-steps.md): micro-batches of up to 1024 in steps of up to 8192 for
# all ranks together, the same steps at every world size.
GLOBAL = {"token_budget": 1024, "max_window_samples": 64, "global_token_budget": 8192}


@pytest.mark.parametrize("steps", ["per-rank", "global"])
def test_four_then_two_then_three_ranks_in_one_epoch_exactly_once(redis_client, redis_url,
                                                                  tmp_path, steps):
    items = samples(1500)
    job = {"batching": GLOBAL} if steps == "global" else {}
    with served(redis_url, "el", 4, items, job=job) as svc:
        # Each world's ranks hold after 5 batches until its switch was requested: mid-epoch
        # however long the scale command takes to start on a loaded machine.
        gates = [tmp_path / f"gate-{n}" for n in range(2)]
        old = [RankProc(tmp_path, svc.address, "el", r, 4, sleep=0.01 * (r + 1), gate=gates[0],
                        hold_after=5) for r in range(4)]
        wait_for(lambda: _progress(old, 5), 60, "every rank of 4 to take 5 batches")
        reply = scale_cli(svc.address, "el", 2)  # the operator's command, in its own process
        gates[0].touch()
        assert reply["changed"] and reply["world"]["world_size"] == 2
        b0 = reply["previous"]["last_step"]
        for r in old:
            end = r.finish().end()
            # In-band END: reconfigure, the new size, not done; every live rank ran through B.
            assert (end["end"], end["world_size"], end["done"]) == ("reconfigure", 2, False)
            assert end["final_step"] == b0 and r.batches()[-1]["step"] == b0
        # New world: states of *other* old ranks restore its ranks.
        mid = [RankProc(tmp_path, svc.address, "el", 0, 2, restore=old[3].state, sleep=0.02,
                        gate=gates[1], hold_after=5),
               RankProc(tmp_path, svc.address, "el", 1, 2, restore=old[1].state, sleep=0.03,
                        gate=gates[1], hold_after=5)]
        wait_for(lambda: _progress(mid, 5), 60, "both ranks of 2 to take 5 batches")
        with grpc.insecure_channel(svc.address) as ch:  # the API a launcher would call
            second = pb_grpc.DataServiceStub(ch).Scale(
                pb.ScaleRequest(job_id="el", world_size=3), timeout=30)
        gates[1].touch()
        assert second.changed and second.previous.world_size == 2
        for r in mid:
            end = r.finish().end()
            assert (end["end"], end["world_size"]) == ("reconfigure", 3)
        last = [RankProc(tmp_path, svc.address, "el", 0, 3, sleep=0.01),  # no state: cursor
                RankProc(tmp_path, svc.address, "el", 1, 3, restore=mid[0].state, sleep=0.02),
                RankProc(tmp_path, svc.address, "el", 2, 3, restore=mid[1].state, sleep=0.01)]
        for r in last:
            end = r.finish().end()
            assert (end["end"], end["done"]) == ("epoch", True)
        state = RedisJobState.attach(redis_url, "el")
        worlds = state.worlds()
        assert [w.world_size for w in worlds] == [4, 2, 3]
        assert [w.reason for w in worlds] == [ScaleReason.INITIAL, ScaleReason.SCALE,
                                              ScaleReason.SCALE]
        assert worlds[1].first_step == worlds[0].published_through + 1 > b0  # write-once
        records = [x for r in old + mid + last for x in r.batches()]
        assert_exactly_once(records, items)
        if steps == "global":  # every step: the uninterrupted run's samples, at W = 4, 2, 3
            check_global_steps(records, global_reference(items, GLOBAL, seed=3))
        else:
            check_worlds(records, worlds, last_world_closes=True)
        assert state.counters().samples_planned == len(items)  # returned ones re-planned once
        # Visible: the world-size history with the time from request to first batch everywhere.
        view = ServiceView(svc.runtimes, svc.replica_id).job("el")
        hist = view["worlds"]
        assert [h["world_size"] for h in hist] == [4, 2, 3]
        for h in hist[1:]:
            assert h["adopted_s"] is not None and h["first_batch_s"] is not None
            assert h["drained_s"] is not None
            assert set(h["first_batch_s_by_rank"]) == set(range(h["world_size"]))
            assert 0 <= h["adopted_s"] <= h["first_batch_s"]


def test_a_killed_rank_under_shrink_leaves_a_smaller_world_exactly_once(redis_client, redis_url,
                                                                        tmp_path):
    items = samples(1200, seed=2)
    # A lease long enough that a live rank's heartbeat never misses it on a loaded machine, and
    # a timeout long enough that both ranks of the new world claim within it (a rank of a new
    # world that never claims is timed from the world's first claim).
    with served(redis_url, "sh", 3, items, lease_seconds=2.0, rank_timeout_seconds=4.0,
                rank_failure_policy="shrink") as svc:
        old = [RankProc(tmp_path, svc.address, "sh", r, 3, sleep=0.05) for r in range(3)]
        wait_for(lambda: _progress(old, 3), 60, "every rank to take 3 batches")
        old[1].proc.send_signal(signal.SIGKILL)
        old[1].proc.wait(10)
        live = [old[0], old[2]]
        for r in live:  # the lease lapses, the timeout passes, the live ranks shrink to 2
            end = r.finish().end()
            assert (end["end"], end["world_size"], end["done"]) == ("reconfigure", 2, False)
        state = RedisJobState.attach(redis_url, "sh")
        w0, w1 = state.worlds()
        assert w1.reason is ScaleReason.SHRINK and w0.live_ranks == (0, 2)
        dead_last = w0.last_steps[1]
        assert w0.last_steps[0] == w0.last_steps[2] == w0.last_step
        new = [RankProc(tmp_path, svc.address, "sh", i, 2, restore=r.state, sleep=0.0)
               for i, r in enumerate(live)]
        for r in new:
            assert r.finish().end()["done"]
        dead = old[1].batches()
        kept = [x for x in dead if x["step"] <= dead_last]  # what the dead rank acknowledged
        redone = [x for x in dead if x["step"] > dead_last]  # in progress: handed back
        # The batch in progress, and the one before if its ack was still in flight: a client
        # acknowledges each batch as it takes the next (acks never trail by finished steps).
        assert len(redone) <= 2
        fresh = [x for r in new for x in r.batches()]
        records = kept + [x for r in live for x in r.batches()] + fresh
        assert_exactly_once(records, items)
        again = {i for x in fresh for i in x["ids"]}
        assert all(i in again for x in redone for i in x["ids"])  # re-planned, not lost
        check_worlds([x for x in records if x["world"] == 2], [w1], last_world_closes=True)
        for x in records:
            assert x["step"] <= w0.last_step or x["world"] == 2


def test_a_rank_lost_in_the_last_steps_of_a_fully_planned_job_under_shrink(redis_client,
                                                                          redis_url, tmp_path):
    """The whole job is planned (a small dataset, published in full within max_ahead) when a
    rank is killed: the survivors are not failed; the switch reopens the last epoch, the dead
    rank's unconsumed batches and the survivors' ungranted tail are re-planned for 2 ranks, and
    the new world finishes the epoch: every sample exactly once."""
    items = samples(400, seed=5)
    with served(redis_url, "fp", 3, items, lease_seconds=2.0, rank_timeout_seconds=4.0,
                rank_failure_policy="shrink", grpc={"port": 0, "prefetch_steps": 16}) as svc:
        state = RedisJobState.attach(redis_url, "fp")
        old = [RankProc(tmp_path, svc.address, "fp", r, 3, sleep=0.5) for r in range(3)]
        wait_for(lambda: _progress(old, 2), 60, "every rank to take 2 batches")
        wait_for(state.is_done, 30, "the job to be fully planned")
        planned_end = state.epoch_ends()[-1]
        old[1].proc.send_signal(signal.SIGKILL)
        old[1].proc.wait(10)
        live = [old[0], old[2]]
        for r in live:
            end = r.finish().end()
            assert (end["end"], end["world_size"], end["done"]) == ("reconfigure", 2, False)
        w0, w1 = state.worlds()
        assert w1.reason is ScaleReason.SHRINK and w0.live_ranks == (0, 2)
        assert w0.last_step < planned_end.last_step  # the unconsumed tail moved
        new = [RankProc(tmp_path, svc.address, "fp", i, 2, restore=r.state, sleep=0.0)
               for i, r in enumerate(live)]
        for r in new:
            assert r.finish().end()["done"]
        (end,) = state.epoch_ends()
        assert len(end.final_step) == 2 and state.is_done()
        dead = [x for x in old[1].batches() if x["step"] <= w0.last_steps[1]]
        fresh = [x for r in new for x in r.batches()]
        records = dead + [x for r in live for x in r.batches()] + fresh
        assert_exactly_once(records, items)
        check_worlds(fresh, [w1], last_world_closes=True)
        assert state.counters().samples_planned == len(items)


def test_torchrun_style_restart_with_a_new_world_size(redis_client, redis_url, tmp_path):
    """Every worker of a 3-rank world is killed (the agent restarts the group after losing a
    node); the new group of 2 restores the checkpoint every old rank had reached and opens with
    WORLD_SIZE=2 on an `elastic` job: once the old leases lapse, that Open reconfigures the job,
    everything after the checkpoint is re-planned, nothing before it repeats."""
    items = samples(1200, seed=3)
    with served(redis_url, "tr", 3, items, lease_seconds=1.0,
                job={"elastic": True}) as svc:
        old = [RankProc(tmp_path, svc.address, "tr", r, 3, sleep=0.03) for r in range(3)]
        wait_for(lambda: _progress(old, 5), 60, "every rank to take 5 batches")
        for r in old:
            r.kill()
        states = [json.loads(r.state.read_text()) for r in old]
        ckpt = min(old, key=lambda r: json.loads(r.state.read_text())["next_step"]).state
        s = min(st["next_step"] for st in states)
        new = [RankProc(tmp_path, svc.address, "tr", r, 2, restore=ckpt, sleep=0.0)
               for r in range(2)]
        for r in new:
            assert r.finish().end()["done"]
        state = RedisJobState.attach(redis_url, "tr")
        w0, w1 = state.worlds()
        assert w1.reason is ScaleReason.ELASTIC and w1.world_size == 2
        assert w0.last_steps == (s - 1,) * 3 and w0.live_ranks == ()
        consumed = [x for r in old for x in r.batches() if x["step"] < s]
        fresh = [x for r in new for x in r.batches()]
        assert_exactly_once(consumed + fresh, items)
        check_worlds(fresh, [w1], last_world_closes=True)
