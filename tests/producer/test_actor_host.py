"""The actor host replaces a stuck producer actor (real Ray, real Redis, the real producer
actor over Ray Data). A frozen actor (SIGSTOP: a hung host; its Redis link goes silent with it)
keeps its name in Ray, so re-creating it by name finds the frozen one: the host sees the lease
stay free while the actor is ALIVE and does not answer, and has Ray restart it. The new
process takes the lease over (a new generation) and plans on from the checkpoint; nothing
published changes. Two hosts supervise it (two replicas serve every job): the successor,
starting or planning, is never restarted again. A process that is no longer the actor's ends
alone, never the successor that has its actor id."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import ray
from support.waiting import wait_for

from pipeline.config import TrainingJobConfig
from pipeline.coordinator import RedisJobState
from pipeline.producer.actor import (
    ProcessId,
    actor_process,
    end_process,
    find_producer,
    stop_producer,
)
from pipeline.producer.hosting import ActorHost
from pipeline.producer.producer import ProducerSettings

CHATS = Path(__file__).resolve().parents[2] / "pipeline" / "sample_data" / "chats.jsonl"
pytestmark = pytest.mark.slow


def _info(job_id: str) -> dict:
    """The producer actor's `info()`. Right after a restart Ray may still route a call to the
    old process and answer ActorUnavailableError ("the actor is restarting") even though the
    new process already runs: ask again, within a bound."""
    got: list[dict] = []

    def answered() -> bool:
        try:
            got.append(ray.get(find_producer(job_id).info.remote(), timeout=30))
        except ray.exceptions.ActorUnavailableError:
            return False
        return True

    wait_for(answered, 60, f"the producer actor of {job_id!r} to answer", interval=0.2)
    return got[-1]


@pytest.mark.skipif(not CHATS.exists(), reason="sample data missing")
def test_a_frozen_producer_actor_is_restarted_and_a_successor_plans_on(ray_session, tmp_path,
                                                                        redis_url, redis_client):
    chats = tmp_path / "chats.jsonl"
    chats.write_bytes(b"".join(CHATS.read_bytes().splitlines(keepends=True)[:120]))
    job = TrainingJobConfig.model_validate({
        "job_id": "frozen", "world_size": 1, "epochs": 2, "source": {"paths": [str(chats)]},
        "batching": {"token_budget": 1024, "max_window_samples": 16, "pool_steps": 1}})
    st = RedisJobState.connect(redis_url, job)
    settings = ProducerSettings(lease_seconds=2.0, max_ahead=2, poll_seconds=0.05)
    hosts = [ActorHost(job, st, redis_url, settings=settings, check_seconds=0.5)
             for _ in range(2)]
    for host in hosts:
        host.start()
    pid = None
    try:
        # Back-pressure (nobody acks) holds the producer mid-plan, renewing its lease.
        wait_for(lambda: st.published_through() >= 2, 120, "the producer actor's first steps")
        info = _info("frozen")
        pid, gen = info["pid"], info["generation"]
        published = {n: st.get_step(n) for n in range(st.published_through() + 1)}
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: st.producer_lease().generation > gen, 60,
                 "a restarted producer to take the lease over")
        assert st.producer_lease().holder == info["holder"]  # the same actor, a new process
        successor = _info("frozen")
        restarts = actor_process(find_producer("frozen")).process
        assert restarts == 1, f"two hosts restarted one frozen process {restarts} times"
        st.ack(0, max(published))  # room: the successor plans on
        wait_for(lambda: st.published_through() > max(published), 60, "the successor's steps")
        assert {n: st.get_step(n) for n in published} == published  # never republished
        new = _info("frozen")
        assert new["pid"] == successor["pid"] != pid and new["generation"] > gen
        assert actor_process(find_producer("frozen")).process == 1, "the successor was restarted"
        # How a producer process ends for good (planned, fenced, failed), here for the frozen
        # one as if it had outlived its restart (cut off from Ray's GCS, not from Redis; Ray
        # SIGKILLs a frozen process it restarts on one node): it is no longer the actor's
        # process, so it exits alone (the exit is recorded, not done: this is the test's
        # process), and the successor, which has the same actor id, plans on.
        handle, exits = find_producer("frozen"), []
        assert not end_process(handle, ProcessId(pid, info["node"]), exit_process=exits.append)
        assert exits == [0]
        assert ray.get(handle.info.remote(), timeout=30)["pid"] == successor["pid"]
        assert actor_process(handle).process == 1
        # The successor's end: the actor's current process, so the actor ends for good.
        assert end_process(handle, ProcessId(successor["pid"], successor["node"]),
                           exit_process=exits.append)
        wait_for(lambda: find_producer("frozen") is None, 60, "the actor to end for good")
        assert exits == [0]
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for host in hosts:
            host.stop()
        stop_producer("frozen")
