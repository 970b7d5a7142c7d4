"""Optional TLS from config: server cert/key, and a client CA turning on mutual TLS."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from service_helpers import job_dict, service_config, serving

from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchStream, StreamError

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=odb-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        ext = d / f"{name}.ext"
        ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
                 "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
                 "-extfile", str(ext), "-out", str(d / f"{name}.pem"))
    return d


def test_mutual_tls_accepts_a_client_cert_and_refuses_none(pki):
    cfg = service_config(job_dict(world_size=1), tls_cert=str(pki / "server.pem"),
                         tls_key=str(pki / "server.key"), tls_client_ca=str(pki / "ca.pem"))
    samples = synthetic_samples(20, max_len=100)
    ca = (pki / "ca.pem").read_bytes()
    with serving(cfg, {"j": samples}) as svc:
        addr = f"localhost:{svc.port}"
        with BatchStream(addr, "j", 0, 1, root_certificates=ca,
                         private_key=(pki / "client.key").read_bytes(),
                         certificate_chain=(pki / "client.pem").read_bytes()) as s:
            assert sum(b.info.rank_samples for b in s) == 20
        with BatchStream(addr, "j", 0, 1, root_certificates=ca, reconnect_timeout=1.0) as s, \
                pytest.raises(StreamError) as err:
            next(iter(s))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
