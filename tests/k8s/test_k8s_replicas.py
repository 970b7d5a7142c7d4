"""The service as N stateless replicas: a Deployment of 2 (prod more) that rolls without ever
dropping below its size, a PodDisruptionBudget over exactly its pods that never lets a drain take
them all, and a headless Service whose DNS lists every replica for client-side failover."""

from __future__ import annotations

import pytest
from k8s_support import K8S, OVERLAYS, of_kind, one, overlay, pods, render, selects, service_pod


def _deployment(objs) -> dict:
    return one(objs, "Deployment", "odb-pipeline")


def _service_pods(objs) -> list:
    return [p for p in pods(objs) if p.owner.startswith("Deployment/")
            and p.owner.endswith("/odb-pipeline")]


@pytest.mark.parametrize("name", OVERLAYS)
def test_at_least_two_replicas_and_prod_runs_more(name):
    replicas = _deployment(overlay(name))["spec"]["replicas"]
    base = _deployment(render(K8S / "base"))["spec"]["replicas"]
    assert base == 2
    assert replicas >= 2
    if name == "prod":
        assert replicas > base


@pytest.mark.parametrize("name", OVERLAYS)
def test_rolling_update_keeps_every_replica_serving(name):
    strategy = _deployment(overlay(name))["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0  # a new pod is ready first
    assert strategy["rollingUpdate"]["maxSurge"] >= 1


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_service_budget_covers_exactly_its_pods_and_keeps_one(name):
    objs = overlay(name)
    replicas = _deployment(objs)["spec"]["replicas"]
    mine = [b for b in of_kind(objs, "PodDisruptionBudget")
            if any(selects(b["spec"]["selector"], p.labels) for p in _service_pods(objs))]
    assert len(mine) == 1, [b["metadata"]["name"] for b in mine]
    (pdb,) = mine
    assert [p.owner for p in pods(objs) if selects(pdb["spec"]["selector"], p.labels)] == \
        [p.owner for p in _service_pods(objs)]  # no other workload under this budget
    spec = pdb["spec"]
    if "maxUnavailable" in spec:
        assert 1 <= spec["maxUnavailable"] < replicas
    else:
        assert 1 <= spec["minAvailable"] < replicas  # else a drain could never proceed


@pytest.mark.parametrize("name", OVERLAYS)
def test_headless_service_lists_every_replica_on_the_grpc_port(name):
    objs = overlay(name)
    svc = one(objs, "Service", "odb-pipeline-headless")["spec"]
    assert svc["clusterIP"] == "None"
    assert not svc.get("publishNotReadyAddresses", False)  # only replicas that serve
    selected = [p for p in pods(objs) if selects({"matchLabels": svc["selector"]}, p.labels)]
    assert {p.owner for p in selected} == {p.owner for p in _service_pods(objs)}
    (port,) = svc["ports"]
    assert port["name"] == "grpc"
    assert port["port"] == service_pod(objs).port(port["targetPort"])
