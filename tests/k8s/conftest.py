"""tests/k8s: the Kubernetes manifests, checked offline (kubectl kustomize + in-tree schemas)."""

from __future__ import annotations

import pytest
from k8s_support import kubectl


@pytest.fixture(scope="session", autouse=True)
def _kubectl() -> str:
    try:
        return kubectl()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
