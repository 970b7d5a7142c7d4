"""The gRPC channel both clients open (`BatchStream`, `RefillStream`): message limits, gRPC's own
load-balancing failover over the target's addresses, and liveness.

Failover (#40 item 2): the default policy, `round_robin`, connects to every address the target
resolves to (a `dns:///` name, a list, a host name) and checks each replica's gRPC health
(`healthCheckConfig`): a replica that reports NOT_SERVING (it cannot reach the job's state, or
it drains) is not picked while its connection stays up, and each new call goes to the next
healthy one. `pick_first` (one connection, no health checking) stays on the first address that
answers; only a list of addresses is then rotated after a failure (`rotated`).

Liveness (Guarantee 8): the channel pings the replica every `keepalive_time_s` when nothing
arrives (also between calls) and drops the connection when a ping is unanswered for
`keepalive_timeout_s`, so a silent replica (frozen, or cut off in either direction) is noticed
within their sum (8 s by default); the stream then fails over to another address of the target.
A connection attempt whose HTTP/2 handshake does not complete within `keepalive_timeout_s` is
given up (a frozen replica's listening socket still accepts TCP connections), and reconnection
backs off no longer than `max_backoff_s`. The service accepts pings every 2 s (its
`min_client_ping_interval_s`), so these defaults never get GOAWAY "too_many_pings".
"""

from __future__ import annotations

import json

import grpc


def channel_options(*, max_message_mb: int, load_balancing: str, keepalive_time_s: float,
                    keepalive_timeout_s: float, max_backoff_s: float
                    ) -> list[tuple[str, int | str]]:
    def ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    n = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n),
            ("grpc.service_config", json.dumps({
                "loadBalancingConfig": [{load_balancing: {}}],
                # The server's overall health (""): NOT_SERVING replicas are not picked.
                "healthCheckConfig": {"serviceName": ""}})),
            ("grpc.keepalive_time_ms", ms(keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(keepalive_timeout_s)),
            # (gRPC core >= 1.6x times a keepalive ping out by its ping timeout, 1 min by
            # default: without this a frozen replica went unnoticed for a minute.)
            ("grpc.http2.ping_timeout_ms", ms(keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # gRPC core's minimum connect timeout (despite the name): the handshake bound.
            ("grpc.min_reconnect_backoff_ms", ms(keepalive_timeout_s)),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", ms(max_backoff_s))]


def rotated(endpoint: str) -> str | None:
    """A target listing several addresses (`ipv4:a:1,b:2`, `ipv6:...`) with the first moved
    last; None for any other target. Under `pick_first`, a stream the replica itself ended
    UNAVAILABLE (it could not reach the job's state) reconnects through the next address
    first: `pick_first` would pick the same, still connected, replica again."""
    scheme, sep, rest = endpoint.partition(":")
    addresses = rest.split(",") if sep and scheme in ("ipv4", "ipv6") else []
    if len(addresses) < 2:
        return None
    return f"{scheme}:{','.join(addresses[1:] + addresses[:1])}"


def open_channel(endpoint: str, options: list[tuple[str, int | str]], *,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None) -> grpc.Channel:
    """TLS when `root_certificates` is given (a key and chain: mutual TLS)."""
    if root_certificates is None:
        return grpc.insecure_channel(endpoint, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
    return grpc.secure_channel(endpoint, creds, options=options)
