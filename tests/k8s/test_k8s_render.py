"""Every kustomization under k8s/ renders with `kubectl kustomize`, into well-formed objects."""

from __future__ import annotations

from collections import Counter

import pytest
from k8s_support import K8S, KUSTOMIZATIONS, OVERLAYS, REPO, ident, of_kind, overlay, render


def test_the_expected_kustomizations_exist():
    names = {str(p.relative_to(K8S)) for p in KUSTOMIZATIONS}
    assert {"base", "trainer-example", "overlays/dev", "overlays/prod"} <= names


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(REPO)))
def test_renders_named_objects(path):
    objs = render(path)
    assert objs, "renders nothing"
    for o in objs:
        assert {"apiVersion", "kind", "metadata"} <= o.keys(), o
        assert o["metadata"].get("name"), f"{o['kind']} without a name"
    dupes = [k for k, n in Counter(ident(o) for o in objs).items() if n > 1]
    assert not dupes, f"rendered twice: {dupes}"


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_puts_everything_in_its_own_namespace(name):
    objs = overlay(name)
    (ns,) = of_kind(objs, "Namespace")
    want = ns["metadata"]["name"]
    stray = [ident(o) for o in objs
             if o["kind"] != "Namespace" and o["metadata"].get("namespace") != want]
    assert not stray, f"not in namespace {want}: {stray}"


def test_overlays_use_different_namespaces():
    names = {of_kind(overlay(n), "Namespace")[0]["metadata"]["name"] for n in OVERLAYS}
    assert len(names) == len(OVERLAYS)
