"""TLS and the metrics port in the manifests (issue #28): gRPC speaks TLS by default with the
certificate of a Secret, the trainers trust its CA only, Prometheus still scrapes /metrics while
the status pages take a token, cert-manager can issue the same Secret, and the Redis TLS overlay
wires every Redis client (replicas and Ray pods) to the CA at the path the URL names."""

from __future__ import annotations

from pathlib import PurePosixPath
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from k8s_support import (
    K8S,
    OVERLAYS,
    REPO,
    container,
    of_kind,
    one,
    overlay,
    pods,
    secret_file,
    selects,
    service_config,
    service_pod,
)

from pipeline.service.exposure import is_loopback

TLS_SECRET = "odb-pipeline-tls"
ALL = (*OVERLAYS, "prod-redis-tls")


@pytest.mark.parametrize("name", ALL)
def test_grpc_speaks_tls_with_the_certificate_of_a_secret(name, tmp_path):
    cfg, _ = service_config(name, tmp_path)
    assert cfg.grpc.tls_cert and cfg.grpc.tls_key, "gRPC must speak TLS on a cluster"
    pod = service_pod(overlay(name))
    c = container(pod, "odb-pipeline")
    for path, key in ((cfg.grpc.tls_cert, "tls.crt"), (cfg.grpc.tls_key, "tls.key")):
        secret, keys = secret_file(pod, c, path)
        assert secret == TLS_SECRET and key in keys
        assert PurePosixPath(path).name == key  # the projected file is the key of that name


def test_the_trainer_trusts_the_service_ca_and_never_sees_its_key(tmp_path, monkeypatch):
    objs = overlay("dev")
    job = next(p for p in pods(objs) if p.owner.endswith("/odb-trainer-example"))
    c = container(job, "trainer")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert secret_file(job, c, env["PIPELINE_TLS_CA"]) == (TLS_SECRET, ["ca.crt"])
    # The example trainers read that variable into BatchStream's root_certificates.
    monkeypatch.syspath_prepend(str(REPO / "deploy" / "trainer"))
    import example_setup

    ca = tmp_path / "ca.crt"
    ca.write_bytes(b"the CA")
    monkeypatch.setenv("PIPELINE_TLS_CA", str(ca))
    assert example_setup.stream_credentials()["root_certificates"] == b"the CA"
    for script in ("train_example.py", "elastic_example.py"):
        assert "open_stream(" in (REPO / "deploy" / "trainer" / script).read_text()


@pytest.mark.parametrize("name", OVERLAYS)
def test_prometheus_scrapes_metrics_and_the_status_pages_take_a_token(name, tmp_path):
    cfg, _ = service_config(name, tmp_path)
    objs = overlay(name)
    pod = service_pod(objs)
    assert not is_loopback(cfg.metrics_host), "Prometheus scrapes the pod IP"
    env = {e["name"]: e for e in container(pod, "odb-pipeline")["env"]}
    assert cfg.status_token_env in env, "beyond loopback the status pages need their token"
    assert env[cfg.status_token_env]["valueFrom"]["secretKeyRef"]["name"] == "odb-status-token"
    monitor = next(m for m in of_kind(objs, "PodMonitor")
                   if selects(m["spec"]["selector"], pod.labels))
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert pod.port(endpoint["port"]) == cfg.metrics_port and endpoint["path"] == "/metrics"


def test_cert_manager_issues_the_secret_the_service_mounts():
    docs = list(yaml.safe_load_all((K8S / "cert-manager" / "certificate.yaml").read_text()))
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    certs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    leaf = next(c for c in certs.values() if c["spec"]["secretName"] == TLS_SECRET)
    ca_issuer = issuers[leaf["spec"]["issuerRef"]["name"]]
    ca = next(c for c in certs.values()
              if c["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"])
    assert ca["spec"]["isCA"] and "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    assert "server auth" in leaf["spec"]["usages"] and not leaf["spec"].get("isCA")
    # Valid for every name a client dials in the prod namespace, and for status in a replica.
    objs = overlay("prod")
    (ns,) = {o["metadata"]["namespace"] for o in of_kind(objs, "Service")}
    names = set(leaf["spec"]["dnsNames"])
    for svc in of_kind(objs, "Service"):
        if selects({"matchLabels": svc["spec"]["selector"]}, service_pod(objs).labels):
            n = svc["metadata"]["name"]
            assert {n, f"{n}.{ns}", f"{n}.{ns}.svc", f"{n}.{ns}.svc.cluster.local"} <= names
    assert "localhost" in names and "127.0.0.1" in leaf["spec"]["ipAddresses"]


def test_redis_tls_overlay_wires_every_client_to_the_ca(tmp_path):
    cfg, _ = service_config("prod-redis-tls", tmp_path)
    objs = overlay("prod-redis-tls")
    url = urlsplit(cfg.redis_url)
    assert url.scheme == "rediss" and url.hostname == "odb-redis" and url.password
    (ca_path,) = parse_qs(url.query)["ssl_ca_certs"]
    # Every process that dials Redis has the CA there: the replicas and every Ray pod (a job's
    # producer actor runs on any of them with the replicas' URL).
    clients = [service_pod(objs)] + [p for p in pods(objs) if "ray.io/node-type" in p.labels]
    assert len(clients) >= 3
    for pod in clients:
        c = pod.spec["containers"][0]
        assert secret_file(pod, c, ca_path) == ("odb-redis-tls", ["ca.crt"]), pod.owner
    redis = next(p for p in pods(objs) if p.owner.endswith("StatefulSet/odb/odb-redis"))
    c = container(redis, "redis")
    command = " ".join(c["command"])
    assert "--tls-port 6379" in command and "--port 0" in command
    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file"):
        path = command.split(flag, 1)[1].split()[0]
        assert secret_file(redis, c, path)[0] == "odb-redis-tls", flag
    assert "--tls" in c["readinessProbe"]["exec"]["command"]
    assert one(objs, "Service", "odb-redis")["spec"]["ports"][0]["port"] == url.port
