"""deploy/tls/make-certs.sh (the openssl commands docs/security.md shows) makes a CA and a
certificate that a real TLS gRPC server serves and clients verify under the Kubernetes names."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from security_helpers import REPO

from pipeline.config import ServiceConfig
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import start_service
from trainer_client import BatchStream


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(REPO / "deploy" / "tls" / "make-certs.sh"), str(out), "odb-dev"],
                   check=True, capture_output=True, timeout=60)
    assert sorted(p.name for p in out.iterdir()) == [".gitignore", "ca.crt", "ca.key",
                                                      "tls.crt", "tls.key"]
    assert (out / ".gitignore").read_text().splitlines()[-1] == "*"  # never committed (#42)
    assert all(p.stat().st_mode & 0o077 == 0 for p in out.iterdir())  # private to the user
    return out


def _health(port: int, ca: bytes, name: str) -> int:
    opts = [("grpc.ssl_target_name_override", name)]
    with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca),
                             options=opts) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def test_the_service_certificate_verifies_under_every_name_clients_dial(certs):
    cfg = ServiceConfig.model_validate({
        "grpc": {"port": 0, "tls_cert": str(certs / "tls.crt"), "tls_key": str(certs / "tls.key")},
        "metrics_port": None, "jobs": [{"job_id": "t", "world_size": 1,
                                        "source": {"paths": ["arrays"]}}]})
    svc = start_service(cfg, sample_sources={"t": ArraySource(synthetic_samples(20, seed=2))})
    ca = (certs / "ca.crt").read_bytes()
    try:
        with BatchStream(f"localhost:{svc.port}", "t", 0, 1, root_certificates=ca) as stream:
            assert sum(len(b.info.sample_ids) for b in stream) == 20
        for name in ("odb-pipeline", "odb-pipeline-headless", "odb-pipeline.odb-dev.svc",
                     "odb-pipeline-headless.odb-dev.svc.cluster.local", "127.0.0.1"):
            assert _health(svc.port, ca, name) == health_pb2.HealthCheckResponse.SERVING, name
        for wrong in ("odb-pipeline.other-namespace.svc", "evil.example.com"):
            with pytest.raises(grpc.RpcError) as err:
                _health(svc.port, ca, wrong)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        other = certs.parent / "other-ca"  # another CA's certificate is no root of trust
        subprocess.run(["bash", str(REPO / "deploy" / "tls" / "make-certs.sh"), str(other)],
                       check=True, capture_output=True, timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            _health(svc.port, (other / "ca.crt").read_bytes(), "odb-pipeline")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        svc.stop(grace=0.5)
