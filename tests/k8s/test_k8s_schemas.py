"""Every rendered object validates against the in-tree schemas (k8s/schemas/README.md): the
Kubernetes v1.32 JSON schemas (strict: unknown fields are errors) and the KubeRay RayCluster and
prometheus-operator PodMonitor CRD schemas. The validator itself is checked on broken objects."""

from __future__ import annotations

import copy

import pytest
from k8s_support import (
    KUSTOMIZATIONS,
    REPO,
    SCHEMAS,
    one,
    overlay,
    render,
    schema_errors,
    schema_file,
)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_object_validates(path):
    errors = [e for o in render(path) for e in schema_errors(o)]
    assert not errors, "\n".join(errors)


def test_every_kind_we_render_has_a_schema():
    kinds = {(o["apiVersion"], o["kind"]) for p in KUSTOMIZATIONS for o in render(p)}
    for api_version, kind in sorted(kinds):
        assert schema_file(api_version, kind).is_file()


def _broken(kind: str, name: str, breaker) -> list[str]:
    obj = copy.deepcopy(one(overlay("dev"), kind, name))
    breaker(obj)
    return schema_errors(obj)


def test_validator_catches_a_misspelled_container_field():
    def misspell(d):
        d["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"

    assert _broken("Deployment", "odb-pipeline", misspell)


def test_validator_catches_a_bad_probe():
    def grpc_named_port(d):  # a grpc: probe takes a port number only
        d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = {
            "grpc": {"port": "grpc"}}

    def http_port_list(d):
        d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [1]

    assert _broken("Deployment", "odb-pipeline", grpc_named_port)
    assert _broken("Deployment", "odb-pipeline", http_port_list)


def test_validator_catches_raycluster_errors_down_to_the_pod_template():
    def int_param(d):
        d["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2  # must be a string

    def nameless_container(d):
        del d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["name"]

    def unknown_field(d):
        d["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3

    for breaker in (int_param, nameless_container, unknown_field):
        assert _broken("RayCluster", "odb-ray", breaker), breaker.__name__


def test_validator_catches_podmonitor_errors():
    def no_selector(d):
        del d["spec"]["selector"]

    def bad_interval(d):
        d["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"

    for breaker in (no_selector, bad_interval):
        assert _broken("PodMonitor", "odb-pipeline", breaker), breaker.__name__


def test_schemas_in_tree_stay_small():
    total = sum(p.stat().st_size for p in SCHEMAS.rglob("*") if p.is_file())
    assert total < 5 * 2**20, f"k8s/schemas is {total / 2**20:.1f} MiB"
