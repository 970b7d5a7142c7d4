"""Hosts made of Linux network namespaces on one machine: each its own addresses, routes, network
stack and name resolution, joined by bridges, with links that can be cut, healed and slowed.

    net = Network("odbh1234", {"state": {"back": "10.231.2.10"},
                               "replica-a": {"front": "10.231.1.21", "back": "10.231.2.21"}})
    net.create()                                  # namespaces, bridges, links, hosts files
    net.set_names("replica-a", {"odb-redis": ["10.231.2.10"]})   # its /etc/hosts
    proc = net.popen("state", ["redis-server", ...], env, log_path)
    net.cut("replica-a", "back")                  # packets vanish; no socket is closed
    net.heal("replica-a", "back")
    net.shape("replica-b", "front", "1mbit")      # tc tbf on the host's side of the link
    with net.inside("switch"): ...                # this thread's sockets live in that namespace
    net.destroy()                                 # every process, namespace and hosts file

Everything lives in namespaces named `<prefix>-<host>`: the hosts, and `<prefix>-switch`, which
holds one bridge per network (`front`, `back`) and the switch side of every host's link (named
`<host>-<net>`), and has an address on each bridge (`.1`): it stands for the node a kubelet
probes from. Nothing is created in the machine's own namespace, so two runs (two CI workers,
pid-derived prefixes) never meet, and the only traces outside are `/run/netns/<ns>` and
`/etc/netns/<ns>/`, which `destroy()` removes with the namespaces (`leftovers` lists what a
prefix left behind). Each host is also a pod's process namespace (`_pod`): its processes see
one another only, as the containers of a pod do.

A cut sets the switch side of the link down: the host's interface keeps its address and
routes, its established connections hear nothing more and close nothing (TCP retransmits into
the void until the link is back); a new connection is refused by the host's own stack (no
route to the far end). `ip netns exec` bind-mounts `/etc/netns/<ns>/hosts` over `/etc/hosts`
for every process it starts, and `set_names` rewrites that file in place, so running processes
(gRPC's resolver re-reads it) see the change, as pods see a headless Service's endpoints change.
Needs root and iproute2 (`unavailable()` says why not).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")
NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")
SWITCH = "switch"
NETS = {"front": "10.231.1", "back": "10.231.2"}  # /24 each, private, inside our namespaces
_CLONE_NEWNET = 0x40000000


def unavailable() -> str | None:
    """Why these hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"odbprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    for tool, package in (("tc", "iproute2"), ("nsenter", "util-linux"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"no `{tool}` command ({package})"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(("-n", ns) if ns else ()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


