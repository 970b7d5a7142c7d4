"""Every Secret, ConfigMap (and key) and ServiceAccount a pod refers to exists in the render;
in prod, the only missing ones are the Secrets the operator creates per docs/deploy.md; in dev,
only the TLS certificate, which docs/quickstart-cluster.md makes before applying."""

from __future__ import annotations

import re

import pytest
from k8s_support import OVERLAYS, REPO, Obj, of_kind, overlay, pods

# Created by the operator before `kubectl apply -k k8s/overlays/prod` (never committed).
OPERATOR_SECRETS = {"odb-redis-auth", "odb-job-tokens", "odb-status-token", "odb-pipeline-tls"}
# Made by the quickstart before `kubectl apply -k k8s/overlays/dev` (a certificate is never
# committed, not even a dev-only one).
DEV_MADE_SECRETS = {"odb-pipeline-tls"}


def references(spec: Obj) -> set[tuple[str, str, str | None]]:
    """(kind, name, key or None) for every ConfigMap/Secret a pod spec refers to."""
    refs: set[tuple[str, str, str | None]] = set()
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        for e in c.get("env", []):
            src = e.get("valueFrom", {})
            if "secretKeyRef" in src:
                refs.add(("Secret", src["secretKeyRef"]["name"], src["secretKeyRef"]["key"]))
            if "configMapKeyRef" in src:
                refs.add(("ConfigMap", src["configMapKeyRef"]["name"],
                          src["configMapKeyRef"]["key"]))
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                refs.add(("Secret", e["secretRef"]["name"], None))
            if "configMapRef" in e:
                refs.add(("ConfigMap", e["configMapRef"]["name"], None))
    for v in spec.get("volumes", []):
        if "configMap" in v:
            for item in v["configMap"].get("items") or [{"key": None}]:
                refs.add(("ConfigMap", v["configMap"]["name"], item["key"]))
        if "secret" in v:
            for item in v["secret"].get("items") or [{"key": None}]:
                refs.add(("Secret", v["secret"]["secretName"], item["key"]))
    return refs


def _missing(objs) -> set[tuple[str, str, str | None]]:
    have = {(o["kind"], o["metadata"]["name"]): {**(o.get("data") or {}),
                                                  **(o.get("stringData") or {})}
            for o in objs if o["kind"] in ("Secret", "ConfigMap")}
    missing = set()
    for pod in pods(objs):
        for kind, name, key in references(pod.spec):
            if (kind, name) not in have or (key is not None and key not in have[(kind, name)]):
                missing.add((kind, name, key))
    return missing


def _created_by(doc: str, missing: set[tuple[str, str, str | None]]) -> None:
    """`doc` shows a `kubectl create secret generic` for each missing Secret, with every key."""
    text = (REPO / "docs" / doc).read_text()
    for _, name, key in missing:
        create = re.search(rf"kubectl .*create secret generic {name}\b[^\n]*(\\\n[^\n]*)*", text)
        assert create, f"docs/{doc} does not show how to create Secret {name}"
        assert re.search(rf"--from-literal={re.escape(key)}=|--from-file=\S*\b{re.escape(key)}\b",
                         create[0]), f"docs/{doc}: Secret {name} needs key {key}"


def test_dev_lacks_only_the_certificate_and_the_quickstart_makes_it():
    missing = _missing(overlay("dev"))
    assert {name for _, name, _ in missing} == DEV_MADE_SECRETS, missing
    assert all(kind == "Secret" for kind, _, _ in missing), missing
    _created_by("quickstart-cluster.md", missing)


def test_prod_lacks_only_the_operator_secrets_and_docs_create_them():
    missing = _missing(overlay("prod"))
    assert {name for kind, name, _ in missing if kind == "Secret"} == OPERATOR_SECRETS
    assert all(kind == "Secret" for kind, _, _ in missing), missing
    _created_by("deploy.md", missing)


@pytest.mark.parametrize("name", OVERLAYS)
def test_service_accounts_exist(name):
    objs = overlay(name)
    have = {o["metadata"]["name"] for o in of_kind(objs, "ServiceAccount")}
    for pod in pods(objs):
        sa = pod.spec.get("serviceAccountName")
        assert sa is None or sa in have, f"{pod.owner}: ServiceAccount {sa} missing"
