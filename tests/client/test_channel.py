"""The clients' channel: every policy checks the replicas' health (round_robin, the default,
then skips a NOT_SERVING replica: tests/faults/test_state_cut_failover.py), under `pick_first` a
target of several addresses is tried from the next one after a failure (it would pick a
replica that is still connected, though it ended the stream itself), and the keepalive options
are the contract's (tests/service/test_keepalive.py tests the pair against a server)."""

from __future__ import annotations

import inspect
import json

from trainer_client import BatchStream, RefillStream
from trainer_client.channel import channel_options, rotated


def test_a_list_of_addresses_rotates_and_anything_else_does_not():
    assert rotated("ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.1:3") == (
        "ipv4:127.0.0.1:2,127.0.0.1:3,127.0.0.1:1")
    assert rotated("ipv6:[::1]:1,[::1]:2") == "ipv6:[::1]:2,[::1]:1"
    for target in ("127.0.0.1:1", "ipv4:127.0.0.1:1", "dns:///odb:50051", "unix:/tmp/s"):
        assert rotated(target) is None


def test_both_clients_balance_over_healthy_replicas_by_default():
    for cls in (BatchStream, RefillStream):
        assert inspect.signature(cls).parameters["load_balancing"].default == "round_robin"
    for policy in ("round_robin", "pick_first"):
        opts = dict(channel_options(max_message_mb=1, load_balancing=policy,
                                    keepalive_time_s=4.0, keepalive_timeout_s=4.0,
                                    max_backoff_s=2.0))
        config = json.loads(opts["grpc.service_config"])
        assert config == {"loadBalancingConfig": [{policy: {}}],
                          "healthCheckConfig": {"serviceName": ""}}


def test_keepalive_and_handshake_bounds_are_the_settings():
    opts = dict(channel_options(max_message_mb=1, load_balancing="pick_first",
                                keepalive_time_s=4.0, keepalive_timeout_s=4.0, max_backoff_s=2.0))
    assert opts["grpc.keepalive_time_ms"] == 4000 and opts["grpc.keepalive_timeout_ms"] == 4000
    assert opts["grpc.http2.ping_timeout_ms"] == 4000  # what actually times a ping out
    assert opts["grpc.keepalive_permit_without_calls"] == 1
    assert opts["grpc.http2.max_pings_without_data"] == 0
    assert opts["grpc.min_reconnect_backoff_ms"] == 4000  # the handshake bound
    assert opts["grpc.max_reconnect_backoff_ms"] == 2000
