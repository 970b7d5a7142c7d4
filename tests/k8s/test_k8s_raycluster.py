"""The RayCluster that runs preprocessing: autoscaling bounds make sense, the head takes no
tasks, and Ray's num-cpus per worker equals the pod's CPU request (Ray would otherwise see the
node's CPUs and oversubscribe the pod)."""

from __future__ import annotations

import math

import pytest
from k8s_support import OVERLAYS, of_kind, overlay, parse_cpu


@pytest.fixture(params=OVERLAYS)
def ray(request):
    (cluster,) = of_kind(overlay(request.param), "RayCluster")
    return cluster["spec"]


def test_autoscaling_is_on_with_sane_bounds(ray):
    assert ray["enableInTreeAutoscaling"] is True
    for group in ray["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["maxReplicas"] > group["minReplicas"], "nothing to autoscale"


def test_head_runs_no_preprocessing_tasks(ray):
    assert ray["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_worker_num_cpus_equals_the_cpu_request(ray):
    for group in ray["workerGroupSpecs"]:
        (c,) = group["template"]["spec"]["containers"]
        request = parse_cpu(c["resources"]["requests"]["cpu"])
        assert group["rayStartParams"]["num-cpus"] == str(math.floor(request)), group["groupName"]


def test_ray_metrics_are_exported_on_the_metrics_port(ray):
    groups = [ray["headGroupSpec"], *ray["workerGroupSpecs"]]
    for group in groups:
        port = int(group["rayStartParams"]["metrics-export-port"])
        (c,) = group["template"]["spec"]["containers"]
        assert {"name": "metrics", "containerPort": port} in c["ports"]
