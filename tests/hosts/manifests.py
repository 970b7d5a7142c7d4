"""What the Kubernetes manifests say the pods run, read from `k8s/` and `deploy/docker/` as
written (no kubectl, no cluster): the multi-host harness starts exactly that, so a drift between
the manifests and what runs fails its tests.

    pod = Pod.find(BASE / "odb-pipeline.yaml", "Deployment", "odb-pipeline")
    secrets = Secrets.generate(job_ids, tls_dir)     # the Secrets an operator creates
    files = pod.materialize(root, secrets, config_maps=config_maps())  # volumes, paths mapped
    argv, env = files.argv, files.env                # the container's command, args, env

A pod's volumes become folders of this machine (a ConfigMap's files, a Secret's items, a
volume claim's empty folder; an emptyDir is this machine's own /tmp or /dev/shm), and every
path the container is given (its args, its env, the files of its ConfigMaps) that lies under a
mount path is rewritten to that folder: pods have a filesystem each, these hosts share one.
Paths of the image (`COPY deploy/... /opt/...` in the Dockerfile, the
entrypoint) map to the repository, and the image's `PATH` to this virtualenv's. Environment
variables are resolved as the kubelet does: `value` with `$(VAR)` of the variables defined
before it, `secretKeyRef` from `secrets` (a reference to a Secret or key the harness did not
make is an error: the manifests changed), `fieldRef` only for the ones `fields` names.
"""

from __future__ import annotations

import re
import secrets as token_source
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
BASE = K8S / "base"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"

Obj = dict[str, Any]


def _docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def config_maps() -> dict[str, dict[str, str]]:
    """k8s/base's configMapGenerator: ConfigMap name -> {key: file contents}."""
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    out: dict[str, dict[str, str]] = {}
    for gen in kust.get("configMapGenerator", []):
        files = out.setdefault(gen["name"], {})
        for entry in gen.get("files", []):
            key, _, rel = entry.partition("=")
            files[key if rel else Path(key).name] = (BASE / (rel or key)).read_text()
    return out


def image_paths() -> dict[str, Path]:
    """Paths inside the image -> where they are in this checkout (the Dockerfile's COPY of
    repository folders, and this interpreter's virtualenv for the image's /opt/venv)."""
    out = {"/opt/venv": Path(sys.prefix)}
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"COPY\s+(?!--)(\S+)\s+(/\S+)\s*$", line.strip())
        if m and (REPO / m[1]).exists() and m[1].startswith("deploy/"):
            out[m[2]] = REPO / m[1]
    return out


@dataclass
class Secrets:
    """The Secrets a deployment's operator creates, by name and key."""

    values: dict[str, dict[str, str]] = field(default_factory=dict)
    files: dict[str, dict[str, Path]] = field(default_factory=dict)  # Secrets made of files

    @classmethod
    def generate(cls, job_ids: list[str], tls_dir: Path) -> Secrets:
        """As docs/deploy.md has the operator make them (hex values), one job token per job,
        and the TLS Secret from `deploy/tls/make-certs.sh`'s output in `tls_dir`."""
        def hex_() -> str:
            return token_source.token_hex(16)

        return cls(values={"odb-redis-auth": {"password": hex_()},
                           "odb-job-tokens": {j: hex_() for j in job_ids},
                           "odb-status-token": {"token": hex_()}},
                   files={"odb-pipeline-tls": {k: tls_dir / k
                                               for k in ("tls.crt", "tls.key", "ca.crt")}})

    def get(self, name: str, key: str) -> str:
        if name in self.files and key in self.files[name]:
            return self.files[name][key].read_text()
        try:
            return self.values[name][key]
        except KeyError:
            raise KeyError(f"the manifests reference Secret {name!r} key {key!r}, which the "
                           "harness does not make: the manifests changed (tests/hosts/"
                           "manifests.py)") from None


