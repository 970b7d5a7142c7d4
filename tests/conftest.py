"""Session-wide real services: one redis-server and (lazily) one local Ray for the whole run.

Ray costs 5-11 s and ~900 MB to start on these machines, so every test that needs it shares the
one instance from `ray_session`; Redis is cheap but shared too, each test gets a clean db via
`redis_client`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ast_lock

from pipeline.redis_server import LocalRedis

ast_lock.install()  # CPython 3.11: "AST constructor recursion depth mismatch" (support/ast_lock.py)

# Private Ray: no token auth files in ~/.ray, workers not starved by nice 15 (NOTES.md).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Idle Ray workers are kept for reuse instead of killed after 1 s beyond num_cpus: the tests'
# short bursts of tasks then stop paying a new worker's imports each time (the Ray-using modules:
# 64 -> 47 worker processes, -10% of their CPU).
os.environ.setdefault("RAY_idle_worker_killing_time_threshold_ms", "600000")
os.environ.setdefault("RAY_num_workers_soft_limit", "8")
# S3 reads against the tests' own S3-protocol server (moto, tests/order/test_remote_sources.py):
# credentials it accepts, set before any Ray worker starts (workers inherit them), and no wait
# on a cloud metadata service for others.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    server = LocalRedis().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: LocalRedis):
    from pipeline.redis_client import connect

    client = connect(redis_server.url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole test session (started on first use)."""
    import ray

    tmp = tempfile.mkdtemp(prefix="odb-ray-", dir="/tmp")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tmp,
        object_store_memory=512 * 1024 * 1024,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield None
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help=f"record each test's seconds in this run in {DURATIONS.name}, which "
                          "orders later parallel runs longest first")


@pytest.hookimpl(tryfirst=True)  # before xdist's loadgroup reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of a module that share a module-scoped fixture (a cluster, a served README)
    run on one xdist worker (`--dist loadgroup`), so that fixture is set up once, not once per
    worker. A test already in a group keeps it. In a parallel run the groups and tests are
    then handed out longest first (`_longest_first`)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        defs = getattr(item, "_fixtureinfo", None)
        if defs is not None and any(d[-1].scope == "module"
                                    for d in defs.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = _longest_first(items)


def _recorded() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def _scope(item: pytest.Item) -> str:
    """What xdist's loadgroup hands out as one unit: a group, or a test alone."""
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark is not None else item.nodeid


def _longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """Units in the order of their seconds in a recorded run, longest first (xdist hands them
    out in collection order with `--no-loadscope-reorder`): the long process-starting units no
    longer come last and leave one worker running alone at the end. A test not recorded counts
    0 s. Only the order depends on the recording: a stale one costs time, never a result."""
    seconds = _recorded()
    cost: dict[str, float] = defaultdict(float)
    for item in items:
        cost[_scope(item)] += seconds.get(item.nodeid, 0.0)
    return sorted(items, key=lambda item: -cost[_scope(item)])  # stable: a unit keeps its order


class _DurationRecorder:
    """`--store-durations`: setup + call + teardown of every test, as the controller sees it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.partition("@")[0]] += report.duration

    def pytest_sessionfinish(self) -> None:
        """Merged into the recording: a run of some tests updates theirs, keeps the rest."""
        kept = _recorded()
        kept.update({k: round(v, 1) for k, v in self.seconds.items()})
        kept = {k: v for k, v in sorted(kept.items()) if v >= 0.2}
        DURATIONS.write_text(json.dumps(kept, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("store_durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_DurationRecorder(), "odb-durations")


@pytest.fixture(autouse=True)
def _grouped_as_marked(request: pytest.FixtureRequest) -> None:
    """Fails a grouped test when `--dist loadgroup` silently does not group (pytest 9.2 with
    pytest-xdist 3.8 did that): time-bound tests would run beside each other, and a module's
    shared fixture would be set up on every worker."""
    item = request.node
    if (os.environ.get("PYTEST_XDIST_WORKER") and request.config.getvalue("loadgroup")
            and item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid):
        pytest.fail(f"--dist loadgroup did not group {item.nodeid}: this pytest-xdist cannot "
                    "rename this pytest's nodeids (pyproject.toml pins pytest below 9.2 for it)")
