"""docs/quickstart-cluster.md checked offline: every command names kustomizations, namespaces,
objects, labels, ports, images and CLI flags that the manifests and the code actually have, and
what it says about the trainer job is what the Job runs."""

from __future__ import annotations

import re
import shlex

import pytest
from k8s_support import KUSTOMIZATIONS, REPO, containers, of_kind, one, overlay, pods, selects

DOC = REPO / "docs" / "quickstart-cluster.md"
KINDS = {"deploy": "Deployment", "deployment": "Deployment", "job": "Job", "svc": "Service",
         "service": "Service", "raycluster": "RayCluster", "statefulset": "StatefulSet"}


def commands() -> list[list[str]]:
    text = DOC.read_text()
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(shlex.split(line, comments=True))
    return out


def kubectl_cmds() -> list[list[str]]:
    return [c for c in commands() if c[0] == "kubectl"]


def _flag(cmd: list[str], *names: str) -> str | None:
    for i, a in enumerate(cmd):
        for n in names:
            if a == n and i + 1 < len(cmd):
                return cmd[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


@pytest.fixture(scope="module")
def applied():
    """(kustomization path, its rendered objects, its namespace) the page applies."""
    (path,) = {_flag(c, "-k") for c in kubectl_cmds() if _verb_args(c)[0] == "apply"}
    assert REPO / path in KUSTOMIZATIONS
    objs = overlay(path.rsplit("/", 1)[1])
    (ns,) = of_kind(objs, "Namespace")
    return path, objs, ns["metadata"]["name"]


def test_the_page_shows_the_whole_path():
    first = [c[:2] for c in commands()]
    for step in (["kind", "create"], ["helm", "install"], ["docker", "build"],
                 ["kubectl", "apply"], ["kubectl", "delete"]):
        assert step in first, step


def test_delete_removes_what_apply_created_in_the_namespace_used(applied):
    path, _, ns = applied
    assert {_flag(c, "-k") for c in kubectl_cmds() if _verb_args(c)[0] == "delete"} == {path}
    for c in kubectl_cmds():
        if _flag(c, "-n", "--namespace") is not None:
            assert _flag(c, "-n", "--namespace") == ns, c


def _verb_args(cmd: list[str]) -> list[str]:
    """A kubectl command's words after `kubectl`, without the namespace flag and its value."""
    out, skip = [], False
    for a in cmd[1:]:
        if skip:
            skip = False
        elif a in ("-n", "--namespace"):
            skip = True
        elif not a.startswith("--namespace="):
            out.append(a)
    return out


def _resources(cmd: list[str]) -> list[tuple[str, str]]:
    """(Kind, name) of the objects a kubectl command names: `kind/name` or `get kind name`."""
    words = _verb_args(cmd)
    args = [a for a in words[1:] if not a.startswith("-")]
    out = []
    for i, a in enumerate(args):
        if "/" in a and a.split("/")[0] in KINDS:
            kind, name = a.split("/", 1)
            out.append((KINDS[kind], name))
        elif words[0] == "get" and a in KINDS and i + 1 < len(args):
            out.append((KINDS[a], args[i + 1]))
    return out


def test_every_object_a_command_names_is_rendered(applied):
    _, objs, _ = applied
    named = [r for c in kubectl_cmds() for r in _resources(c)]
    assert len(named) >= 6
    for kind, name in named:
        one(objs, kind, name)  # fails naming the missing kind/name


def test_label_selectors_select_pods(applied):
    _, objs, _ = applied
    for c in kubectl_cmds():
        sel = _flag(c, "-l", "--selector")
        if sel is None:
            continue
        labels = dict(part.split("=", 1) for part in sel.split(","))
        assert any(selects({"matchLabels": labels}, p.labels) for p in pods(objs)), c


def test_port_forward_targets_a_declared_container_port(applied):
    _, objs, _ = applied
    forwards = [c for c in kubectl_cmds() if _verb_args(c)[0] == "port-forward"]
    assert forwards
    for c in forwards:
        ((kind, name),) = _resources(c)
        pod = next(p for p in pods(objs) if p.owner.split("/")[0] == kind
                   and p.owner.endswith("/" + name))
        for spec in _verb_args(c)[2:]:
            remote = int(spec.split(":")[-1])
            assert pod.port(remote) is not None, c


def test_the_image_built_and_loaded_is_the_one_the_overlay_runs(applied):
    _, objs, _ = applied
    (build,) = [c for c in commands() if c[:2] == ["docker", "build"]]
    assert (REPO / _flag(build, "-f")).is_file()
    tag = _flag(build, "-t")
    (load,) = [c for c in commands() if c[:3] == ["kind", "load", "docker-image"]]
    assert load[3] == tag
    images = {c["image"] for _, c in containers(objs) if "redis" not in c["image"]}
    assert images == {tag}


def test_one_kind_cluster_throughout():
    kind = [c for c in commands() if c[0] == "kind"]
    names = {_flag(c, "--name") for c in kind}
    assert len(names) == 1 and None not in names
    (name,) = names
    contexts = {_flag(c, "--context") for c in kubectl_cmds()} - {None}
    assert contexts <= {f"kind-{name}"}


def test_the_crds_checked_are_the_custom_kinds_rendered(applied):
    _, objs, _ = applied
    (get_crd,) = [c for c in kubectl_cmds() if _verb_args(c)[:2] == ["get", "crd"]]
    plurals = {"RayCluster": "rayclusters", "PodMonitor": "podmonitors"}
    rendered = {f"{plurals[o['kind']]}.{o['apiVersion'].split('/')[0]}" for o in objs
                if "." in o["apiVersion"].split("/")[0] and o["kind"] in plurals}
    custom = {o["kind"] for o in objs if "." in o["apiVersion"].split("/")[0]
              and not o["apiVersion"].startswith(("apps/", "batch/", "policy/",
                                                  "networking.k8s.io/"))}
    assert custom <= plurals.keys(), custom
    assert set(get_crd[3:]) == rendered


def test_odb_pipeline_commands_parse_with_the_real_cli():
    from pipeline.cli import COMMANDS, build_parser

    parser = build_parser(load_commands=True)
    ran = 0
    for c in kubectl_cmds():
        if "--" not in c:
            continue
        argv = c[c.index("--") + 1:]
        if argv[0] != "odb-pipeline":
            continue
        assert argv[1] in COMMANDS
        parser.parse_args(argv[1:])
        ran += 1
    assert ran >= 2


def test_what_the_page_says_the_trainer_runs_is_what_the_job_runs(applied):
    _, objs, _ = applied
    job = one(objs, "Job", "odb-trainer-example")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    text = DOC.read_text()
    for flag in ("--nnodes=2", "--nproc-per-node=1", "--node-rank=$(JOB_COMPLETION_INDEX)",
                 "--max-steps=200"):
        assert flag in c["args"] and flag in text, flag
    endpoint = next(e["value"] for e in c["env"] if e["name"] == "PIPELINE_ENDPOINT")
    assert f"`{endpoint}`" in text
    script = next(a for a in c["args"] if a.endswith(".py"))
    assert f"deploy/trainer/{script.rsplit('/', 1)[1]}" in text
    assert job["spec"]["completions"] == 2  # "2 pods"
