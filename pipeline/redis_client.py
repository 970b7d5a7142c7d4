"""The project's Redis connection: one place for URL handling (auth, TLS), retries and errors.

redis-py reads the password/ACL user from the URL and TLS from `rediss://`. Transient
connection errors are retried with bounded backoff, then surface as one clear error.
"""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from pipeline.errors import StateUnavailable


def connect(url: str, retries: int = 5, socket_timeout: float = 5.0,
            max_connections: int | None = None, pool_timeout: float = 30.0) -> redis.Redis:
    """A client for `url` that retries transient failures `retries` times with backoff.

    `max_connections`: a `BlockingConnectionPool` of that size, where a caller finding every
    connection busy waits up to `pool_timeout` seconds for one instead of failing at once
    (redis-py's default pool raises "Too many connections" past 100). None: redis-py's default.
    """
    kw = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
    )
    if max_connections is None:
        return redis.Redis.from_url(url, **kw)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout, **kw)
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True
    return client


def pool_exhausted(exc: BaseException) -> bool:
    """Whether a redis-py ConnectionError means "no free connection in the client's pool"
    (not "Redis unreachable")."""
    return (type(exc).__name__ == "MaxConnectionsError"
            or "Too many connections" in str(exc) or "No connection available" in str(exc))


def pool_description(client: redis.Redis) -> str:
    pool = client.connection_pool
    n = getattr(pool, "max_connections", None)
    wait = getattr(pool, "timeout", None)
    return (f"{type(pool).__name__}(max_connections={n}"
            + (f", timeout={wait}s" if wait is not None else "") + ")")


def ping(client: redis.Redis, url_for_message: str = "") -> None:
    try:
        client.ping()
    except (RedisConnectionError, RedisTimeoutError) as exc:
        where = f" at {redact(url_for_message)}" if url_for_message else ""
        raise StateUnavailable(f"Redis unreachable{where}: {exc}") from exc


def redact(url: str) -> str:
    """The URL with its password hidden, for logs and error messages."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"
