"""Where `odb-pipeline status` asks: the addresses given as flags, else the local service, found
the way `serve` configures itself.

Without --endpoint, --metrics-endpoint and --redis-url, the service config is loaded as `serve`
loads it (`--config FILE`, then the `ODB_*` environment, then the defaults), and
1. the newest live service recorded under its `state_dir` (`pipeline.local_services`) answers;
   with --config, only one that `serve --config` started from that same file. Its record holds
   the addresses it bound, its Redis (the embedded default's too) and its TLS certificate;
2. with no such record, the config's own addresses answer: `grpc.host:grpc.port`, the metrics
   port and `redis_url`. The embedded default (no `redis_url`) has no address to guess: then no
   local service is running, and the error says so.
Tokens: --token / --token-env for every job; else each job's `token_env`, read from this
environment. A job whose token is not set here is not asked over gRPC (the metrics port and
Redis still answer for it; `sources.grpc_skipped` says why). The metrics port's status pages
take --status-token-env's token, else the config's `status_token_env` read from this
environment (needed only when the service binds them beyond loopback).
TLS: when the service's gRPC is TLS (its record, or `grpc.tls_cert`), or with --tls / --tls-ca:
the root of trust is --tls-ca, else the server's own certificate file (self-signed, or a chain
that holds its CA), else the system's roots; --tls-cert/--tls-key add a client certificate
(mutual TLS).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

from pipeline.errors import UserError
from pipeline.status.query import Sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="the service's config file, as given to `serve` (without any "
                        "address flag: find the local service it configures)")
    parser.add_argument("--endpoint", metavar="TARGET",
                        help="the service's gRPC target (host:port, dns:///host:port, ...)")
    parser.add_argument("--metrics-endpoint", metavar="HOST:PORT",
                        help="the service's metrics port (throughput, padding, quarantine "
                        "records, buffers; /status.json)")
    parser.add_argument("--redis-url", metavar="URL", help="the coordinator's Redis")
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument("--token", help="bearer token for GetJob (prefer --token-env)")
    tok.add_argument("--token-env", metavar="VAR", help="environment variable holding the token")
    parser.add_argument("--status-token-env", metavar="VAR",
                        help="environment variable holding the status pages' token (a metrics "
                        "port beyond loopback; default: the config's status_token_env)")
    parser.add_argument("--tls", action="store_true",
                        help="gRPC over TLS (implied by --tls-ca and by a local service's TLS)")
    parser.add_argument("--tls-ca", metavar="PEM", help="root certificate(s) to verify the "
                        "service with (default: the local service's own certificate, else the "
                        "system's roots)")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", metavar="PEM", help="client private key (mutual TLS)")


def resolve(args: argparse.Namespace) -> Sources:
    """The Sources `status` asks (see the module doc)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UserError("--tls-cert and --tls-key go together")
    token = _explicit_token(args)
    if args.endpoint or args.metrics_endpoint or args.redis_url:
        tls = _credentials(args, None) if (args.tls or args.tls_ca or args.tls_cert) else None
        return Sources(endpoint=args.endpoint, metrics=args.metrics_endpoint,
                       redis_url=args.redis_url, token=token, tls=tls, jobs=args.job or [],
                       status_token=_status_token(args, None))
    return _local(args, token)


def _local(args: argparse.Namespace, token: str | None) -> Sources:
    from pipeline import local_services
    from pipeline.config import load_config

    config = load_config(args.config)
    wanted = os.path.abspath(args.config) if args.config else None
    found = [r for r in local_services.running(config.state_dir)
             if wanted is None or r.config == wanted]
    if found:
        rec = found[0]
        endpoint, metrics, redis_url = rec.grpc, rec.metrics, rec.redis_url
        server_cert, token_envs = rec.tls_cert, rec.token_envs
        local = rec.describe()
    else:
        if config.redis_url is None:
            where = Path(config.state_dir) / local_services.RECORDS_DIR
            raise UserError(
                f"no local service is running: none is recorded in {where} (start "
                "`odb-pipeline serve --config FILE` or `odb-pipeline demo`, or give --config "
                "FILE / ODB_STATE_DIR as the service has them), and the config has no redis_url; "
                "or give --endpoint, --metrics-endpoint or --redis-url")
        host = local_services.dial_host(config.grpc.host)
        endpoint = f"{host}:{config.grpc.port}" if config.grpc.port else None
        metrics = (f"{local_services.dial_host(config.metrics_host)}:{config.metrics_port}"
                   if config.metrics_port else None)
        redis_url, server_cert = config.redis_url, config.grpc.tls_cert
        token_envs = {j.job_id: j.token_env for j in config.jobs}
        local = f"the config's addresses ({args.config or 'ODB_* environment and defaults'})"
    src = Sources(endpoint=endpoint, metrics=metrics, redis_url=redis_url, token=token,
                  local=local, jobs=args.job or [],
                  status_token=_status_token(args, config.status_token_env))
    if server_cert or args.tls or args.tls_ca or args.tls_cert:
        src.tls = _credentials(args, server_cert)
    if token is None:
        for job_id, var in token_envs.items():
            if var is None:
                continue
            value = os.environ.get(var)
            if value:
                src.job_tokens[job_id] = value
            else:
                src.grpc_skipped[job_id] = (f"its token variable {var} is not set here "
                                            "(set it, or give --token-env)")
    return src


def _explicit_token(args: argparse.Namespace) -> str | None:
    if args.token_env:
        value = os.environ.get(args.token_env)
        if not value:
            raise UserError(f"--token-env: environment variable {args.token_env} is unset or "
                            "empty")
        return value
    return args.token


def _status_token(args: argparse.Namespace, config_env: str | None) -> str | None:
    """--status-token-env's value (required to be set), else `config_env`'s if set here."""
    value = os.environ.get(args.status_token_env or config_env or "")
    if args.status_token_env and not value:
        raise UserError(f"--status-token-env: environment variable {args.status_token_env} is "
                        "unset or empty")
    return value or None


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"{what} {path}: {exc.strerror or exc}") from None


def _credentials(args: argparse.Namespace, server_cert: str | None) -> grpc.ChannelCredentials:
    root_file = args.tls_ca or server_cert
    root = _read(root_file, "--tls-ca" if args.tls_ca else "the service's tls_cert") \
        if root_file else None
    key = _read(args.tls_key, "--tls-key") if args.tls_key else None
    chain = _read(args.tls_cert, "--tls-cert") if args.tls_cert else None
    return grpc.ssl_channel_credentials(root, key, chain)
