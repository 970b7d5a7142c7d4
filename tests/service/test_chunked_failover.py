"""A chunked batch cut off mid-way (issue #32): the replica streaming it is killed (SIGKILL)
after the trainer got part of its chunks; the trainer fails over to the other replica, which
sends the batch again whole. No half batch is ever yielded, and every sample arrives exactly
once, byte for byte."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from support.waiting import wait_for
from vlm_data import preprocess, repeated, vlm_job, write_records

from pipeline.coordinator import RedisJobState
from trainer_client import BatchStream
from trainer_client.batch_assembly import BatchAssembler

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
CUT_STEP = 1  # the batch the replica dies in the middle of


class Replica:
    """tests/service/vlm_replica.py in a process of its own (SIGKILL-able)."""

    def __init__(self, redis_url: str, job: dict, repeat: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "vlm_replica.py"), "--redis-url", redis_url,
             "--job-json", json.dumps(job), "--repeat", str(repeat), "--chunk-kb", "256"],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # READY <port>, once it listens
        if not line.startswith("READY"):
            self.kill()
            raise AssertionError(f"replica did not start: {self.proc.stderr.read()[-3000:]}")
        self.address = f"127.0.0.1:{line.split()[1]}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def cut_mid_batch(monkeypatch):
    """Holds the trainer's receiver at the first chunk of step CUT_STEP until `resume` is set,
    and records what each assembler of that step got."""
    reached, resume = threading.Event(), threading.Event()
    seen: list[dict] = []  # per assembler of CUT_STEP: chunks added, complete
    add = BatchAssembler.add

    def held_add(self, tensor, offset, data):
        if self.header.step == CUT_STEP:
            if not seen or seen[-1]["assembler"] is not self:
                seen.append({"assembler": self, "chunks": 0, "complete": False})
            if len(seen) == 1 and not reached.is_set():
                reached.set()
                resume.wait(60)
            seen[-1]["chunks"] += 1
        add(self, tensor, offset, data)
        if self.header.step == CUT_STEP:
            seen[-1]["complete"] = self.complete

    monkeypatch.setattr(BatchAssembler, "add", held_add)
    return reached, resume, seen


def test_a_batch_cut_off_mid_way_is_sent_again_whole_by_the_other_replica(
        redis_url, tmp_path, cut_mid_batch):
    reached, resume, seen = cut_mid_batch
    # Four pictures a batch (24 MB in 256 KiB chunks), four batches, one rank.
    job = vlm_job("cut", 1, write_records(tmp_path, 4), token_budget=5400)
    expected = {s.sample_id: s for s in repeated(preprocess(job), 16)}
    first = Replica(redis_url, job, 16)  # takes the producer lease and plans the job
    second = None
    try:
        state = RedisJobState.attach(redis_url, "cut")
        wait_for(state.is_done, 60, "the job fully planned")
        second = Replica(redis_url, job, 16)
        got: list = []
        stream = BatchStream(f"ipv4:{first.address},{second.address}", "cut", 0, 1,
                             tensors="numpy", backoff=(0.05, 0.5),
                             load_balancing="pick_first")  # on `first`, the one killed
        reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
        reader.start()
        assert reached.wait(120), "step 1 never started arriving"
        first.kill()  # mid-batch: the trainer holds part of step 1's chunks
        resume.set()
        reader.join(120)
        assert not reader.is_alive(), "the trainer did not finish after the failover"
        reconnects = stream.reconnects
        stream.close()
    finally:
        resume.set()
        for r in (first, second):
            if r is not None:
                r.kill()
    assert reconnects >= 1
    assert len(seen) == 2 and not seen[0]["complete"] and seen[1]["complete"]
    assert seen[1]["chunks"] > seen[0]["chunks"]  # the cut batch really was cut
    assert [b.info.step for b in got] == [0, 1, 2, 3]  # each batch once, none half
    ids = [i for b in got for i in b.info.sample_ids]
    assert sorted(ids) == sorted(expected)  # every sample exactly once
    for b in got:
        mine = [expected[i] for i in b.info.sample_ids]
        assert b["pixel_values"].tobytes() == np.concatenate(
            [s.pixel_values for s in mine]).tobytes()
