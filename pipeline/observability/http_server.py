"""The service's HTTP side port: `/metrics` (Prometheus), `/` and `/status` (HTML page),
`/status.json` (the snapshot `odb-pipeline status` reads) and `/healthz`.

    httpd, port = start_metrics_server(config.metrics_port, running_service)
    ...
    httpd.close()

A private CollectorRegistry (not prometheus-client's global one) so several services in one
process (tests, demo) never collide on metric names. Read-only: nothing here changes a job.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

from pipeline.observability import status_page
from pipeline.observability.metrics import OdbCollector
from pipeline.observability.status_view import ServiceView

if TYPE_CHECKING:
    from pipeline.service.server import RunningService


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True  # a slow scraper never blocks shutdown

    def __init__(self, addr: tuple[str, int], view: ServiceView) -> None:
        super().__init__(addr, _Handler)
        self.view = view
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

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every 15 s would drown the service log

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        q = parse_qs(url.query)
        view = self.server.view
        try:
            if url.path == "/metrics":
                self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
            elif url.path in ("/", "/status"):
                refresh = int(q.get("refresh", ["2"])[0])
                html = status_page.render(view.snapshot(), refresh_s=max(1, refresh))
                self._send(200, html.encode(), "text/html; charset=utf-8")
            elif url.path == "/status.json":
                job = q.get("job", [None])[0]
                if job is not None and job not in view.runtimes:
                    body = {"error": f"unknown job {job!r}; this server serves "
                                     f"{view.job_ids()}"}
                    self._send(404, json.dumps(body).encode(), "application/json")
                    return
                snap = view.snapshot(job=job, quarantine=q.get("quarantine", ["0"])[0] == "1")
                self._send(200, json.dumps(snap).encode(), "application/json")
            elif url.path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            else:
                self._send(404, b"not found: try /metrics, /status, /status.json\n",
                           "text/plain")
        except Exception as exc:  # a broken view must not kill the server thread
            self._send(500, f"{type(exc).__name__}: {exc}\n".encode(), "text/plain")


def start_metrics_server(port: int, running_service: RunningService, *,
                         host: str = "0.0.0.0") -> tuple[MetricsServer, int]:
    """Serve metrics + status for `running_service` on `port` (0 = a free port), in a daemon
    thread, stopped with the service. Returns (server, bound port)."""
    view = ServiceView(running_service.runtimes, running_service.replica_id)
    httpd = MetricsServer((host, port), view).start()
    running_service.on_stop.append(httpd.close)
    return httpd, httpd.port
