"""Helpers for the tests of k8s/: render kustomizations, load the in-tree schemas, find pods.

No cluster is needed: `kubectl kustomize` renders offline, and the schemas live in k8s/schemas/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
SCHEMAS = K8S / "schemas"
OVERLAYS = ("dev", "prod")
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
MIN_KUSTOMIZE = (5, 0)
INSTALL_HINT = "install one with: bash tests/k8s/install-kubectl.sh"

Obj = dict[str, Any]


# --- rendering -------------------------------------------------------------------------------

@cache
def kubectl() -> str:
    """Path of a kubectl whose embedded kustomize is >= v5 ($KUBECTL or the one on PATH)."""
    exe = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not exe:
        raise RuntimeError(f"kubectl not found; {INSTALL_HINT}")
    out = subprocess.run([exe, "version", "--client"], capture_output=True, text=True,
                         timeout=30).stdout
    m = re.search(r"Kustomize Version: v(\d+)\.(\d+)", out)
    if not m or (int(m[1]), int(m[2])) < MIN_KUSTOMIZE:
        raise RuntimeError(f"{exe} embeds kustomize older than v{MIN_KUSTOMIZE[0]} "
                           f"({out.strip()!r}); {INSTALL_HINT}")
    return exe


@cache
def render(path: Path) -> tuple[Obj, ...]:
    """The objects `kubectl kustomize path` renders (fails with kubectl's message)."""
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path.relative_to(REPO)} failed:\n"
                             f"{proc.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def overlay(name: str) -> tuple[Obj, ...]:
    return render(K8S / "overlays" / name)


def ident(obj: Obj) -> str:
    ns = obj["metadata"].get("namespace")
    return f"{obj['kind']}/{ns + '/' if ns else ''}{obj['metadata']['name']}"


