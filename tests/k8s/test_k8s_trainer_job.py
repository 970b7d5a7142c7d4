"""The example trainer Job is wired to the service: torchrun's world size is the job's
world_size, the endpoint is the service's gRPC port, the token is the job's Secret key, and the
script it runs ships in the image."""

from __future__ import annotations

import re

import pytest
from k8s_support import REPO, container, env_values, of_kind, one, overlay, pods, service_pod

from pipeline.config import load_config


@pytest.fixture(scope="module")
def objs():
    return overlay("dev")


@pytest.fixture(scope="module")
def trainer(objs):
    job = one(objs, "Job", "odb-trainer-example")
    return job, job["spec"]["template"]["spec"]["containers"][0]


def _flags(args: list[str]) -> dict[str, str]:
    return dict(re.fullmatch(r"--([\w-]+)=(.*)", a).groups() for a in args if a.startswith("--"))


@pytest.fixture(scope="module")
def config(objs, tmp_path_factory):
    cm = next(c for c in of_kind(objs, "ConfigMap")
              if c["metadata"]["name"].startswith("odb-pipeline-config"))
    file = tmp_path_factory.mktemp("cfg") / "pipeline.yaml"
    file.write_text(cm["data"]["pipeline.yaml"])
    env = env_values(container(service_pod(objs), "odb-pipeline"), {})
    return load_config(file, environ=env)


def test_world_size_matches_the_configured_job(trainer, config):
    job, c = trainer
    flags = _flags(c["args"])
    nnodes, nproc = int(flags["nnodes"]), int(flags["nproc-per-node"])
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nnodes
    env = {e["name"]: e for e in c["env"]}
    assert config.job(env["PIPELINE_JOB"]["value"]).world_size == nnodes * nproc


def test_node_rank_and_rendezvous(trainer):
    job, c = trainer
    flags = _flags(c["args"])
    env = {e["name"]: e for e in c["env"]}
    assert flags["node-rank"] == "$(JOB_COMPLETION_INDEX)"
    assert "job-completion-index" in env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"][
        "fieldPath"]
    sub = job["spec"]["template"]["spec"]["subdomain"]
    assert flags["master-addr"] == f"{job['metadata']['name']}-0.{sub}"
    assert int(flags["master-port"]) in {p["containerPort"] for p in c["ports"]}


def test_endpoint_resolves_to_every_replica_s_grpc_port(objs, trainer):
    _, c = trainer
    env = {e["name"]: e for e in c["env"]}
    target = env["PIPELINE_ENDPOINT"]["value"]
    assert target.startswith("dns:///"), "client-side failover needs every replica's address"
    host, port = target.removeprefix("dns:///").rsplit(":", 1)
    svc = one(objs, "Service", host)
    assert svc["spec"]["clusterIP"] == "None"  # headless: DNS lists the pods, not one VIP
    assert int(port) in {p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"}


def test_token_is_the_one_the_service_expects(objs, trainer, config):
    _, c = trainer
    env = {e["name"]: e for e in c["env"]}
    job = config.job(env["PIPELINE_JOB"]["value"])
    svc_env = {e["name"]: e for e in container(service_pod(objs), "odb-pipeline")["env"]}
    assert env["PIPELINE_TOKEN"]["valueFrom"] == svc_env[job.token_env]["valueFrom"]


def test_trainer_pods_are_admitted_to_grpc(objs):
    trainers = [p for p in pods(objs) if p.owner.endswith("/odb-trainer-example")]
    assert trainers and all(p.labels.get("odb-pipeline.io/access") == "trainer"
                            for p in trainers)


def test_the_script_ships_in_the_image(trainer):
    _, c = trainer
    script = next(a for a in c["args"] if a.endswith(".py"))
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    src, dst = re.search(r"^COPY (deploy/trainer)\S* (\S+)$", dockerfile, re.M).groups()
    assert script.startswith(dst.rstrip("/") + "/")
    assert (REPO / src / script.removeprefix(dst.rstrip("/") + "/")).is_file()
