"""Records of the odb-pipeline services running on this machine, so that `odb-pipeline status`
without an address finds the one `serve` (or `demo`) started.

Each `serve` and `demo` process writes `<state_dir>/services/<pid>.json` once it listens and
removes it when it stops: the addresses it actually bound (a port 0 in the config becomes the
real port), the Redis it uses (the embedded one's URL is known only at run time), whether its
gRPC port speaks TLS and with which certificate, and the environment variable holding each job's
token. A record whose process is gone (killed with -9, or its pid reused) is ignored and removed
by the next reader. Files are private to the user (0600): a Redis URL may carry a password.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.owned_processes import stat_fields

RECORDS_DIR = "services"
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class LocalService:
    kind: str  # "serve" | "demo"
    pid: int
    redis_url: str
    grpc: str  # host:port a client on this machine dials
    metrics: str | None = None  # host:port of the HTTP side port (None: not served)
    tls_cert: str | None = None  # the server's certificate chain file when gRPC is TLS
    config: str | None = None  # absolute path of serve's --config (None: the demo's own)
    token_envs: dict[str, str | None] = field(default_factory=dict)  # job_id -> token_env
    started_at: float = field(default_factory=time.time)
    proc_start: str | None = None  # the process's start time in /proc: tells a reused pid

    def describe(self) -> str:
        return f"{self.kind} (pid {self.pid}, started {time.ctime(self.started_at)})"


def dial_host(host: str) -> str:
    """The address a local client dials for a server bound to `host` (a wildcard: loopback)."""
    return "127.0.0.1" if host in _WILDCARD_HOSTS else host


def _proc_start(pid: int) -> str | None:
    fields = stat_fields(pid)
    return fields[19] if fields else None  # start time in clock ticks


def _alive(record: LocalService) -> bool:
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    return record.proc_start is None or _proc_start(record.pid) in (None, record.proc_start)


def register(state_dir: str | Path, service: LocalService) -> Path:
    """Write this process's record (atomically, mode 0600); returns its path for `unregister`."""
    folder = Path(state_dir) / RECORDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = LocalService(**{**asdict(service), "proc_start": _proc_start(service.pid)})
    path = folder / f"{service.pid}.json"
    tmp = folder / f".{service.pid}.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f)
    os.replace(tmp, path)
    return path


def unregister(path: Path) -> None:
    path.unlink(missing_ok=True)


def running(state_dir: str | Path) -> list[LocalService]:
    """The live services recorded under `state_dir`, newest first (stale records removed)."""
    folder = Path(state_dir) / RECORDS_DIR
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = LocalService(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours
        if _alive(record):
            out.append(record)
        else:
            path.unlink(missing_ok=True)
    return sorted(out, key=lambda r: r.started_at, reverse=True)
