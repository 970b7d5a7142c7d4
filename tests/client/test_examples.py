"""Every example under deploy/trainer/ runs: one rank against a served job, the steps it was
asked for (the service saw it take their batches), and exits cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from service_helpers import job_dict, service_config, serving

from pipeline.preprocess.array_source import synthetic_samples
from pipeline.redis_server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "trainer"


@pytest.mark.parametrize(("script", "extra"), [
    ("train_example.py", ["--max-steps", "3"]),
    ("loader_example.py", ["--max-steps", "3"]),
    ("accelerate_example.py", ["--max-steps", "3"]),
    ("hf_trainer_example.py", ["--max-steps", "3", "--save-steps", "1000"]),
    ("lightning_example.py", ["--max-steps", "3"]),
])
def test_example_trains_a_few_steps(tmp_path, script, extra):
    cfg = service_config(job_dict("example-job", world_size=1,
                                  batching={"token_budget": 512}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    outputs = {"hf_trainer_example.py": ["--output-dir", str(tmp_path / "out")],
               "lightning_example.py": ["--checkpoint-dir", str(tmp_path / "out")]}
    with serving(cfg, {"example-job": synthetic_samples(40, max_len=200)}) as svc:
        # torch's rendezvous binds MASTER_PORT itself: a free port can be taken by another
        # process (the other worker's) before it does, so one EADDRINUSE gets a second port.
        for _attempt in range(2):
            proc = subprocess.run(
                [sys.executable, str(EXAMPLES / script), "--endpoint", svc.address,
                 *outputs.get(script, []), *extra],
                env={**env, "MASTER_PORT": str(free_port()), "PIPELINE_ENDPOINT": svc.address},
                cwd=tmp_path, capture_output=True, text=True, timeout=300)
            if "EADDRINUSE" not in proc.stderr:
                break
        state = svc.runtimes["example-job"].state
        took, planned = state.acked(0), state.published_through()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    # It took the batches of its 3 steps (an ack per batch taken), and stopped there: the
    # epoch has more.
    assert 2 <= took < planned, (took, planned, proc.stdout[-2000:])
