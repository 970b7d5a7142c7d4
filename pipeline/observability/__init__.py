"""The operator's view: one typed job status (`job_status.py`, built by `status_view.py`) and
its exporters (GetJob's reply, `/status.json`, the status page, Prometheus), structured logs.
The `odb-pipeline status` client that reads them is `pipeline.status`.

Imports stay light (no Ray, no torch): the service and `odb-pipeline status` both load this.
"""

from pipeline.observability.http_server import MetricsServer, start_metrics_server
from pipeline.observability.logging_setup import configure_logging, log_context
from pipeline.observability.status_view import ServiceView

__all__ = ["MetricsServer", "ServiceView", "configure_logging", "log_context",
           "start_metrics_server"]
