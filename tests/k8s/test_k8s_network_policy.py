"""NetworkPolicies, evaluated on the rendered pods: only trainer and operator pods reach the
service's gRPC port, only Prometheus its metrics port, only Ray pods and other replicas the Ray
node in a service pod, only the service and Ray (the producer actors) reach Redis."""

from __future__ import annotations

import pytest
from k8s_support import OVERLAYS, Pod, of_kind, overlay, pods, selects


def _ns_labels(ns: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": ns}  # set by Kubernetes on every namespace


def allowed(objs, source_labels: dict[str, str], source_ns: str, target: Pod, port: int) -> bool:
    """Kubernetes ingress semantics: allowed if no policy selects the target, else if some rule
    of a selecting policy admits the source on the port (peers within a rule are OR-ed)."""
    policies = [p for p in of_kind(objs, "NetworkPolicy")
                if p["metadata"].get("namespace") == target.namespace
                and selects(p["spec"]["podSelector"], target.labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ranges = [_port_range(target, p) for p in rule.get("ports", [])]
            if ranges and not any(lo <= port <= hi for lo, hi in ranges):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                assert "ipBlock" not in peer, "ipBlock peers are not evaluated here"
                ns_ok = (selects(peer["namespaceSelector"], _ns_labels(source_ns))
                         if "namespaceSelector" in peer else source_ns == target.namespace)
                pod_ok = selects(peer["podSelector"], source_labels) if "podSelector" in peer \
                    else True
                if ns_ok and pod_ok:
                    return True
    return False


def _port_range(target: Pod, rule_port: dict) -> tuple[int, int]:
    """A NetworkPolicy port entry as [lo, hi]: a named port resolves on the target pod."""
    p = rule_port["port"]
    lo = p if isinstance(p, int) else target.port(p)
    assert lo is not None, f"{target.owner} has no port {p!r}"
    return lo, rule_port.get("endPort", lo)


def _pod(objs, owner_suffix: str) -> Pod:
    return next(p for p in pods(objs) if p.owner.endswith(owner_suffix))


OPERATOR = {"odb-pipeline.io/access": "operator", "app": "toolbox"}
STRANGER = {"app": "something-else"}


@pytest.mark.parametrize("name", OVERLAYS)
def test_only_trainers_and_operators_reach_grpc(name):
    objs = overlay(name)
    svc = _pod(objs, "/odb-pipeline")
    ns = svc.namespace
    grpc = svc.port("grpc")
    assert allowed(objs, OPERATOR, ns, svc, grpc)
    assert not allowed(objs, STRANGER, ns, svc, grpc)
    assert not allowed(objs, OPERATOR, "other-namespace", svc, grpc)
    for p in pods(objs):
        if p is svc:
            continue
        is_trainer = p.labels.get("app.kubernetes.io/component") == "trainer"
        assert allowed(objs, p.labels, p.namespace, svc, grpc) == is_trainer, p.owner
    if name == "dev":  # the example trainer is part of dev
        assert any(p.labels.get("app.kubernetes.io/component") == "trainer" for p in pods(objs))


@pytest.mark.parametrize("name", OVERLAYS)
def test_only_prometheus_reaches_metrics(name):
    objs = overlay(name)
    svc = _pod(objs, "/odb-pipeline")
    metrics = svc.port("metrics")
    assert allowed(objs, {"app.kubernetes.io/name": "prometheus"}, "monitoring", svc, metrics)
    assert not allowed(objs, OPERATOR, svc.namespace, svc, metrics)
    assert not allowed(objs, {"app.kubernetes.io/name": "prometheus"}, "default", svc, metrics)


def _is_service(p: Pod) -> bool:
    return p.owner.startswith("Deployment/") and p.owner.endswith("/odb-pipeline")


@pytest.mark.parametrize("name", OVERLAYS)
def test_only_the_service_and_ray_reach_redis(name):
    objs = overlay(name)
    redis = _pod(objs, "/odb-redis")
    port = redis.port("redis")
    for p in pods(objs):
        if p is redis:
            continue
        # Producers are Ray actors: they publish from whichever Ray node hosts them.
        expect = _is_service(p) or p.owner.startswith("RayCluster/")
        assert allowed(objs, p.labels, p.namespace, redis, port) == expect, p.owner
    assert not allowed(objs, OPERATOR, redis.namespace, redis, port)


def ray_node_ports(svc: Pod) -> dict[str, int]:
    """The ports `ray start` binds in a service pod (RAY_START_ARGS), by flag."""
    c = next(c for c in svc.spec["containers"] if c["name"] == "odb-pipeline")
    args = next(e["value"] for e in c["env"] if e["name"] == "RAY_START_ARGS").split()
    flags = dict(a.removeprefix("--").split("=", 1) for a in args if "=" in a)
    return {k: int(v) for k, v in flags.items() if k.endswith("-port")}


@pytest.mark.parametrize("name", OVERLAYS)
def test_only_ray_pods_and_replicas_reach_the_ray_node_of_a_service_pod(name):
    objs = overlay(name)
    svc = _pod(objs, "/odb-pipeline")
    ports = ray_node_ports(svc)
    assert {"node-manager-port", "object-manager-port", "min-worker-port",
            "max-worker-port"} <= ports.keys(), ports
    every = list(ports.values()) + list(range(ports["min-worker-port"],
                                              ports["max-worker-port"] + 1))
    for p in pods(objs):
        expect = _is_service(p) or p.owner.startswith("RayCluster/")
        for port in every:
            assert allowed(objs, p.labels, p.namespace, svc, port) == expect, (p.owner, port)
        if expect:  # Ray's traffic is admitted to Ray's ports, not to gRPC
            assert not allowed(objs, p.labels, p.namespace, svc, svc.port("grpc")), p.owner
    assert not allowed(objs, OPERATOR, svc.namespace, svc, ports["node-manager-port"])
