"""Getting a client and turning connection failures into one clear error.

The project's `connect()` (pipeline/redis_client.py) already retries transient errors with
bounded exponential backoff; here every coordinator call is wrapped so that, once those retries
are spent, the caller sees `StateUnavailable` naming the (password-redacted) URL, never a raw
redis-py ConnectionError from deep inside.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.errors import StateUnavailable
from pipeline.redis_client import connect, pool_exhausted, redact


def open_client(client_or_url: redis.Redis | str, *, retries: int = 5,
                socket_timeout: float = 5.0, max_connections: int | None = None,
                pool_timeout: float = 30.0) -> tuple[redis.Redis, str]:
    """(client, description for messages). A URL may carry user:password and be rediss://.
    `max_connections` (URLs only): a blocking pool of that size (see `redis_client.connect`)."""
    if isinstance(client_or_url, str):
        return connect(client_or_url, retries=retries, socket_timeout=socket_timeout,
                       max_connections=max_connections, pool_timeout=pool_timeout), redact(
            client_or_url)
    kw = client_or_url.connection_pool.connection_kwargs
    return client_or_url, f"{kw.get('host', '?')}:{kw.get('port', '?')}"


@contextmanager
def unavailable_as_error(where: str) -> Iterator[None]:
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        if pool_exhausted(exc):
            raise StateUnavailable(
                f"Redis client connection pool exhausted for {where}: every connection of the "
                f"pool was in use ({exc}); Redis itself may be fine. Size the pool for the "
                "number of concurrent callers (RedisJobState.connect: max_connections, default "
                "max(64, 2 * world_size + 16))") from exc
        raise StateUnavailable(
            f"Redis coordinator unreachable at {where} after bounded retries: {exc}") from exc
