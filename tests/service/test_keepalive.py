"""Keepalive as a pair (Guarantee 8): a client at its default keepalive settings against a server
at its defaults keeps an idle stream open however long the trainer is busy.

The client pings every 4 s when nothing arrives. A server that accepted pings less often (gRPC's
own default: one per 5 minutes, two strikes) answers the third ping after the last data frame
with GOAWAY "too_many_pings": the stream breaks (the client reconnects) and the client doubles
its ping interval, so a frozen replica would be noticed ever later. Heartbeats (data frames)
are turned off here so that nothing but pings crosses the idle stream, as between two calls.
"""

from __future__ import annotations

import time

from service_helpers import job_dict, service_config, serving

from pipeline.config import GrpcConfig
from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchStream

IDLE = 18.0  # seconds without data either way: 4 client pings, GOAWAY would come at the third


def test_default_keepalive_pings_never_get_goaway_on_an_idle_stream():
    defaults = GrpcConfig()
    assert (defaults.keepalive_time_s, defaults.keepalive_timeout_s,
            defaults.min_client_ping_interval_s) == (4.0, 4.0, 2.0)
    # (No heartbeats here: a lease longer than the test, it is not what this test is about.)
    cfg = service_config(job_dict("idle", world_size=1)).model_copy(
        update={"lease_seconds": 3600.0})
    with serving(cfg, {"idle": synthetic_samples(200)}) as svc:
        rt = svc.runtimes["idle"]
        with BatchStream(svc.address, "idle", 0, 1, prefetch=1, heartbeat_s=3600.0) as s:
            it = iter(s)
            first = next(it)
            time.sleep(IDLE)  # a long eval: the queue is full, nothing but pings moves
            assert s.reconnects == 0  # the stream was never broken
            # (Taking the first batch freed its slot: the second waits in the client's queue.)
            assert rt.ranks[0].connected and rt.ranks[0].delivered == first.info.step + 1
            second = next(it)  # the same stream goes on
            assert second.info.step == first.info.step + 1 and s.reconnects == 0