def namespace_pids(ns: str) -> list[int]:
    """Every process whose network namespace is `ns`."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def leftovers(prefix: str) -> list[str]:
    """What runs of `prefix` left on this machine: namespaces, hosts files, processes."""
    found = []
    if NETNS_RUN.exists():
        for p in NETNS_RUN.iterdir():
            if p.name.startswith(prefix):
                pids = namespace_pids(p.name)
                found.append(f"namespace {p.name}" + (f" (processes {pids})" if pids else ""))
    if NETNS_ETC.exists():
        found += [f"{p}" for p in NETNS_ETC.iterdir() if p.name.startswith(prefix)]
    return found


def sweep(prefix: str) -> list[str]:
    """Remove whatever runs of `prefix` left (see `leftovers`); what was found."""
    found = leftovers(prefix)
    names = sorted({p.name for d in (NETNS_RUN, NETNS_ETC) if d.exists()
                    for p in d.iterdir() if p.name.startswith(prefix)})
    _kill_and_delete(names)
    return found


def _kill_and_delete(names: Sequence[str]) -> None:
    for _ in range(3):  # Ray's daemons may fork while we kill: repeat
        for ns in names:
            for pid in namespace_pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


class Network:
    def __init__(self, prefix: str, hosts: Mapping[str, Mapping[str, str]]) -> None:
        """`hosts`: host name -> {network name: its address on it}."""
        self.prefix = prefix
        self.hosts = {h: dict(links) for h, links in hosts.items()}
        self._procs: list[subprocess.Popen] = []
        self._inside: dict[str, ThreadPoolExecutor] = {}
        self._pods: dict[str, tuple[subprocess.Popen, int]] = {}  # host -> (unshare, its init)

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str, net: str) -> str:
        return self.hosts[host][net]

    def port_name(self, host: str, net: str) -> str:
        """The switch side of `host`'s link to `net` (an interface name: 15 characters)."""
        name = f"{host}-{net}"
        assert len(name) <= 15, name
        return name

    # --- making and unmaking ---
    def create(self) -> Network:
        try:
            sw = self.ns(SWITCH)
            for name in [SWITCH, *self.hosts]:
                _ip("netns", "add", self.ns(name))
                _ip("link", "set", "lo", "up", ns=self.ns(name))
                (NETNS_ETC / self.ns(name)).mkdir(parents=True, exist_ok=True)
                self.set_names(name, {})
            for net, base in NETS.items():
                _ip("link", "add", net, "type", "bridge", ns=sw)
                _ip("addr", "add", f"{base}.1/24", "dev", net, ns=sw)
                _ip("link", "set", net, "up", ns=sw)
            for host, links in self.hosts.items():
                for net, addr in links.items():
                    port = self.port_name(host, net)
                    _ip("link", "add", port, "type", "veth", "peer", "name", net, "netns",
                        self.ns(host), ns=sw)
                    _ip("link", "set", port, "master", net, ns=sw)
                    _ip("link", "set", port, "up", ns=sw)
                    _ip("addr", "add", f"{addr}/24", "dev", net, ns=self.ns(host))
                    _ip("link", "set", net, "up", ns=self.ns(host))
            for host in self.hosts:
                self._pods[host] = self._pod(host)
        except BaseException:
            self.destroy()
            raise
        return self

    def _pod(self, host: str) -> tuple[subprocess.Popen, int]:
        """The host's process namespace, as a pod's: an init (pid 1) of its own in a PID
        namespace, with /proc of its own and the host's /etc/hosts, that every process of the
        host enters (`command`). A process then sees only its host's processes: a Ray driver
        finds its own node's raylet among them, as in a pod (with every raylet of the machine
        in view, Ray picks the head's)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), "unshare", "--pid", "--fork",
             "--mount-proc", "--kill-child", "sleep", "infinity"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        deadline = time.monotonic() + 10
        while not (children.exists() and children.read_text().split()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the pod namespace of {host} did not start")
            time.sleep(0.02)
        return proc, int(children.read_text().split()[0])

    def kill_processes(self, host: str) -> None:
        """Every process of `host` but its pod's init (a container's restart)."""
        keep = {self._pods[host][0].pid, self._pods[host][1]} if host in self._pods else set()
        for pid in namespace_pids(self.ns(host)):
            if pid not in keep:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)

    def destroy(self) -> list[str]:
        """Kill every process in the namespaces, delete them and their hosts files; what is
        left afterwards (empty when all went)."""
        for ex in self._inside.values():
            ex.shutdown(wait=False, cancel_futures=True)
        self._inside.clear()
        names = [self.ns(h) for h in (*self.hosts, SWITCH)]
        for p in self._procs:  # (they are in the namespaces too; this also reaps them)
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
        _kill_and_delete(names)
        for p in [*self._procs, *(pod for pod, _ in self._pods.values())]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        self._pods.clear()
        return leftovers(self.prefix)

    # --- names ---
    def set_names(self, host: str, names: Mapping[str, Sequence[str]]) -> None:
        """`host`'s /etc/hosts: localhost, its own name, and `names` (name -> addresses),
        rewritten in place (processes already running see it)."""
        own = next(iter(self.hosts.get(host, {}).values()), None)
        lines = ["127.0.0.1 localhost"] + ([f"{own} {host}"] if own else [])
        lines += [f"{a} {name}" for name, addrs in names.items() for a in addrs]
        path = NETNS_ETC / self.ns(host) / "hosts"
        with open(path, "a+") as f:  # (same inode: a bind mount of it stays valid)
            f.seek(0)
            f.truncate()
            f.write("\n".join(lines) + "\n")

    # --- processes ---
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host`: in its network, process and mount namespaces (its pod)."""
        if host not in self._pods:  # (the switch: the node itself)
            return ["ip", "netns", "exec", self.ns(host), *argv]
        init = self._pods[host][1]
        return ["nsenter", f"--target={init}", "--net", "--pid", "--mount", "--", *argv]

    def popen(self, host: str, argv: Sequence[str], env: Mapping[str, str],
              log: Path | None = None, cwd: Path | None = None) -> subprocess.Popen:
        """`argv` on `host` (its output to `log`); killed by `destroy()` at the latest."""
        out: IO[Any] | int = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(self.command(host, argv), env=dict(env), stdout=out,
                                    stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        self._procs.append(proc)
        return proc

    def popen_pipes(self, host: str, argv: Sequence[str], env: Mapping[str, str]
                    ) -> subprocess.Popen:
        """`argv` on `host`, talked to through its stdin and stdout (text lines)."""
        proc = subprocess.Popen(self.command(host, argv), env=dict(env), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], env: Mapping[str, str],
            timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), env=dict(env), capture_output=True,
                              text=True, timeout=timeout)

    def in_host(self, host: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """`fn(*args)` in a thread of this process that lives in `host`'s namespace (its
        sockets are made there). One thread per host: objects holding sockets (a Redis
        client) must be used through here only."""
        ex = self._inside.get(host)
        if ex is None:
            ex = self._inside[host] = ThreadPoolExecutor(
                1, thread_name_prefix=f"in-{host}", initializer=_enter, initargs=(self.ns(host),))
        return ex.submit(fn, *args, **kw).result()

    # --- faults ---
    def cut(self, host: str, net: str) -> None:
        _ip("link", "set", self.port_name(host, net), "down", ns=self.ns(SWITCH))

    def heal(self, host: str, net: str) -> None:
        _ip("link", "set", self.port_name(host, net), "up", ns=self.ns(SWITCH))

    @contextlib.contextmanager
    def cut_off(self, host: str, *nets: str) -> Iterator[None]:
        """`host` cut from `nets` (default: every network it is on), healed at the end."""
        nets = nets or tuple(self.hosts[host])
        try:
            for net in nets:
                self.cut(host, net)
            yield
        finally:
            for net in nets:
                self.heal(host, net)

    def shape(self, host: str, net: str, rate: str) -> None:
        """What `host` sends on `net` flows at `rate` at most (tc tbf, e.g. "1mbit")."""
        self._tc(host, "add", "dev", net, "root", "tbf", "rate", rate, "burst", "16kb",
                 "latency", "400ms")

    def unshape(self, host: str, net: str) -> None:
        self._tc(host, "del", "dev", net, "root")

    def _tc(self, host: str, *args: str) -> None:
        proc = self.run(host, ["tc", "qdisc", *args], os.environ)
        if proc.returncode != 0:
            raise RuntimeError(f"tc qdisc {' '.join(args)} on {host}: {proc.stderr.strip()}")


_libc = ctypes.CDLL(None, use_errno=True)


def _enter(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (setns is per thread)."""
    fd = os.open(NETNS_RUN / ns, os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)
    threading.current_thread().name = f"in-{ns}"
