"""Per-job bearer tokens (`authorization: Bearer <t>` metadata) and optional (mutual) TLS."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

import grpc

from pipeline.config import GrpcConfig


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            v = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = v.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def require_token(expected: str | None, context, job_id: str) -> None:
    """Abort the call with UNAUTHENTICATED unless it carries the job's token."""
    problem = check_token(expected, context.invocation_metadata(), job_id)
    if problem is not None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)


def check_token(expected: str | None, metadata, job_id: str) -> str | None:
    """None when the call may proceed, else the UNAUTHENTICATED message."""
    if expected is None:
        return None
    got = bearer_token(metadata)
    if got is None:
        return (f"job {job_id!r} requires 'authorization: Bearer <token>' metadata; "
                "none was sent")
    if not hmac.compare_digest(got.encode(), expected.encode()):
        return f"bearer token rejected for job {job_id!r}"
    return None


def server_credentials(cfg: GrpcConfig) -> grpc.ServerCredentials | None:
    """TLS when a cert/key pair is configured; a client CA turns on mutual TLS."""
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    key = Path(cfg.tls_key).read_bytes()
    cert = Path(cfg.tls_cert).read_bytes()
    ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)
