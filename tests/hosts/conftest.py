"""The multi-host suite's session check: nothing of this process's hosts outlives the session
(namespaces, their processes, /etc/netns entries), even when a test failed."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hosts import network


def host_prefix() -> str:
    """What this pytest process names its namespaces with (two workers never collide)."""
    return f"odbh{os.getpid()}"


@pytest.fixture(scope="session", autouse=True)
def _no_host_left_behind() -> Iterator[None]:
    yield
    left = network.sweep(host_prefix())
    if left:
        pytest.fail(f"the multi-host suite left behind (now removed): {left}")
