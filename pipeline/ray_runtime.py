"""The one way this project starts or joins Ray (serve, demo, the one-shot CLI commands).

`PrivateRay` is a local Ray for one process's lifetime: a single-node Ray in a child process of
its own session (`pipeline.ray_node`) that this process joins as a driver. Its node listens on
127.0.0.1 only (a single-node Ray takes loopback as its node address), with no dashboard; no
token-auth files in ~/.ray, workers at normal priority (Ray's default nice 15 starves them next
to any busy process), sessions in a temp dir removed on exit. Being a child in its own session,
it starts without taking this process's threads, a signal to this process's group does not reach
it, and it is stopped when and how this process says (`close`), in seconds.
`join_cluster` connects to an existing cluster as a *driver on a Ray node* (`ray.init(address=
...)`), never through the Ray Client proxy (`ray://`), which would funnel every payload byte
through the head node; such a cluster keeps its own settings.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline import owned_processes
from pipeline.errors import UserError
from pipeline.redis_server import free_port

log = logging.getLogger("pipeline.ray")
_PRIVATE_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0",
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
# Ray settings for this process as a driver, read by Ray when it is imported (`_driver`):
# - Ray's C++ failure-signal handler would take SIGTERM from our own handler (`pipeline.
#   stop_signals`) and abort the process: a drain would end in SIGABRT.
_OWN_SIGNALS = {"RAY_DISABLE_FAILURE_SIGNAL_HANDLER": ("1", "RAY_DISABLE_FAILURE_SIGNAL_HANDLER",
                                                       True)}
# - A single-node Ray (the setting's name says Windows/macOS, but it means "no multi-node
#   cluster") takes 127.0.0.1 as its node address, so every Ray server binds to loopback; the
#   driver needs it too, else it turns the node's 127.0.0.1 into the machine's address.
_SINGLE_NODE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": ("0", "ENABLE_RAY_CLUSTER", False)}
# Only for the node process: a SIGTERM stops it at once instead of first draining it for 30 s.
_NODE_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Idle workers Ray keeps warm beyond its default of one per CPU. A job's preprocessing keeps
# more than one worker per CPU busy in turns: besides a processing task per CPU, its producer
# actor, the read and repartition stages and the planner's tiny measuring tasks (no CPU). With
# Ray's default the extra ones are killed whenever idle for a second and started again for the
# next task, each start importing the pipeline (a second or two of a core): on 2 cores a
# 29,400-row source was served at 37 samples/s, and at 194 with 4 more kept (docs/benchmarks.md).
EXTRA_WARM_WORKERS = 4
_SOFT_LIMIT = "RAY_num_workers_soft_limit"  # (Ray's spelling: RAY_ + its setting's name)
NODE_STOP_S = 5.0  # the node's own stop on SIGTERM takes ~1-2 s; then its session is killed
DRIVER_SHUTDOWN_S = 3.0


def warm_workers_env(num_cpus: int | None) -> dict[str, str]:
    """The environment of a Ray node (or of the `ray.init` that starts one) that keeps
    `EXTRA_WARM_WORKERS` more idle workers than CPUs; a setting given already is kept."""
    cpus = num_cpus or os.cpu_count() or 1
    return {_SOFT_LIMIT: os.environ.get(_SOFT_LIMIT, str(cpus + EXTRA_WARM_WORKERS))}


class _RayNotices(logging.Filter):
    """Ray's notices about what this project does on purpose, dropped at the default verbosity
    (a DEBUG log keeps them): `ray.init` from a thread that is not the main one (serve joins
    its private Ray from one, and keeps its own SIGTERM handler anyway: `_sigterm_kept`)."""

    NOISE = ("SIGTERM handler is not set",)

    def filter(self, record: logging.LogRecord) -> bool:
        return (logging.getLogger().isEnabledFor(logging.DEBUG)
                or not record.getMessage().startswith(self.NOISE))


logging.getLogger("ray._private.worker").addFilter(_RayNotices())


def join_cluster(address: str) -> None:
    import ray

    if address.startswith("ray://"):
        raise UserError(f"ray.address {address!r}: a Ray Client address proxies every payload "
                        "byte through the head node; run the service on a Ray node and give "
                        "the GCS address (host:6379) or 'auto'")
    if not ray.is_initialized():
        _driver(_OWN_SIGNALS)
        with _sigterm_kept():
            ray.init(address=address, log_to_driver=False, configure_logging=False)


def _driver(settings: dict[str, tuple[str, str, object]]) -> None:
    """Apply `settings` (env var -> (value, ray_constants name, value)) to this process: in the
    environment for a Ray imported later, in Ray's constants for one imported already."""
    constants = sys.modules.get("ray._private.ray_constants")
    for env, (value, constant, parsed) in settings.items():
        os.environ[env] = value
        if constants is not None:
            setattr(constants, constant, parsed)


