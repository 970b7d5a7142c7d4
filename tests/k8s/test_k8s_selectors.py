"""Label selectors select what they are meant to: Services, workload selectors, StatefulSet and
Job DNS, PodDisruptionBudgets, PodMonitors and anti-affinity terms (a selector that matches
nothing is silently dead configuration in Kubernetes)."""

from __future__ import annotations

import pytest
from k8s_support import OVERLAYS, of_kind, overlay, pods, selects

SERVICE_TARGETS = {  # Service -> what its pods are
    "odb-pipeline": "Deployment/odb-pipeline",
    "odb-pipeline-headless": "Deployment/odb-pipeline",
    "odb-redis": "StatefulSet/odb-redis",
    "odb-trainer-example": "Job/odb-trainer-example",
}


def _owner(pod) -> str:
    kind, *_, name = pod.owner.split("/")
    return f"{kind}/{name}"


@pytest.mark.parametrize("name", OVERLAYS)
def test_services_select_their_pods_and_ports_exist(name):
    objs = overlay(name)
    for svc in of_kind(objs, "Service"):
        selected = [p for p in pods(objs) if selects({"matchLabels": svc["spec"]["selector"]},
                                                      p.labels)]
        owners = {_owner(p) for p in selected}
        assert owners == {SERVICE_TARGETS[svc["metadata"]["name"]]}, svc["metadata"]["name"]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in selected:
                assert pod.port(target) is not None, f"{pod.owner} has no port {target!r}"


@pytest.mark.parametrize("name", OVERLAYS)
def test_workload_selectors_match_their_templates(name):
    for kind in ("Deployment", "StatefulSet"):
        for o in of_kind(overlay(name), kind):
            labels = o["spec"]["template"]["metadata"]["labels"]
            assert selects(o["spec"]["selector"], labels), o["metadata"]["name"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_statefulset_and_job_dns_use_headless_services_over_their_pods(name):
    objs = overlay(name)
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
    uses = [(s["spec"]["serviceName"], s) for s in of_kind(objs, "StatefulSet")]
    uses += [(j["spec"]["template"]["spec"]["subdomain"], j) for j in of_kind(objs, "Job")]
    for svc_name, owner in uses:
        svc = services[svc_name]
        assert svc["spec"].get("clusterIP") == "None", f"{svc_name} must be headless"
        labels = owner["spec"]["template"]["metadata"]["labels"]
        assert selects({"matchLabels": svc["spec"]["selector"]}, labels)


def test_pod_disruption_budgets_cover_service_redis_and_ray():
    objs = overlay("prod")
    covered = set()
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        matched = {_owner(p) + ("/head" if p.labels.get("ray.io/node-type") == "head" else "")
                   for p in pods(objs) if selects(pdb["spec"]["selector"], p.labels)}
        assert matched, f"PDB {pdb['metadata']['name']} selects no pod"
        covered |= matched
    assert {"Deployment/odb-pipeline", "StatefulSet/odb-redis", "RayCluster/odb-ray/head",
            "RayCluster/odb-ray"} <= covered


@pytest.mark.parametrize("name", OVERLAYS)
def test_podmonitors_select_pods_with_the_named_metrics_port(name):
    objs = overlay(name)
    monitors = of_kind(objs, "PodMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"odb-pipeline", "odb-ray"}
    for mon in monitors:
        selected = [p for p in pods(objs) if selects(mon["spec"]["selector"], p.labels)]
        assert selected, f"PodMonitor {mon['metadata']['name']} selects no pod"
        for ep in mon["spec"]["podMetricsEndpoints"]:
            for pod in selected:
                assert pod.port(ep["port"]) is not None, f"{pod.owner} lacks port {ep['port']}"


def test_prod_anti_affinity_terms_match_real_pods():
    objs = overlay("prod")
    terms = 0
    for pod in pods(objs):
        anti = pod.spec.get("affinity", {}).get("podAntiAffinity", {})
        for pref in anti.get("preferredDuringSchedulingIgnoredDuringExecution", []):
            sel = pref["podAffinityTerm"]["labelSelector"]
            assert any(selects(sel, p.labels) for p in pods(objs)), f"{pod.owner}: {sel}"
            terms += 1
    assert terms >= 4