@dataclass
class Pod:
    """One container of a workload in k8s/, with its pod's volumes."""

    workload: Obj
    container: Obj

    @classmethod
    def find(cls, path: Path, kind: str, name: str, container: str | None = None) -> Pod:
        for doc in _docs(path):
            if doc.get("kind") == kind and doc["metadata"]["name"] == name:
                spec = doc["spec"]["template"]["spec"]
                for c in spec["containers"]:
                    if container is None or c["name"] == container:
                        return cls(doc, c)
        raise LookupError(f"no {kind} {name} (container {container}) in {path}")

    @property
    def spec(self) -> Obj:
        return self.workload["spec"]["template"]["spec"]

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        for p in self.container.get("ports", []):
            if p.get("name") == name_or_number:
                return int(p["containerPort"])
        raise LookupError(f"container {self.container['name']} has no port {name_or_number!r}")

    def probe(self, kind: str) -> Obj | None:
        """`startupProbe`, `readinessProbe` or `livenessProbe`, as written."""
        return self.container.get(kind)

    def env_var(self, name: str) -> Obj:
        for e in self.container.get("env", []):
            if e["name"] == name:
                return e
        raise LookupError(f"container {self.container['name']} has no env {name}")

    def materialize(self, root: Path, secrets: Secrets, *,
                    config_maps: Mapping[str, Mapping[str, str]],
                    fields: Mapping[str, str] | None = None) -> Materialized:
        """The pod's volumes as folders under `root`, its command and env with paths mapped."""
        mounts: dict[str, Path] = dict(image_paths())
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in self.workload["spec"].get(
            "volumeClaimTemplates", [])}
        for m in self.container.get("volumeMounts", []):
            vol = volumes.get(m["name"])
            if vol is None and m["name"] not in claims:
                raise LookupError(f"volumeMount {m['name']} has no volume")
            if vol is not None and "emptyDir" in vol:
                continue  # scratch (/tmp, /dev/shm): named by no configuration, shared here
            where = root / m["name"]
            where.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = where
            if vol is None:
                continue  # a PersistentVolumeClaim: an empty folder
            if "configMap" in vol:
                files = config_maps[vol["configMap"]["name"]]
                for key, text in files.items():
                    (where / key).write_text(text)
            elif "secret" in vol:
                name = vol["secret"]["secretName"]
                items = vol["secret"].get("items") or [
                    {"key": k, "path": k} for k in {**secrets.values.get(name, {}),
                                                     **secrets.files.get(name, {})}]
                for item in items:
                    target = where / item["path"]
                    target.write_text(secrets.get(name, item["key"]))
                    target.chmod(0o600)
        mapper = PathMap(mounts)
        for path in mounts.values():  # a ConfigMap's files name mounted paths too
            if path.is_dir() and path.is_relative_to(root):
                for f in path.iterdir():
                    if f.is_file() and f.suffix in (".yaml", ".conf"):
                        f.write_text(mapper.rewrite(f.read_text()))
        env = self._env(secrets, fields or {}, mapper)
        argv = [mapper.rewrite(_expand(a, env)) for a in [*self.container.get("command", []),
                                                          *self.container.get("args", [])]]
        return Materialized(argv, env, mounts, mapper)

    def _env(self, secrets: Secrets, fields: Mapping[str, str], mapper: PathMap
             ) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in self.container.get("env", []):
            if "value" in e:
                value = _expand(str(e["value"]), env)
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                value = secrets.get(ref["name"], ref["key"])
            elif e["name"] in fields:
                value = fields[e["name"]]
            else:
                raise LookupError(f"env {e['name']} of container {self.container['name']}: "
                                  f"{e.get('valueFrom')} is not something the harness provides")
            env[e["name"]] = mapper.rewrite(value)
        return env


@dataclass
class Materialized:
    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, Path]
    paths: PathMap

    def file(self, container_path: str) -> Path:
        return Path(self.paths.rewrite(container_path))


class PathMap:
    """Container paths under a mount (or an image path) -> this machine's, in any text: one
    pass, longest mount first, whole path components only."""

    def __init__(self, mounts: Mapping[str, Path]) -> None:
        self.mounts = dict(mounts)
        alts = "|".join(re.escape(m.rstrip("/")) for m in sorted(mounts, key=len, reverse=True))
        self._re = re.compile(rf"(?<![\w./-])({alts})(?=[/\s\"':,]|$)") if mounts else None

    def rewrite(self, text: str) -> str:
        if self._re is None:
            return text
        return self._re.sub(lambda m: str(self.mounts[m[1]]), text)


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` in a value, a command or args: the variable's value when it is
    defined (before it, for env), else left as written."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), text)
