"""RedisJobState behind the real gRPC server (engineer C's), as `make_job_state` will wire it.

A smoke test of the seam, not the fault-injection suite (the lead wires that): W=3 join-mode ranks
over 2 epochs read everything exactly once per epoch through a server whose state is in Redis,
and Redis afterwards holds a consistent, finished job.
"""

from __future__ import annotations

import threading

import pytest

server = pytest.importorskip("pipeline.service.server")
sources = pytest.importorskip("pipeline.service.sources")
trainer_client = pytest.importorskip("trainer_client")

from pipeline.config import ServiceConfig  # noqa: E402
from pipeline.coordinator import RedisJobState, job_summary  # noqa: E402


def test_grpc_server_over_redis_state_delivers_each_sample_once_per_epoch(redis_client, redis_url):
    w, epochs = 3, 2
    cfg = ServiceConfig.model_validate({
        "metrics_port": None,
        "grpc": {"port": 0}, "lease_seconds": 5.0,
        "jobs": [{"job_id": "srv", "world_size": w, "epochs": epochs,
                  "source": {"paths": ["arrays"]},
                  "batching": {"token_budget": 2048, "max_window_samples": 64}}]})
    samples = sources.synthetic_samples(200, max_len=900, seed=3)
    st = RedisJobState.connect(redis_url, cfg.jobs[0], history_steps=2)
    svc = server.start_service(cfg, job_states={"srv": st},
                               sample_sources={"srv": sources.ArraySource(samples)})
    got: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with trainer_client.BatchStream(svc.address, "srv", rank, w) as s:
                ids: list[str] = []
                for _ in range(epochs):
                    ids += [i for b in s for i in b.info.sample_ids]
                got[rank] = ids
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(w)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        svc.stop(grace=0.5)
    if errors:
        raise errors[0]
    ids = [i for r in range(w) for i in got[r]]
    assert sorted(ids) == sorted(s.sample_id for s in samples for _ in range(epochs))
    summary = job_summary(redis_client, "srv")
    assert summary.job.state == "done" and summary.epoch_ends == epochs
    assert summary.job.trimmed_through >= 0  # acks through Redis drove trimming
    assert summary.lapsed_ranks == []  # every rank released its lease at the end
    ends = st.epoch_ends()
    assert [e.epoch for e in ends] == list(range(epochs))
    assert max(f for f in ends[-1].final_step if f is not None) == summary.job.published_through
