"""The operator's view (issue #7): Prometheus metrics, the status page and JSON, structured logs.

Imports stay light (no Ray, no torch): the service and `odb-pipeline status` both load this.
"""

from pipeline.observability.http_server import MetricsServer, start_metrics_server
from pipeline.observability.logging_setup import configure_logging, log_context
from pipeline.observability.status_view import ServiceView

__all__ = ["MetricsServer", "ServiceView", "configure_logging", "log_context",
           "start_metrics_server"]
