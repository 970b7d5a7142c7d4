"""A replica's stop on Kubernetes agrees with `serve`'s: the pod's grace period covers the
preStop wait (the endpoints drop the pod first) plus serve's own --stop-grace, with room to
spare; so the kubelet's SIGKILL never cuts a drain short."""

from __future__ import annotations

import pytest
from k8s_support import OVERLAYS, container, overlay, service_pod

from pipeline.stop_signals import DEFAULT_GRACE_S


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_pod_grace_covers_the_pre_stop_wait_and_the_drain(name):
    pod = service_pod(overlay(name))
    c = container(pod, "odb-pipeline")
    args = c["args"]
    stop_grace = float(args[args.index("--stop-grace") + 1]) if "--stop-grace" in args \
        else DEFAULT_GRACE_S
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 1, "no preStop wait: the pod may get new streams while it drains"
    period = pod.spec["terminationGracePeriodSeconds"]
    assert pre_stop + stop_grace + 3 <= period, (pre_stop, stop_grace, period)
