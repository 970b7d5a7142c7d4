"""The service's configuration as the cluster hands it over: the ConfigMap's file plus the
container's env validate with pipeline.config.load_config, ODB_* names are ones the config reads,
and the ports, Redis URL, Ray address and job tokens line up with the other objects."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from k8s_support import (
    OVERLAYS,
    REPO,
    config_file,
    container,
    containers,
    of_kind,
    one,
    overlay,
    parse_mem,
    pods,
    selects,
    service_config,
    service_pod,
)

from pipeline.config import env_var_names


@pytest.mark.parametrize("name", OVERLAYS)
def test_config_file_and_env_validate(name, tmp_path):
    cfg, _ = service_config(name, tmp_path)
    assert cfg.jobs, "no job configured"


def test_odb_env_names_are_ones_the_config_reads():
    known = set(env_var_names())
    for name in OVERLAYS:
        for pod, c in containers(overlay(name)):
            odb = {e["name"] for e in c.get("env", []) if e["name"].startswith("ODB_")}
            assert odb <= known, f"{pod.owner}/{c['name']}: unknown {sorted(odb - known)}"


@pytest.mark.parametrize("name", OVERLAYS)
def test_job_tokens_come_from_secrets(name, tmp_path):
    cfg, _ = service_config(name, tmp_path)
    env = {e["name"]: e for e in container(service_pod(overlay(name)), "odb-pipeline")["env"]}
    for job in cfg.jobs:
        assert job.token_env, f"job {job.job_id} has no token: anyone in the namespace could read"
        assert "secretKeyRef" in env[job.token_env].get("valueFrom", {}), job.token_env


@pytest.mark.parametrize("name", OVERLAYS)
def test_grpc_and_metrics_ports_line_up(name, tmp_path):
    cfg, _ = service_config(name, tmp_path)
    objs = overlay(name)
    pod = service_pod(objs)
    c = container(pod, "odb-pipeline")
    assert cfg.grpc.host in ("0.0.0.0", "::", "[::]"), "must listen on the pod IP"
    assert pod.port("grpc") == cfg.grpc.port
    assert pod.port("metrics") == cfg.metrics_port
    # gRPC speaks TLS, which the kubelet's grpc: probes cannot: /healthz on the metrics port
    # answers gRPC's health status, and /livez that the rank streams' event loop runs (a
    # frozen process still accepts TCP connections: a tcpSocket probe would keep it).
    for probe, path in (("startupProbe", "/healthz"), ("readinessProbe", "/healthz"),
                        ("livenessProbe", "/livez")):
        assert pod.port(c[probe]["httpGet"]["port"]) == cfg.metrics_port, probe
        assert c[probe]["httpGet"]["path"] == path, probe
    assert "grpc" not in c["livenessProbe"] and "grpc" not in c["readinessProbe"]
    svc = one(objs, "Service", "odb-pipeline")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["grpc"]


def _service_port(objs, host: str) -> set[int]:
    """Container ports behind Service `host` (the ones a client reaches)."""
    svc = one(objs, "Service", host)
    selected = [p for p in pods(objs)
                if selects({"matchLabels": svc["spec"]["selector"]}, p.labels)]
    assert selected, f"Service {host} selects nothing"
    return {p["port"] for p in svc["spec"]["ports"]}


@pytest.mark.parametrize("name", OVERLAYS)
def test_redis_url_points_at_the_redis_service_with_its_password(name, tmp_path):
    cfg, _ = service_config(name, tmp_path)
    objs = overlay(name)
    url = urlsplit(cfg.redis_url)
    assert url.scheme == "redis"
    assert url.port in _service_port(objs, url.hostname)
    svc_env = {e["name"]: e for e in container(service_pod(objs), "odb-pipeline")["env"]}
    redis_env = {e["name"]: e for e in one(objs, "StatefulSet", "odb-redis")["spec"]["template"]
                 ["spec"]["containers"][0]["env"]}
    raw = svc_env["ODB_REDIS_URL"]["value"]
    var = raw.split(":", 2)[2].split("@")[0].strip("$()")
    assert svc_env[var]["valueFrom"] == redis_env["REDIS_PASSWORD"]["valueFrom"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_service_pods_join_ray_as_nodes_through_the_head_gcs(name, tmp_path):
    """A replica reads payloads through its own Ray node's object manager: the pod joins the
    cluster (the entrypoint's `ray start` at RAY_JOIN_ADDRESS) and the service connects to that
    node with the GCS address; a Ray Client address (ray://) would funnel every payload byte
    through the head."""
    cfg, env = service_config(name, tmp_path)
    objs = overlay(name)
    (ray,) = of_kind(objs, "RayCluster")
    assert not cfg.ray.address.startswith("ray://")
    assert env["RAY_JOIN_ADDRESS"] == cfg.ray.address
    host, port = cfg.ray.address.rsplit(":", 1)
    assert host == f"{ray['metadata']['name']}-head-svc"  # the Service KubeRay creates
    head = next(p for p in pods(objs) if p.labels.get("ray.io/node-type") == "head")
    assert head.port("gcs-server") == int(port)
    start = env["RAY_START_ARGS"].split()
    assert "--num-cpus=0" in start and "--num-gpus=0" in start  # no tasks land on a replica
    store = int(next(a for a in start if a.startswith("--object-store-memory=")).split("=")[1])
    pod = service_pod(objs)
    shm = next(m for m in container(pod, "odb-pipeline")["volumeMounts"]
               if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod.spec["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    assert parse_mem(volume["emptyDir"]["sizeLimit"]) >= store


def test_config_path_is_the_entrypoint_default():
    objs = overlay("dev")
    path, _ = config_file(objs, service_pod(objs))
    assert path in (REPO / "deploy" / "docker" / "entrypoint.sh").read_text()
    assert path in (REPO / "deploy" / "docker" / "Dockerfile").read_text()
