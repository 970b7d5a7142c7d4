"""Process-wide logging: `text` for people, `json` (one object per line) for log pipelines.

JSON lines carry `ts`, `level`, `logger`, `msg`, and `job`, `rank`, `step` whenever the record
has them, either from `extra={"job": ..., "rank": ..., "step": ...}` or from the ambient
`log_context(job=..., rank=...)` (contextvars, so each gRPC handler thread keeps its own).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import IO, Any, Literal

CONTEXT_FIELDS = ("job", "rank", "step")
# No mutable default (B039): an unset context is None.
_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "odb_log_context", default=None)
_HANDLER_TAG = "_odb_handler"  # marks the handler we own, so reconfiguring replaces it


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Attach fields (job, rank, step) to every record logged inside the block."""
    token = _context.set({**(_context.get() or {}), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Copies the ambient context onto the record unless `extra=` already set the field."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ctx = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS
                       if getattr(record, k, None) is not None)
        return f"{line} [{ctx}]" if ctx else line


def configure_logging(format: Literal["text", "json"] = "text",
                      level: str | int = "INFO", stream: IO[str] | None = None) -> None:
    """Install one handler on the root logger (replacing the one a previous call installed)."""
    if format not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {format!r}")
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, _HANDLER_TAG, False)]:
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    setattr(handler, _HANDLER_TAG, True)
    handler.setFormatter(JsonFormatter() if format == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
