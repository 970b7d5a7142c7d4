"""A real `odb-pipeline serve` on the embedded default, watched from outside as an operator's
tools would see it: the processes it started (from /proc, collected while it runs), the TCP
ports they listen on, and how it ends after a signal to its pid or to its whole process group.

serve runs in a session of its own here, as under a shell, systemd or a container runtime, so
the test can signal its group (`kill -- -PGID`) without signalling pytest.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from support.process_tree import cmdline, comm, descendants

from pipeline.owned_processes import stat_fields

ROOT = Path(__file__).resolve().parents[2]
CHATS = ROOT / "pipeline" / "sample_data" / "chats.jsonl"


def serve_config(tmp_path: Path, service: dict | None = None, **job: object) -> Path:
    cfg = {"grpc": {"port": 0}, "ray": {"num_cpus": 1, "object_store_mb": 128},
           "state_dir": str(tmp_path / "state"), "metrics_port": 0, **(service or {}),
           "jobs": [{"job_id": "sft", "world_size": 2, "source": {"paths": [str(CHATS)]},
                     **job}]}
    path = tmp_path / "odb.json"
    path.write_text(json.dumps(cfg))
    return path


def alive(pids: set[int]) -> dict[int, str]:
    """Those of `pids` still running (zombies are gone for this purpose), with their names."""
    out = {}
    for pid in pids:
        st = stat_fields(pid)
        if st is not None and st[0] not in "ZX":
            out[pid] = cmdline(pid)[:120] or comm(pid)
    return out


class ServeTree:
    def __init__(self, tmp_path: Path, *extra: str, service: dict | None = None,
                 **job: object) -> None:
        """`service`, `job`: settings of the service and of its job beside the defaults."""
        self.config = serve_config(tmp_path, service, **job)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "serve", "--config", str(self.config), *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.lines: list[str] = []
        self.started: set[int] = set()  # every process seen in serve's tree
        self.sessions: set[int] = set()  # the sessions those processes ran in
        self._watching = True
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def _watch(self) -> None:
        while self._watching:  # (not faster: a /proc scan costs this process's CPU)
            self.collect()
            time.sleep(0.25)

    def collect(self) -> None:
        for pid in descendants(self.proc.pid):
            st = stat_fields(pid)
            if st is not None:
                self.started.add(pid)
                self.sessions.add(int(st[3]))

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pred, what: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert self.proc.poll() is None, f"serve exited before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {what} from serve:\n{self.output()[-3000:]}"
            time.sleep(0.02)

    def wait_for_line(self, text: str, timeout: float = 240.0) -> None:
        self.wait_for(lambda: text in self.output(), repr(text), timeout)

    def signal(self, sig: int, group: bool) -> float:
        """Send `sig` to serve's pid or to its whole process group; returns the time sent."""
        self.collect()
        sent = time.monotonic()
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        return sent

    def leftovers(self) -> dict[int, str]:
        """Processes serve started, or that run in a session it started, still running."""
        self._watching = False
        in_sessions = set()
        for entry in Path("/proc").iterdir():
            st = stat_fields(int(entry.name)) if entry.name.isdigit() else None
            if st is not None and int(st[3]) in self.sessions - {os.getsid(0)}:
                in_sessions.add(int(entry.name))
        return alive(self.started | in_sessions)

    def kill(self) -> None:
        """Test cleanup: everything serve started, at once."""
        self._watching = False
        for pid in [self.proc.pid, *self.started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _hex_address(hex_ip: str) -> str:
    """/proc/net/tcp{,6}'s local address (32-bit words in host byte order) as text."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    import ipaddress

    return str(ipaddress.IPv6Address(words))


def listening(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every TCP socket in LISTEN state held by one of `pids`."""
    listeners: dict[int, tuple[str, int]] = {}  # socket inode -> address
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A":  # TCP_LISTEN
                    hex_ip, hex_port = f[1].split(":")
                    listeners[int(f[9])] = (_hex_address(hex_ip), int(hex_port, 16))
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inode = int(target[8:-1])
                        if inode in listeners:
                            out.append((pid, comm(pid), *listeners[inode]))
    return out


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