def of_kind(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


# --- schemas ---------------------------------------------------------------------------------

def schema_file(api_version: str, kind: str) -> Path:
    """kubernetes-validate's naming: <kind>-<first label of group>-<version>.json."""
    group, _, version = api_version.rpartition("/")
    name = "-".join(p for p in (kind.lower(), group.split(".")[0], version) if p) + ".json"
    for folder in (SCHEMAS / "kubernetes-v1.32", SCHEMAS / "crds"):
        if (folder / name).is_file():
            return folder / name
    raise LookupError(f"no in-tree schema for {api_version} {kind} (looked for {name})")


@cache
def _registry() -> Registry:
    defs = json.loads((SCHEMAS / "kubernetes-v1.32" / "_definitions.json").read_text())
    return Resource.from_contents(defs) @ Registry()


@cache
def validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(schema_file(api_version, kind).read_text())
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def schema_errors(obj: Obj) -> list[str]:
    v = validator(obj["apiVersion"], obj["kind"])
    return [f"{ident(obj)} at /{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in v.iter_errors(obj)]


# --- pods and containers ---------------------------------------------------------------------

@dataclass
class Pod:
    """A pod template as it will run: its owner, namespace and labels (KubeRay's included)."""

    owner: str
    namespace: str | None
    labels: dict[str, str]
    spec: Obj = field(repr=False)

    def containers(self) -> list[Obj]:
        return self.spec.get("containers", []) + self.spec.get("initContainers", [])

    def port(self, name_or_number: str | int) -> int | None:
        for c in self.spec.get("containers", []):
            for p in c.get("ports", []):
                if name_or_number in (p.get("name"), p["containerPort"]):
                    return p["containerPort"]
        return None


def pods(objs: tuple[Obj, ...]) -> list[Pod]:
    out = []
    for o in objs:
        ns, spec = o["metadata"].get("namespace"), o.get("spec", {})
        if o["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            templates = [(spec["template"], {})]
        elif o["kind"] == "RayCluster":
            cluster = o["metadata"]["name"]
            templates = [(spec["headGroupSpec"]["template"],
                          {"ray.io/cluster": cluster, "ray.io/node-type": "head",
                           "ray.io/group": "headgroup"})]
            templates += [(g["template"], {"ray.io/cluster": cluster, "ray.io/node-type": "worker",
                                           "ray.io/group": g["groupName"]})
                          for g in spec.get("workerGroupSpecs", [])]
        else:
            continue
        for tmpl, extra in templates:
            labels = {**tmpl.get("metadata", {}).get("labels", {}), **extra}
            out.append(Pod(ident(o), ns, labels, tmpl["spec"]))
    return out


def containers(objs: tuple[Obj, ...]) -> Iterator[tuple[Pod, Obj]]:
    for pod in pods(objs):
        for c in pod.containers():
            yield pod, c


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels + matchExpressions)."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def service_pod(objs: tuple[Obj, ...]) -> Pod:
    """The odb-pipeline service's pod (from its Deployment)."""
    return next(p for p in pods(objs) if p.owner.startswith("Deployment/")
                and p.owner.endswith("/odb-pipeline"))


def container(pod: Pod, name: str) -> Obj:
    return next(c for c in pod.spec["containers"] if c["name"] == name)


def env_values(c: Obj, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's environment as the kubelet builds it: literal values with $(VAR)
    expanded from earlier entries, secretKeyRef values from `secrets` ({name: {key: value}})."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets.get(ref["name"], {}).get(ref["key"], "placeholder")
    return env


def secret_data(objs: tuple[Obj, ...]) -> dict[str, dict[str, str]]:
    import base64

    out = {}
    for s in of_kind(objs, "Secret"):
        data = {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
        out[s["metadata"]["name"]] = {**data, **(s.get("stringData") or {})}
    return out


def parse_cpu(q: str | int | float) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


_MEM = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9}


def parse_mem(q: str | int) -> float:
    s = str(q)
    for suffix, mult in _MEM.items():
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * mult
    return float(s)


# --- the service's configuration as the cluster hands it over --------------------------------

def config_file(objs: tuple[Obj, ...], pod: Pod) -> tuple[str, str]:
    """(path given to --config, the file's text from the mounted ConfigMap)."""
    c = container(pod, "odb-pipeline")
    args = c["args"]
    path = PurePosixPath(args[args.index("--config") + 1])
    mount = next(m for m in c["volumeMounts"] if PurePosixPath(m["mountPath"]) == path.parent)
    volume = next(v for v in pod.spec["volumes"] if v["name"] == mount["name"])
    cm = one(objs, "ConfigMap", volume["configMap"]["name"])
    return str(path), cm["data"][path.name]


def service_config(name: str, tmp_path: Path) -> tuple[Any, dict[str, str]]:
    """(the ServiceConfig a replica of overlay `name` loads, its container's environment)."""
    from pipeline.config import load_config

    objs = overlay(name)
    pod = service_pod(objs)
    _, text = config_file(objs, pod)
    file = tmp_path / "pipeline.yaml"
    file.write_text(text)
    env = env_values(container(pod, "odb-pipeline"), secret_data(objs))
    return load_config(file, environ=env), env


def secret_file(pod: Pod, c: Obj, path: str) -> tuple[str, list[str]]:
    """(Secret name, the keys its volume projects) of the Secret volume that `path` in container
    `c` is a file of; AssertionError when no Secret volume is mounted there."""
    p = PurePosixPath(path)
    mount = next((m for m in c.get("volumeMounts", [])
                  if PurePosixPath(m["mountPath"]) == p.parent), None)
    assert mount is not None, f"{pod.owner}/{c['name']}: nothing mounted at {p.parent}"
    volume = next(v for v in pod.spec["volumes"] if v["name"] == mount["name"])
    assert "secret" in volume, f"{pod.owner}: {p.parent} is not a Secret volume"
    items = volume["secret"].get("items")
    assert items is not None, f"{pod.owner}: volume {volume['name']} projects every key"
    paths = {i["path"]: i["key"] for i in items}
    assert p.name in paths, f"{pod.owner}: {path} is not one of {sorted(paths)}"
    return volume["secret"]["secretName"], sorted(paths.values())
