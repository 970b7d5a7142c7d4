"""What a consumer gets over loopback gRPC from the real server (real Redis, real tokenizer and
image processor): an image prompt's pixels as a training batch carries them, the loser of a
lapsed lease told at once to drop its work, and a stop that leaves no handler thread behind."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import torch
from refill_helpers import CHATS, chats_slice, refill_config, refill_job
from support.waiting import wait_for

from pipeline.cli import main
from pipeline.config import RefillJobConfig
from pipeline.coordinator.refill_state import RefillState
from pipeline.preprocess.process import Processor
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
from pipeline.preprocess.vision import MERGE_SIZE, PIXEL_NORM
from pipeline.service.server import start_service
from trainer_client import RefillStream
from trainer_client.batch_stream import StreamError
from trainer_client.pixels import normalize_numpy


def image_chats(tmp_path: Path) -> Path:
    """A text chat and two image chats of the shipped sample (their images next to them)."""
    lines = CHATS.read_bytes().splitlines(keepends=True)
    out = tmp_path / "vlm.jsonl"
    out.write_bytes(lines[0] + lines[10] + lines[12])
    (tmp_path / "images").symlink_to(CHATS.parent / "images")
    return out


def preprocessed(job: dict) -> dict[str, ProcessedSample]:
    """The job's samples as the project's own preprocessing makes them (epoch 0)."""
    cfg = RefillJobConfig.model_validate(job)
    proc = Processor(cfg, 0)
    out = {}
    for chunk in plan_chunks(expand_sources(cfg.source), 64):
        for item in proc.process(chunk.file, read_chunk(chunk)):
            assert isinstance(item, ProcessedSample), item
            out[item.sample_id] = item
    return out


def test_an_image_prompt_reaches_the_consumer_with_its_pixels(tmp_path, redis_url, redis_client):
    job = refill_job(image_chats(tmp_path), "vlm", generation_tokens=32)
    svc = start_service(refill_config(job, redis_url=redis_url))
    try:
        got = {}
        with RefillStream(svc.address, "vlm", tensors="torch") as s:
            held: list[str] = []
            while not s.exhausted:
                reqs = s.refill(10**6, held)
                got.update({r.sample_id: r for r in reqs})
                held = [r.id for r in reqs]
    finally:
        svc.stop(grace=0.2)
    want = preprocessed(job)
    assert sorted(got) == sorted(want)
    pad = Processor(RefillJobConfig.model_validate(job), 0).image_pad_id
    images = 0
    for sid, r in got.items():
        sample = want[sid]
        assert isinstance(r.input_ids, torch.Tensor) and r.input_ids.dtype == torch.int32
        ids = r.input_ids.numpy()
        assert (ids == sample.input_ids[: len(ids)]).all()
        if sample.pixel_values is None:
            assert r.pixel_values is None and r.image_grid_thw is None
            continue
        images += 1
        # The very patches and grid preprocessing made: raw uint8 with their normalization.
        pixels, grid = r.pixel_values.numpy(), r.image_grid_thw.numpy()
        assert pixels.dtype == np.uint8 and (pixels == sample.pixel_values).all()
        assert (grid == sample.image_grid_thw).all() and r.pixel_norm == PIXEL_NORM
        assert int((ids == pad).sum()) == int(np.prod(grid, axis=1).sum()) // MERGE_SIZE**2
        inputs = r.to_model_inputs("cpu", torch.float32)
        assert inputs["input_ids"].dtype == torch.int64 and inputs["input_ids"].shape == (
            1, len(ids))
        assert inputs["image_grid_thw"].dtype == torch.int64
        np.testing.assert_allclose(inputs["pixel_values"].numpy(),
                                   normalize_numpy(sample.pixel_values, PIXEL_NORM), rtol=1e-6)
    assert images == 2


def test_the_loser_of_a_lapsed_lease_is_told_at_once_to_drop_its_work(tmp_path, redis_url,
                                                                      redis_client, capsys):
    """Two consumers, one goes silent past its lease: the other takes its requests over, and
    the silent one's very next ask says which to stop (not only a later report, as `stale`)."""
    job = refill_job(chats_slice(tmp_path, 20), generation_tokens=64, lease_seconds=2.0)
    svc = start_service(refill_config(job, redis_url=redis_url))
    state = RefillState.connect(redis_url, "gen")
    try:
        wait_for(lambda: state.counts().exhausted, 60, "the producer to read the source")
        with RefillStream(svc.address, "gen", consumer_id="slow") as slow, \
                RefillStream(svc.address, "gen", consumer_id="heir") as heir:
            taken = slow.refill(400)
            mine = sorted(r.id for r in taken)
            assert mine
            heirs: set[str] = set()

            def heir_took_them() -> bool:
                heirs.update(r.id for r in heir.refill(10**6, []))
                return set(mine) <= heirs

            wait_for(heir_took_them, 30, "the heir to take the silent consumer's requests")
            back = slow.refill(0)
            assert (list(back), sorted(back.cancel), slow.revoked) == ([], mine, mine)
            assert slow.dropped == len(mine) and not slow.held & set(mine)
            # A late report of them anyway: not applied, dropped again; the heir's completes.
            late = slow.refill(0, mine)
            assert (sorted(late.cancel), slow.stale, slow.completed) == (mine, mine, [])
            assert slow.dropped == 2 * len(mine)
            heir.refill(0, mine)
            assert sorted(heir.completed) == mine and not heir.stale
        done = state.completions()
        assert [done[i] for i in mine] == ["heir"] * len(mine)
        assert state.counts().lease_lapses == 1
        # Redis alone (no replica asked) lists and shows the job, its lapse counted.
        capsys.readouterr()
        assert main(["status", "--redis-url", redis_url, "--json"]) == 0
        (job,) = json.loads(capsys.readouterr().out)["jobs"]
        assert (job["job_id"], job["mode"], job["refill"]["lease_lapses"]) == ("gen", "refill", 1)
        assert job["refill"]["readmitted"] == len(mine) and job["open"] is None
    finally:
        svc.stop(grace=0.2)


def test_a_stop_ends_busy_refill_calls_and_leaves_no_handler_thread(tmp_path, redis_url,
                                                                   redis_client):
    job = refill_job(chats_slice(tmp_path, 20), generation_tokens=64)
    svc = start_service(refill_config(job, redis_url=redis_url))
    asks = [0, 0, 0]
    codes: list[grpc.StatusCode] = []

    def consume(i: int) -> None:
        try:
            with RefillStream(svc.address, "gen", consumer_id=f"c{i}",
                              reconnect_timeout=1) as s:
                held: list[str] = []
                while True:
                    held = [r.id for r in s.refill(300, held)]
                    asks[i] += 1
        except StreamError as exc:
            codes.append(exc.code)

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: min(asks) >= 3, 60, "every consumer to be asking")
    finally:
        t0 = time.monotonic()
        svc.stop(grace=0.2)
        took = time.monotonic() - t0
    left = [t.name for t in threading.enumerate()
            if t.name.startswith(("odb_", "odb-io", "odb-grpc", "refill-"))]
    assert not left and took < 15, (left, took)  # (a generous bound: it would hang)
    for t in threads:
        t.join(30)
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 3  # each retried, then gave up
