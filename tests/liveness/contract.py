"""The liveness contract's settings as the fault suite uses them, by their exact names.

Server: `ServiceConfig.grpc.keepalive_time_s / keepalive_timeout_s / min_client_ping_interval_s`,
`ServiceConfig.state_timeout_seconds`, `lease_seconds`, `rank_timeout_seconds`. Client
(`BatchStream`, `RefillStream`): `keepalive_time_s`, `keepalive_timeout_s`, `heartbeat_s`
(BatchStream). Wire: `ClientMessage.heartbeat = 3` (`Heartbeat {}`).

A name the code under test does not know yet is left out of what the scenarios pass (and listed
by `missing_names`), so a scenario runs on such code with its defaults and fails for the
liveness it lacks, not for a config it cannot parse.
"""

from __future__ import annotations

import inspect
from typing import Any

from pipeline.config import GrpcConfig, ServiceConfig

KEEPALIVE_TIME_S = 1.0
KEEPALIVE_TIMEOUT_S = 1.0
HEARTBEAT_S = 0.5
LEASE_S = 3.0
RANK_TIMEOUT_S = 3.0
STATE_TIMEOUT_S = 3.0
# How long a silent peer may go unnoticed by a client: one idle keepalive period, then an
# unanswered ping (the contract's documented bound is this sum for its own settings).
KEEPALIVE_BOUND_S = KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S
# ...and until it is served elsewhere: reconnecting, it may try the silent replica's address
# first again (a frozen host's kernel still completes the TCP handshake, a black hole accepts
# it), an attempt it must give up in a bound of its own: taken here as no longer than the
# keepalive bound (the contract bounds the whole failover by 10 s with its 8 s defaults).
FAILOVER_BOUND_S = 2 * KEEPALIVE_BOUND_S

SERVICE = {"lease_seconds": LEASE_S, "rank_timeout_seconds": RANK_TIMEOUT_S,
           "state_timeout_seconds": STATE_TIMEOUT_S}
GRPC = {"keepalive_time_s": KEEPALIVE_TIME_S, "keepalive_timeout_s": KEEPALIVE_TIMEOUT_S,
        "min_client_ping_interval_s": 0.5}
CLIENT = {"keepalive_time_s": KEEPALIVE_TIME_S, "keepalive_timeout_s": KEEPALIVE_TIMEOUT_S,
          "heartbeat_s": HEARTBEAT_S}
REFILL_CLIENT = {"keepalive_time_s": KEEPALIVE_TIME_S, "keepalive_timeout_s": KEEPALIVE_TIMEOUT_S}


def service_settings(**overrides: Any) -> dict[str, Any]:
    """The contract's server settings this code knows, then `overrides` (a `grpc` mapping
    among them is merged into the contract's)."""
    grpc = {k: v for k, v in GRPC.items() if k in GrpcConfig.model_fields}
    grpc.update(overrides.pop("grpc", {}))
    out = {k: v for k, v in SERVICE.items() if k in ServiceConfig.model_fields}
    return {**out, **overrides, "grpc": grpc}


def client_options() -> dict[str, float]:
    """The contract's BatchStream options (the rank processes pass those it accepts)."""
    return dict(CLIENT)


def missing_names() -> list[str]:
    """Contract names the code under test does not have yet."""
    from trainer_client import BatchStream, RefillStream
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    missing = [f"ServiceConfig.{k}" for k in SERVICE if k not in ServiceConfig.model_fields]
    missing += [f"ServiceConfig.grpc.{k}" for k in GRPC if k not in GrpcConfig.model_fields]
    for cls, names in ((BatchStream, CLIENT), (RefillStream, REFILL_CLIENT)):
        params = inspect.signature(cls).parameters
        missing += [f"{cls.__name__}({k}=)" for k in names if k not in params]
    field = pb.ClientMessage.DESCRIPTOR.fields_by_name.get("heartbeat")
    if field is None or field.number != 3 or field.message_type.name != "Heartbeat":
        missing.append("ClientMessage.heartbeat = 3 (Heartbeat {})")
    return missing
