"""Configs of a real `serve` for the security tests: a refill job (embedded Redis, no Ray, so a
serve is up in seconds) over a few shipped chats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHATS = REPO / "deploy" / "example-data" / "chat.jsonl"


def serve_config(tmp_path: Path, job: dict[str, Any] | None = None, **service: Any) -> Path:
    """A config file: one refill job `gen` (overridden by `job`), ports 0, state in tmp_path."""
    data = tmp_path / "chats.jsonl"
    data.write_bytes(b"".join(CHATS.read_bytes().splitlines(keepends=True)[:8]))
    cfg = {"grpc": {"port": 0}, "metrics_port": 0, "state_dir": str(tmp_path / "state"),
           "jobs": [{"job_id": "gen", "mode": "refill", "source": {"paths": [str(data)]},
                     "refill": {"generation_tokens": 16}, **(job or {})}], **service}
    path = tmp_path / "odb.json"
    path.write_text(json.dumps(cfg))
    return path
