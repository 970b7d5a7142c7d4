"""Issue #27 item 4: an elastic Open with a restored position must not ignore an epoch END
published after that position. The repro: an elastic job of 2 ranks, 2 epochs; a state saved at
step 5; the ranks train until END(0) is published and into epoch 1, then both die; once their
leases lapsed, 4 ranks open with that state.

Before the fix the switch returned the rest of epoch 0 (re-planned into epoch 1, though END(0)
was out), ranks 2 and 3 hit IndexError on END(0)'s two final steps (the client saw UNKNOWN) and
ranks 0 and 1 got END(0) at once. Now the old world keeps epoch 0 (its boundary is END(0)'s last
step), a position inside it is refused precisely (OUT_OF_RANGE), and a state saved after epoch
0 (before its END was taken) brings every new rank through END(0) into epoch 1, exactly once."""

from __future__ import annotations

import threading
from collections import Counter

import grpc
import pytest
from service_helpers import job_dict, service_config, serving
from support.waiting import wait_for

from pipeline.preprocess.array_source import synthetic_samples
from trainer_client import BatchStream, StreamError

JOB = "el"


def state_at(step: int, epoch: int) -> dict:
    """What `BatchStream.state_dict()` of any rank saved at that position."""
    return {"version": 2, "job": JOB, "rank": 0, "world_size": 2, "next_step": step,
            "epoch": epoch, "done": False, "epoch_first_step": 0}


def test_an_elastic_open_after_a_published_end_keeps_that_epoch_closed():
    items = synthetic_samples(400, max_len=400, seed=7)  # epochs longer than max_ahead
    cfg = service_config(job_dict(JOB, 2, epochs=2, elastic=True, max_world_size=4,
                                  batching={"token_budget": 1024}))
    cfg = cfg.model_copy(update={"lease_seconds": 1.0})
    kw = {"prefetch": 2, "tensors": "numpy", "heartbeat_s": 0.25, "reconnect_timeout": 10}
    with serving(cfg, {JOB: items}) as svc:
        state = svc.runtimes[JOB].state
        def old_rank(r: int) -> None:
            """Epoch 0 to its END, two batches of epoch 1; then the rank dies."""
            s = BatchStream(svc.address, JOB, r, 2, **kw)
            list(s)
            it = iter(s)
            next(it), next(it)
            s._link.stop()  # gone without a word: no release, the lease lapses

        old = [threading.Thread(target=old_rank, args=(r,)) for r in range(2)]
        for t in old:
            t.start()
        for t in old:
            t.join(60)
        (end0,) = state.epoch_ends()
        assert end0.last_step >= 5 and state.published_through() > end0.last_step
        wait_for(lambda: all(h.lapsed for h in state.rank_health()), 10, "the leases to lapse")

        # A state saved at step 5: inside epoch 0, whose END is out. Refused, precisely.
        early = BatchStream(svc.address, JOB, 2, 4, **kw)
        early.load_state_dict(state_at(5, 0))
        with pytest.raises(StreamError) as refused:
            list(early)
        early.close()
        assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE
        assert "resume_step 5" in refused.value.details
        w0, w1 = state.worlds()
        assert w0.last_steps == (end0.last_step,) * 2 and w1.world_size == 4  # epoch 0 kept

        # A state saved after epoch 0's last batch (its END not yet taken): every new rank,
        # ranks 2 and 3 included, gets END(0), then epoch 1.
        new = [BatchStream(svc.address, JOB, r, 4, **kw) for r in range(4)]
        got: list = []
        for s in new:
            s.load_state_dict(state_at(end0.last_step + 1, 0))
            assert list(s) == [] and s.last_end.epoch == 0  # END(0) first
            got += [b.info for b in s]
            assert s.done and s.last_end.epoch == 1
            s.close()
    assert {i.epoch for i in got} == {1} and all(i.step >= w1.first_step for i in got)
    ids = Counter(i for info in got for i in info.sample_ids)
    assert sorted(ids) == sorted(str(s.sample_id) for s in items) and set(ids.values()) == {1}
