"""Who can reach a job: the rule `serve` applies once at start (issue #28, docs/security.md).

A job is *open* when it has no bearer token (no `token_env`) and the gRPC server listens beyond
loopback: anyone who reaches the address can stream its data, read it with GetJob and
reconfigure it with Scale. `check_exposure` refuses that unless the job
(`jobs[].allow_unauthenticated`) or the server (`allow_unauthenticated`) says so explicitly, and
names what it lets through: the open jobs, and the jobs whose token crosses the network in the
clear (a token on a non-loopback address without TLS). Loopback binds need nothing: a job on
127.0.0.1 is as easy to serve as ever.

Loopback is decided from the configured host alone, never by resolving it: `localhost`, an
IPv4 address in 127.0.0.0/8, or `::1` (brackets allowed). `0.0.0.0`, `::`, an empty host, any
other address and any other name are beyond loopback. Pure: no I/O; `enforce_exposure` logs.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.config import ConfigError, JobConfig, ServiceConfig

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """True for `localhost`, 127.0.0.0/8 and ::1 (see the module doc); False otherwise."""
    name = host.strip().removeprefix("[").removesuffix("]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a name other than localhost, or an empty host (every interface)
        return False


@dataclass(frozen=True)
class Exposure:
    """What `serve` lets through at `address`: jobs anyone there can use (opted in), and jobs
    whose bearer token travels without TLS beyond loopback."""

    address: str
    open_jobs: tuple[str, ...]
    cleartext_token_jobs: tuple[str, ...]

    def warnings(self) -> list[str]:
        out = []
        if self.open_jobs:
            out.append(f"job(s) {', '.join(self.open_jobs)} on {self.address} need no token "
                       "(allow_unauthenticated): anyone who reaches this address can stream "
                       "their data, read them and rescale them")
        if self.cleartext_token_jobs:
            out.append(f"job(s) {', '.join(self.cleartext_token_jobs)} on {self.address} take "
                       "a bearer token without TLS: it crosses the network in the clear (set "
                       "grpc.tls_cert and grpc.tls_key)")
        return out


def check_exposure(config: ServiceConfig,
                   tokens: Mapping[str, str | None] | None = None) -> Exposure:
    """Raise ConfigError when a job would be open without an explicit opt-in; else say what is
    let through. `tokens`: bearer tokens that replace jobs' `token_env` (as `start_service`
    takes them; None for a job = no token)."""
    def has_token(job: JobConfig) -> bool:
        if tokens is not None and job.job_id in tokens:
            return bool(tokens[job.job_id])
        return job.token_env is not None

    address = f"{config.grpc.host}:{config.grpc.port}"
    if is_loopback(config.grpc.host):
        return Exposure(address, (), ())
    tokenless = [j for j in config.jobs if not has_token(j)]
    refused = [j.job_id for j in tokenless
               if not (j.allow_unauthenticated or config.allow_unauthenticated)]
    if refused:
        raise ConfigError(
            f"job(s) {', '.join(refused)} have no token_env and grpc.host {config.grpc.host!r} "
            "is beyond loopback: anyone who reaches it could stream, read and rescale them. Set "
            "token_env, bind grpc.host to 127.0.0.1, or opt in with allow_unauthenticated: true "
            "(on the job, or for the whole server)")
    cleartext = () if config.grpc.tls_cert else tuple(j.job_id for j in config.jobs
                                                      if has_token(j))
    return Exposure(address, tuple(j.job_id for j in tokenless), cleartext)


def enforce_exposure(config: ServiceConfig,
                     tokens: Mapping[str, str | None] | None = None) -> Exposure:
    """`check_exposure`, with a warning logged for each thing it lets through."""
    exposure = check_exposure(config, tokens)
    for warning in exposure.warnings():
        log.warning("%s", warning)
    return exposure
