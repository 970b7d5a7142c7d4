"""Shared parts of the refill tests: a refill job on the shipped chats, served for real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import ServiceConfig

ROOT = Path(__file__).resolve().parents[2]
CHATS = ROOT / "pipeline" / "sample_data" / "chats.jsonl"


def chats_slice(tmp_path: Path, n: int, name: str = "chats.jsonl") -> Path:
    """The first `n` shipped chats (one of them is a deliberately bad row)."""
    out = tmp_path / name
    out.write_bytes(b"".join(CHATS.read_bytes().splitlines(keepends=True)[:n]))
    return out


def refill_job(source: Path, job_id: str = "gen", **refill: Any) -> dict:
    return {"job_id": job_id, "mode": "refill", "source": {"paths": [str(source)]},
            "preprocess": {"max_seq_len": 4096},
            "refill": {"lease_seconds": 3.0, "queue_depth": 64, **refill}}


def refill_config(*jobs: dict, redis_url: str) -> ServiceConfig:
    return ServiceConfig.model_validate({"grpc": {"port": 0}, "metrics_port": None,
                                         "redis_url": redis_url, "lease_seconds": 5.0,
                                         "jobs": list(jobs)})
