"""Re-vendor the Kubernetes JSON schemas under k8s/schemas/kubernetes-v1.32/ (run by hand).

Source: the PyPI package `kubernetes-validate` (Apache-2.0), which ships the upstream OpenAPI
converted to JSON schema per Kubernetes version. We keep only the kinds our manifests use, plus
the definitions reachable from them (and from the core types our hand-kept CRD schemas refer to),
so the in-tree copy stays small:

    pip download --no-deps -d /tmp/kv kubernetes-validate==1.37.0
    python k8s/schemas/vendor_kubernetes_schemas.py /tmp/kv/kubernetes_validate-1.37.0-*.whl
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

K8S_VERSION = "v1.32.0"
FLAVOUR = "local-strict"  # additionalProperties: false everywhere: unknown fields are errors
KINDS = [
    "namespace-v1",
    "configmap-v1",
    "secret-v1",
    "service-v1",
    "serviceaccount-v1",
    "deployment-apps-v1",
    "statefulset-apps-v1",
    "job-batch-v1",
    "networkpolicy-networking-v1",
    "poddisruptionbudget-policy-v1",
]
# Core types that crds/*.json refer to (the CRDs embed these upstream types).
EXTRA_DEFS = [
    "io.k8s.api.core.v1.PodTemplateSpec",
    "io.k8s.api.core.v1.Service",
    "io.k8s.api.core.v1.ResourceRequirements",
    "io.k8s.api.core.v1.EnvVar",
    "io.k8s.api.core.v1.EnvFromSource",
    "io.k8s.api.core.v1.VolumeMount",
    "io.k8s.api.core.v1.SecurityContext",
    "io.k8s.api.core.v1.SecretKeySelector",
    "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector",
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
]
OUT = Path(__file__).resolve().parent / "kubernetes-v1.32"
REF = re.compile(r'"\$ref":\s*"[^"#]*#/\$defs/([^"]+)"')


def main(wheel: str) -> None:
    prefix = f"kubernetes_validate/kubernetes-json-schema/{K8S_VERSION}-{FLAVOUR}/"
    with zipfile.ZipFile(wheel) as zf:
        kinds = {k: zf.read(f"{prefix}{k}.json").decode() for k in KINDS}
        defs_doc = json.loads(zf.read(f"{prefix}_definitions.json"))
    defs = defs_doc["$defs"]
    todo = [name for text in kinds.values() for name in REF.findall(text)] + EXTRA_DEFS
    keep: set[str] = set()
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        todo += REF.findall(json.dumps(defs[name]))
    OUT.mkdir(exist_ok=True)
    for old in OUT.glob("*.json"):
        old.unlink()
    for kind, text in kinds.items():
        (OUT / f"{kind}.json").write_text(json.dumps(json.loads(text), indent=1) + "\n")
    pruned = {k: v for k, v in defs_doc.items() if k != "$defs"}
    pruned["$defs"] = {name: defs[name] for name in sorted(keep)}
    (OUT / "_definitions.json").write_text(json.dumps(pruned, indent=1) + "\n")
    print(f"{len(kinds)} kinds, {len(keep)} of {len(defs)} definitions -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