@contextmanager
def _sigterm_kept() -> Iterator[None]:
    """`ray.init` in the main thread replaces the SIGTERM handler with one that exits at once:
    keep the process's own (serve's orderly stop, the demo's cleanup)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class PrivateRay:
    """A local Ray for this process (an already initialized Ray is reused and left running).

    As a context manager: `start()` then `connect()`. Separately: `start()` launches the node
    (call it from the main thread: the node dies with the thread that started it), `connect()`
    waits for it and joins it as a driver (any thread), `close()` stops both."""

    def __init__(self, *, num_cpus: int | None = None, object_store_mb: int = 256,
                 prefix: str = "odb-ray-") -> None:
        self.num_cpus = num_cpus
        self.object_store_mb = object_store_mb
        self.prefix = prefix
        self.owned = False
        self.tmp: str | None = None
        self.node: subprocess.Popen | None = None
        self.connected = False

    def __enter__(self) -> PrivateRay:
        self.start()
        try:
            self.connect()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        ray = sys.modules.get("ray")  # not imported here: that takes seconds of this thread
        self.owned = ray is None or not ray.is_initialized()
        if not self.owned:
            return
        for k, v in _PRIVATE_ENV.items():
            os.environ.setdefault(k, v)
        _driver({**_OWN_SIGNALS, **_SINGLE_NODE})
        self.tmp = tempfile.mkdtemp(prefix=self.prefix, dir="/tmp")
        args = ["--head", "--block", "--port", "0", "--node-ip-address", "127.0.0.1",
                "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", self.tmp,
                "--object-store-memory", str(self.object_store_mb * 1024 * 1024),
                # Ray Client's proxy (unused here) would take the fixed port 10001, which two
                # private Rays on one machine would then share: a free one instead.
                "--ray-client-server-port", str(free_port())]
        if self.num_cpus is not None:
            args += ["--num-cpus", str(self.num_cpus)]
        with open(Path(self.tmp) / "node.log", "wb") as out:
            self.node = subprocess.Popen(
                [sys.executable, "-m", "pipeline.ray_node", str(os.getpid()), *args],
                env={**os.environ, **_PRIVATE_ENV, **_NODE_ENV,
                     **warm_workers_env(self.num_cpus)}, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def connect(self, timeout: float = 180.0) -> None:
        """Wait for the node to be up and join it (no-op for a reused Ray)."""
        if not self.owned:
            return
        import ray

        assert self.node is not None and self.tmp is not None, "start() first"
        address_file = Path(self.tmp) / "ray_current_cluster"
        deadline = time.monotonic() + timeout
        while not (address_file.exists() and address_file.read_text().strip()):
            if self.node.poll() is not None or time.monotonic() > deadline:
                tail = (Path(self.tmp) / "node.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"the private Ray node did not start "
                                   f"(exit {self.node.poll()}): {tail}")
            time.sleep(0.1)
        with _sigterm_kept():
            ray.init(address=address_file.read_text().strip(), log_to_driver=False,
                     configure_logging=False)
        self.connected = True
        # Ray Data's per-dataset INFO/WARNING chatter is noise in a command's output.
        import ray.data  # configures its loggers on import: set the level after

        logging.getLogger("ray.data").setLevel(logging.ERROR)

    def close(self) -> None:
        if not self.owned:
            return
        self.owned = False
        if self.connected:
            self.connected = False
            # Leave the cluster first (actors' owner gone cleanly), bounded: a driver whose
            # node is unwell can wait a minute in ray.shutdown().
            import ray

            leave = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
            leave.start()
            leave.join(DRIVER_SHUTDOWN_S)
        if self.node is not None:
            owned_processes.stop_session(self.node, NODE_STOP_S)
            self.node = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def kill(self) -> None:
        """Fast stop (a second signal): the node's whole session at once, no driver shutdown;
        its temp dir goes too (the node, killed, cannot remove it)."""
        if self.node is not None:
            owned_processes.kill_session(self.node)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
