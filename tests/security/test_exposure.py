"""No job is open on the network by accident (issue #28): a job without a token on a host
beyond loopback is refused unless the job or the server opts in, and then `serve` says so."""

from __future__ import annotations

import pytest
from in_netns import netns_available, netns_serve
from security_helpers import serve_config

from pipeline import cli
from pipeline.config import ConfigError, ServiceConfig
from pipeline.service.exposure import check_exposure, is_loopback

LOOPBACK = ["127.0.0.1", "127.8.9.10", "localhost", "LocalHost", "::1", "[::1]"]
BEYOND = ["0.0.0.0", "::", "[::]", "", "10.1.2.3", "192.168.0.7", "2001:db8::1",
          "odb.example.com", "localhost.example.com", "my-host"]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", BEYOND)
def test_hosts_beyond_loopback(host):
    assert not is_loopback(host)


def _config(host: str, *jobs: dict, tls: bool = False, **service) -> ServiceConfig:
    grpc = {"host": host, "port": 50051}
    if tls:
        grpc |= {"tls_cert": "cert.pem", "tls_key": "key.pem"}
    return ServiceConfig.model_validate({
        "grpc": grpc, "jobs": [{"world_size": 1, "source": {"paths": ["x.jsonl"]}, **j}
                               for j in jobs], **service})


def test_loopback_needs_no_token():
    exposure = check_exposure(_config("127.0.0.1", {"job_id": "a"}))
    assert exposure.open_jobs == () and exposure.warnings() == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_tokenless_job_beyond_loopback_is_refused(host):
    cfg = _config(host, {"job_id": "a"}, {"job_id": "b", "token_env": "TOK_B"},
                  {"job_id": "c"})
    with pytest.raises(ConfigError) as err:
        check_exposure(cfg)
    msg = str(err.value)
    assert "job(s) a, c have no token_env" in msg and repr(host) in msg
    assert "allow_unauthenticated" in msg and "\n" not in msg


def test_an_opted_in_job_is_let_through_and_named():
    cfg = _config("0.0.0.0", {"job_id": "a", "allow_unauthenticated": True},
                  {"job_id": "b", "token_env": "TOK_B"}, tls=True)
    exposure = check_exposure(cfg)
    assert exposure.open_jobs == ("a",) and exposure.cleartext_token_jobs == ()
    warning, = exposure.warnings()
    assert warning.startswith("job(s) a on 0.0.0.0:50051 need no token")
    with pytest.raises(ConfigError, match=r"job\(s\) c have no token_env"):
        check_exposure(_config("0.0.0.0", {"job_id": "a", "allow_unauthenticated": True},
                               {"job_id": "c"}))


def test_the_server_can_opt_in_for_every_job():
    cfg = _config("::", {"job_id": "a"}, {"job_id": "c"}, allow_unauthenticated=True)
    assert check_exposure(cfg).open_jobs == ("a", "c")


def test_a_token_without_tls_beyond_loopback_is_a_warning():
    cfg = _config("0.0.0.0", {"job_id": "b", "token_env": "TOK_B"})
    warning, = check_exposure(cfg).warnings()
    assert "job(s) b on 0.0.0.0:50051 take a bearer token without TLS" in warning
    assert check_exposure(_config("127.0.0.1", {"job_id": "b", "token_env": "T"})
                          ).warnings() == []


def test_tokens_given_to_start_service_count_as_the_jobs_tokens():
    cfg = _config("0.0.0.0", {"job_id": "a"}, tls=True)
    assert check_exposure(cfg, {"a": "secret"}).warnings() == []
    with pytest.raises(ConfigError):
        check_exposure(_config("0.0.0.0", {"job_id": "a", "token_env": "T"}), {"a": None})


@pytest.mark.parametrize("how", ["config", "flag"])
def test_serve_refuses_an_open_job_in_one_line(tmp_path, capsys, how):
    path = serve_config(tmp_path, grpc={"port": 0, "host": "0.0.0.0" if how == "config"
                                        else "127.0.0.1"})
    argv = ["serve", "--config", str(path)] + (["--host", "0.0.0.0"] if how == "flag" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "job(s) gen have no token_env and grpc.host '0.0.0.0' is beyond loopback" in err


@pytest.mark.skipif(not netns_available(), reason="needs unshare -rn (a private network)")
def test_serve_warns_when_an_open_job_is_allowed(tmp_path):
    # 0.0.0.0 inside a network namespace of its own: nothing beyond this test can reach it.
    path = serve_config(tmp_path, job={"allow_unauthenticated": True},
                        grpc={"port": 0, "host": "0.0.0.0"})
    report = netns_serve(path, [])
    out = report["output"]
    assert "job(s) gen on 0.0.0.0:0 need no token (allow_unauthenticated)" in out, out
    # gRPC takes 0.0.0.0 as every address (it binds the dual-stack wildcard).
    assert [ip for ip, port in report["listening"] if port == report["grpc_port"]] in (
        [["0.0.0.0"], ["::"]]), report["listening"]
