"""deploy/trainer/elastic_example.py under real torchrun elastic agents (CPU, gloo) survives
losing a node: two single-worker nodes train; one node is killed (agent and worker, SIGKILL);
the other agent restarts its worker with WORLD_SIZE=1, which restores the checkpoint and opens
the stream with the new world size; the elastic job reconfigures and the epoch completes, every
sample trained exactly once relative to the checkpoint."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys

import psutil
import pytest
from elastic_helpers import ENV, ROOT, assert_exactly_once, samples, served
from support.waiting import wait_for

from pipeline.coordinator import RedisJobState
from pipeline.jobstate import ScaleReason
from pipeline.redis_server import free_port

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "deploy" / "trainer" / "elastic_example.py"


def agent(port: int, host: bool, address: str, tmp, log) -> subprocess.Popen:
    conf = f"is_host={'true' if host else 'false'},join_timeout=120,last_call_timeout=1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--max-restarts=2", "--monitor-interval=0.2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-example",
           f"--rdzv-conf={conf}", str(EXAMPLE), "--endpoint", address, "--job", "tx",
           "--checkpoint-dir", str(tmp), "--save-every", "2", "--record", str(log)]
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def kill_node(p: subprocess.Popen) -> None:
    """SIGKILL the agent and its workers (torchrun starts each worker in a session of its own)."""
    if p.poll() is not None:
        return
    procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    p.wait(10)


def test_the_elastic_example_survives_losing_a_node(redis_client, redis_url, tmp_path):
    items = samples(1000, seed=5)
    log = tmp_path / "trained.jsonl"
    with served(redis_url, "tx", 2, items, lease_seconds=1.0, job={"elastic": True}) as svc:
        port = free_port()
        a = agent(port, True, svc.address, tmp_path, log)
        b = agent(port, False, svc.address, tmp_path, log)
        try:
            def trained() -> list[dict]:
                if not log.exists():
                    return []
                return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]

            wait_for(lambda: {r["rank"] for r in trained() if r["step"] >= 4} == {0, 1}, 120,
                     "both nodes to train 5 steps")
            kill_node(b)  # the node is lost
            out, _ = a.communicate(timeout=240)
        finally:
            for p in (a, b):
                kill_node(p)
        assert a.returncode == 0, out[-4000:]
        resumed = [int(m) for m in re.findall(r"rank 0/1 \(restart \d\): resumed at step (\d+)",
                                              out)]
        assert resumed, out[-4000:]
        s = resumed[-1]
        state = RedisJobState.attach(redis_url, "tx")
        worlds = state.worlds()
        assert [w.world_size for w in worlds] == [2, 1]
        assert worlds[1].reason is ScaleReason.ELASTIC
        assert worlds[0].last_steps == (s - 1, s - 1)
        recs = trained()
        new = [r for r in recs if r["world"] == 1]
        old = [r for r in recs if r["world"] == 2 and r["step"] < s]
        assert new and min(r["step"] for r in new) == worlds[1].first_step
        assert_exactly_once(old + new, items)
        assert state.is_done()
