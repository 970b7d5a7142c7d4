"""One image for the service, the Ray nodes and the trainer, built from deploy/docker: versions
pinned there agree with the manifests and pyproject.toml, and everything it COPYs is in the
build context."""

from __future__ import annotations

import re

import pytest
from k8s_support import OVERLAYS, REPO, containers, of_kind, overlay

DOCKER = REPO / "deploy" / "docker"
DOCKERFILE = (DOCKER / "Dockerfile").read_text()


def _arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)[1]


@pytest.mark.parametrize("name", OVERLAYS)
def test_project_containers_share_one_image(name):
    objs = overlay(name)
    images = {c["image"] for pod, c in containers(objs) if "redis" not in c["image"]}
    assert len(images) == 1, images
    (ray,) = of_kind(objs, "RayCluster")
    assert ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] in images


def test_ray_version_matches_the_raycluster():
    for name in OVERLAYS:
        (ray,) = of_kind(overlay(name), "RayCluster")
        assert ray["spec"]["rayVersion"] == _arg("RAY_VERSION")


def test_torch_is_the_pinned_cpu_build():
    # The pin lives in the setup's constraints, never in the package's runtime dependencies.
    constraints = (REPO / "constraints.txt").read_text().split()
    assert f"torch=={_arg('TORCH_VERSION')}" in constraints
    assert '"torch==' not in (REPO / "pyproject.toml").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in DOCKERFILE


def test_installs_the_project_the_user_way():
    assert re.search(r"^RUN pip install \. ", DOCKERFILE, re.M)


def test_copied_paths_exist_and_pass_the_dockerignore():
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    admitted = [p.removeprefix("!").rstrip("/") for p in ignore if p.startswith("!")]
    copies = re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M)
    for sources in copies:
        for src in sources.split():
            if "[" in src:  # optional file via glob (README.m[d])
                continue
            assert (REPO / src).exists(), src
            assert any(src == a or src.startswith(a + "/") for a in admitted), src


def test_example_data_ships_where_the_config_reads_it():
    assert re.search(r"^COPY deploy/example-data /opt/odb/example-data$", DOCKERFILE, re.M)
    config = (REPO / "k8s" / "base" / "config" / "pipeline.yaml").read_text()
    for path in re.findall(r"/opt/odb/example-data/([\w.-]+)", config):
        assert (REPO / "deploy" / "example-data" / path).is_file(), path
