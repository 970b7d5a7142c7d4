"""The service's HTTP side port: `/metrics` (Prometheus), `/` and `/status` (HTML page),
`/status.json` (the snapshot `odb-pipeline status` reads), `/healthz` (200 while the gRPC
health status is SERVING, 503 while the replica cannot reach its state and once it drains: the
readiness probe Kubernetes can use when gRPC speaks TLS) and `/livez` (200 while the event loop
of the rank streams runs: the liveness probe; a process that is frozen or whose loop is stuck
still accepts TCP connections, so a tcpSocket probe would pass it).

    httpd, port = start_metrics_server(config.metrics_port, running_service,
                                       host=config.metrics_host, status_token=token)
    ...
    httpd.close()

Who may read what (docs/security.md): bound to loopback (the default, 127.0.0.1) every page
answers whoever is on this machine, as before. Bound beyond loopback (0.0.0.0 for Prometheus on
Kubernetes) `/metrics`, `/healthz` and `/livez` stay open (aggregate figures, no record, no
client id) and the status pages, which show quarantined records, client ids and world history,
require the status token, as `Authorization: Bearer <token>` or as an HTTP Basic password (401
without it or with another; 403 when the server has no status token, so they are off). The rule
follows the bind, never the peer's address: a proxy in front (a service-mesh sidecar) makes
every peer look local.

A private CollectorRegistry (not prometheus-client's global one) so several services in one
process (tests, demo) never collide on metric names. Read-only: nothing here changes a job.
"""

from __future__ import annotations

import base64
import hmac
import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

from pipeline.observability import status_page
from pipeline.observability.metrics import OdbCollector
from pipeline.observability.status_view import ServiceView
from pipeline.service.exposure import is_loopback

if TYPE_CHECKING:
    from pipeline.service.server import RunningService


_STATUS_PAGES = ("/", "/status", "/status.json")
LIVENESS_WAIT_S = 2.0  # how long /livez waits for the event loop (the probe's timeout is 5 s)


class _StatusGuard:
    """The token the status pages take beyond loopback (None: no token, pages off): as
    `Authorization: Bearer <token>` (`odb-pipeline status`, curl) or as the password of HTTP
    Basic authentication, any user name (a browser's login prompt)."""

    CHALLENGES = ('Basic realm="odb-pipeline status"', 'Bearer realm="odb-pipeline status"')

    def __init__(self, token: str | None) -> None:
        self._token = token

    def refusal(self, authorization: str | None) -> tuple[int, str] | None:
        """None when the request may read the status pages, else (HTTP code, message)."""
        if self._token is None:
            return 403, ("the status pages are off on this address: it is beyond loopback and "
                         "the server has no status_token_env\n")
        got = _presented_token(authorization)
        if got is None:
            return 401, "send 'Authorization: Bearer <status token>' (or it as a password)\n"
        if not hmac.compare_digest(got.encode(), self._token.encode()):
            return 401, "status token rejected\n"
        return None


def _presented_token(authorization: str | None) -> str | None:
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return None
    return None


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True  # a slow scraper never blocks shutdown

    def __init__(self, addr: tuple[str, int], view: ServiceView, *,
                 status_token: str | None = None,
                 serving: Callable[[], bool] | None = None,
                 alive: Callable[[], bool] | None = None) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, _Handler)
        self.view = view
        self._serving = serving
        self.alive: Callable[[], bool] = alive or (lambda: True)
        # None: the status pages answer anyone who reaches the port (a loopback bind).
        self.status_guard: _StatusGuard | None = (
            None if is_loopback(addr[0]) else _StatusGuard(status_token))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(OdbCollector(view))
        ProcessCollector(registry=self.registry)  # process_* (cpu, rss, fds, start time)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self.serve_forever, name="odb-metrics",
                                        daemon=True)
        self._thread.start()
        return self

    def serving(self) -> bool:
        """The gRPC server's health ("" = the whole server): what /healthz answers, so that
        probes that cannot speak gRPC over TLS see NOT_SERVING too (a drain, or a replica
        that cannot reach its state: `service/readiness.py`)."""
        return self._serving is None or self._serving()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every 15 s would drown the service log

    def _send(self, code: int, body: bytes, ctype: str,
              headers: list[tuple[str, str]] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in headers or ():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        q = parse_qs(url.query)
        view = self.server.view
        guard = self.server.status_guard
        try:
            if url.path in _STATUS_PAGES and guard is not None:
                refusal = guard.refusal(self.headers.get("Authorization"))
                if refusal is not None:
                    code, text = refusal
                    challenges = _StatusGuard.CHALLENGES if code == 401 else ()
                    self._send(code, text.encode(), "text/plain; charset=utf-8",
                               [("WWW-Authenticate", c) for c in challenges])
                    return
            if url.path == "/metrics":
                self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
            elif url.path in ("/", "/status"):
                refresh = int(q.get("refresh", ["2"])[0])
                html = status_page.render(view.status(), refresh_s=max(1, refresh))
                self._send(200, html.encode(), "text/html; charset=utf-8")
            elif url.path == "/status.json":
                job = q.get("job", [None])[0]
                if job is not None and job not in view.job_ids():
                    body = {"error": f"unknown job {job!r}; this server serves "
                                     f"{view.job_ids()}"}
                    self._send(404, json.dumps(body).encode(), "application/json")
                    return
                snap = view.snapshot(job=job, quarantine=q.get("quarantine", ["0"])[0] == "1")
                self._send(200, json.dumps(snap).encode(), "application/json")
            elif url.path == "/healthz":
                if self.server.serving():
                    self._send(200, b"ok\n", "text/plain")
                else:
                    self._send(503, b"not serving\n", "text/plain")
            elif url.path == "/livez":
                if self.server.alive():
                    self._send(200, b"alive\n", "text/plain")
                else:
                    self._send(503, f"the event loop of the rank streams did not run within "
                                    f"{LIVENESS_WAIT_S:g} s\n".encode(), "text/plain")
            else:
                self._send(404, b"not found: try /metrics, /status, /status.json\n",
                           "text/plain")
        except Exception as exc:  # a broken view must not kill the server thread
            self._send(500, f"{type(exc).__name__}: {exc}\n".encode(), "text/plain")


def start_metrics_server(port: int, running_service: RunningService, *,
                         host: str = "127.0.0.1",
                         status_token: str | None = None) -> tuple[MetricsServer, int]:
    """Serve metrics + status for `running_service` on `host`:`port` (0 = a free port), in a
    daemon thread, stopped with the service. `status_token`: what the status pages require
    when `host` is beyond loopback (None there: they are off). Returns (server, bound port)."""
    view = ServiceView.of(running_service)
    httpd = MetricsServer((host, port), view, status_token=status_token,
                          serving=running_service.health.serving,
                          alive=lambda: running_service.server.responsive(LIVENESS_WAIT_S)
                          ).start()
    running_service.on_stop.append(httpd.close)
    return httpd, httpd.port
