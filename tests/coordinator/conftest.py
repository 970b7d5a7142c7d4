"""Fixtures for coordinator tests: a fresh job on the session redis-server."""

from __future__ import annotations

import itertools

import pytest

from pipeline.coordinator import RedisJobState

_ids = itertools.count()


@pytest.fixture
def new_state(redis_client, redis_url):
    """new_state(world_size=4, **kw) -> RedisJobState on a flushed db (one per call = one job)."""
    made = []

    def make(world_size: int = 4, job_id: str | None = None, **kw) -> RedisJobState:
        kw.setdefault("config_hash", "cfg-1")
        st = RedisJobState(redis_url, job_id or f"job{next(_ids)}", world_size=world_size, **kw)
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()
