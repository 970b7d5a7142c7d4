"""The metrics port (issue #28): on loopback by default; bound beyond it, the status pages take
the status token and `/metrics` stays open to scrapers but holds no record or client id."""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import sys
import threading
import urllib.error
import urllib.request

import psutil
import pytest
from in_netns import netns_available, netns_serve
from security_helpers import serve_config
from support.serve_process import REPO, ServeProcess
from support.waiting import wait_for

from pipeline.config import ServiceConfig
from pipeline.observability import start_metrics_server
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import start_service
from trainer_client import BatchStream

needs_netns = pytest.mark.skipif(not netns_available(),
                                 reason="needs unshare -rn (a private network)")
TOKEN_ENV, TOKEN = "ODB_TEST_STATUS_TOKEN", "s3cret-status"
BEARER, WRONG = f"Bearer {TOKEN}", "Bearer wrong"
BASIC = "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()  # a browser's login
PAGES = [("/status.json", None), ("/status.json", WRONG), ("/status.json", BEARER),
         ("/status", None), ("/status", BASIC), ("/", "Basic " + base64.b64encode(
             b"anyone:wrong").decode()), ("/metrics", None), ("/healthz", None),
         ("/livez", None)]


def _listening_ips(pid: int, port: int) -> list[str]:
    """The addresses `port` listens on, IPv4-mapped IPv6 (gRPC's sockets) as IPv4."""
    out = []
    for c in psutil.Process(pid).net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            ip = ipaddress.ip_address(c.laddr.ip)
            out.append(str(getattr(ip, "ipv4_mapped", None) or ip))
    return sorted(out)


def test_serve_binds_its_ports_to_loopback_by_default(tmp_path):
    serve = ServeProcess([sys.executable, "-m", "pipeline.cli", "serve", "--config",
                          str(serve_config(tmp_path))],
                         {**os.environ, "PYTHONPATH": str(REPO)}).start()
    try:
        assert serve.metrics_port and _listening_ips(serve.proc.pid, serve.metrics_port) == \
            ["127.0.0.1"]
        assert _listening_ips(serve.proc.pid, serve.port) == ["127.0.0.1"]
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.metrics_port}/status.json",
                                    timeout=30) as resp:  # loopback: no token asked
            assert resp.status == 200 and "jobs" in json.load(resp)
    finally:
        assert serve.stop() == 0, serve.output()[-4000:]


@needs_netns
def test_beyond_loopback_the_status_pages_take_the_status_token(tmp_path):
    path = serve_config(tmp_path, metrics_host="0.0.0.0", status_token_env=TOKEN_ENV)
    report = netns_serve(path, PAGES, status=[[], ["--status-token-env", TOKEN_ENV]],
                         env={TOKEN_ENV: TOKEN})
    assert [code for code, _ in report["http"]] == [401, 401, 200, 401, 200, 401, 200, 200,
                                                        200]
    assert "Bearer" in report["http"][0][1] and "rejected" in report["http"][1][1]
    assert "jobs" in json.loads(report["http"][2][1])
    assert [ip for ip, port in report["listening"]
                           if port == report["metrics_port"]] == ["0.0.0.0"]
    (rc_without, _, err), (rc_with, out, _) = report["status"]
    assert rc_without == 2 and "401" in err
    assert rc_with == 0 and "jobs" in json.loads(out)


@needs_netns
def test_beyond_loopback_without_a_status_token_only_metrics_answer(tmp_path):
    path = serve_config(tmp_path, metrics_host="0.0.0.0")
    report = netns_serve(path, [("/status.json", None), ("/status.json", "any"),
                                ("/status", None), ("/metrics", None)])
    assert [code for code, _ in report["http"]] == [403, 403, 403, 200]
    assert "status_token_env" in report["http"][0][1]


def test_a_status_token_env_that_is_not_set_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from pipeline import cli

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    path = serve_config(tmp_path, status_token_env=TOKEN_ENV)
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"status_token_env: environment variable {TOKEN_ENV} is unset or empty" in err
    assert err.strip().count("\n") == 0


def test_metrics_hold_no_record_or_client_id():
    """What a scraper beyond loopback may read: figures by job, rank and reason only. The same
    facts' details (the quarantined sample's id, the client's id) are on the status page."""
    samples = synthetic_samples(40, seed=3, min_len=16, max_len=128, vocab=300)
    too_long = synthetic_samples(1, lengths=[4096], vocab=300, source="huge")[0]
    cfg = ServiceConfig.model_validate({
        "grpc": {"port": 0}, "metrics_port": 0, "jobs": [{
            "job_id": "m", "world_size": 1, "source": {"paths": ["arrays"]},
            "batching": {"token_budget": 1024, "over_budget": "quarantine"}}]})
    svc = start_service(cfg, sample_sources={"m": ArraySource([*samples, too_long])})
    try:
        _, port = start_metrics_server(0, svc)

        def page(path: str) -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return r.read().decode()

        with BatchStream(svc.address, "m", 0, 1, client_id="client-7f3a", prefetch=1) as stream:
            next(iter(stream))  # the stream stays open: the server shows its client
            wait_for(lambda: all(x in page("/status.json?quarantine=1")
                                 for x in (too_long.sample_id, "client-7f3a")),
                     timeout=30, what="the record and the client on the status page")
            metrics = page("/metrics")
        assert too_long.sample_id not in metrics and "client-7f3a" not in metrics
        assert 'reason="over_budget"' in metrics
    finally:
        svc.stop(grace=0.5)


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_healthz_follows_the_grpc_health_status_and_livez_the_event_loop():
    """The probes Kubernetes uses while gRPC speaks TLS: readiness (/healthz) 503 once the
    replica drains; liveness (/livez) 503 while the event loop of the rank streams is stuck
    (the process still accepts connections then, so a TCP probe would pass it)."""
    cfg = ServiceConfig.model_validate({"grpc": {"port": 0}, "metrics_port": 0, "jobs": [{
        "job_id": "h", "world_size": 1, "source": {"paths": ["arrays"]}}]})
    svc = start_service(cfg, sample_sources={"h": ArraySource(synthetic_samples(4, seed=1))})
    try:
        _, port = start_metrics_server(0, svc)
        url, livez = f"http://127.0.0.1:{port}/healthz", f"http://127.0.0.1:{port}/livez"
        assert _http_status(url) == 200 and _http_status(livez) == 200
        unblock = threading.Event()
        svc.server.loop.call_soon_threadsafe(unblock.wait, 30)  # the loop stuck in a call
        try:
            assert _http_status(livez) == 503
        finally:
            unblock.set()
        wait_for(lambda: _http_status(livez) == 200, 10, "/livez to answer 200 again")
        svc.health.enter_graceful_shutdown()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=10)
        assert err.value.code == 503
    finally:
        svc.stop(grace=0.5)
