"""One authenticated DataService call about a job, made by an operator's command (`scale`,
`mix`): the service found as `status` finds it (`pipeline.status.sources`: --endpoint, else the
local service as `serve` configured itself; the job's token from --token/--token-env or its
`token_env`; TLS likewise), any replica answering. A refusal or an unreachable service is a
`UserError` naming the endpoint (exit 2)."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.errors import UserError
from pipeline.status import sources as status_sources

RPC_TIMEOUT_S = 30.0


def call_job(args: argparse.Namespace, method: str, request: Any) -> Any:
    """`DataService.<method>(request)` for `args.job`; its reply."""
    import grpc

    from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

    src = status_sources.resolve(argparse.Namespace(**{**vars(args), "job": [args.job]}))
    if not src.endpoint:
        raise UserError("no gRPC address for the service: give --endpoint (or --config)")
    token = src.job_tokens.get(args.job, src.token)
    md = (("authorization", f"Bearer {token}"),) if token else ()
    channel = (grpc.secure_channel(src.endpoint, src.tls) if src.tls is not None
               else grpc.insecure_channel(src.endpoint))
    with channel:
        try:
            return getattr(pb_grpc.DataServiceStub(channel), method)(
                request, metadata=md, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise UserError(f"cannot reach the service at {src.endpoint} "
                                f"({code.name}: {exc.details()})") from None
            raise UserError(f"service at {src.endpoint}: {code.name}: {exc.details()}") from None
