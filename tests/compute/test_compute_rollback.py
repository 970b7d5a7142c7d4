"""A replayed step is the same after a Redis rollback under compute balancing (issue #40 item 4).

A real redis-server loses its newest writes, as one with `appendfsync everysec` and
`fsync_publish: false` does when it is killed: its state is saved (SAVE) while a real producer
plans a compute-balanced job whose ranks report as it goes, the producer publishes on (the fit
refits meanwhile, so later steps are balanced by newer models), the steps published since are
recorded (ranks may have received them), and Redis is killed and restarted from the save. The
producer finds the plan rolled back, replays from the surviving checkpoint, and every step it
publishes again must be the step recorded: the model that planned a step is the one its
checkpoint holds."""

from __future__ import annotations

from pipeline.config import TrainingJobConfig
from pipeline.coordinator import RedisJobState
from pipeline.jobstate import RankCompute
from pipeline.planner.compute_fit import ComputeModel, batch_features
from pipeline.planner.types import Collate, Step
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.producer.feed import ArrayFeed
from pipeline.producer.producer import Outcome, Producer, ProducerSettings
from pipeline.redis_server import LocalRedis

PLANTED = ComputeModel((1e-3, 2e-6, 1e-6, 3e-9, 0.0, 0.0, 5e-4))
W = 2


def seconds(step: Step, rank: int) -> float:
    b = step.batch_for(rank)
    return PLANTED.predict(batch_features(b.samples, [s.num_tokens for s in b.samples],
                                          Collate.PADDED))


class RollingBackSource(ArraySource):
    """Reports every step published so far before each row the producer reads (the ranks);
    once `save_at` steps are published the state is saved, and once `kill_after` more are, the
    steps published since the save are recorded and Redis restarts from the save."""

    def __init__(self, items, state: RedisJobState, redis: LocalRedis, *, save_at: int,
                 kill_after: int) -> None:
        super().__init__(items)
        self.state, self.redis = state, redis
        self.save_at, self.kill_after = save_at, kill_after
        self.reported = -1
        self.saved_through: int | None = None
        self.received: dict[int, Step] = {}

    def iter_epoch(self, epoch: int, start_row: int = 0):
        for item in super().iter_epoch(epoch, start_row):
            through = self.state.published_through()
            if self.saved_through is None and through >= self.save_at:
                self.saved_through = through
                self.state.client.save()
            elif (self.saved_through is not None and not self.received
                  and through >= self.saved_through + self.kill_after):
                self.received = {n: self.state.get_step(n)
                                 for n in range(self.saved_through + 1, through + 1)}
                self.redis.kill()  # what was written since the save is gone
                self.redis.start()
                self.reported = self.saved_through
                through = self.state.published_through()
            reports = []
            for n in range(self.reported + 1, through + 1):
                step = self.state.get_step(n)
                reports += [RankCompute(0, n, b.rank, seconds(step, b.rank))
                            for b in step.batches]
            self.state.record_compute(reports)
            self.reported = max(self.reported, through)
            yield item


def test_steps_replayed_after_a_redis_rollback_are_the_steps_received(tmp_path):
    job = TrainingJobConfig.model_validate({
        "job_id": "rb", "world_size": W, "seed": 5, "epochs": 1,
        "source": {"paths": ["arrays"]},
        "batching": {"token_budget": 1024, "max_window_samples": 32, "pool_steps": 2,
                     "compute_balancing": {"enabled": True, "min_reports": 8,
                                           "warmup_steps": 0}}})
    redis = LocalRedis(data_dir=tmp_path).start()
    try:
        state = RedisJobState.connect(redis.url, job)
        source = RollingBackSource(synthetic_samples(900, max_len=700, seed=5), state, redis,
                                   save_at=30, kill_after=30)
        producer = Producer(job, state, ArrayFeed(source, "padded"), holder="p",
                            settings=ProducerSettings(
                                max_ahead=10**6, linger_seconds=0.0, compute_poll_seconds=0.0,
                                retry_first_seconds=0.02, retry_cap_seconds=0.1))
        assert producer.run() is Outcome.DONE
        assert state.error() is None and state.is_done()
        received = source.received
        # The rollback happened while the model in force changed (refits every 16 reports).
        assert received and len({s.compute for s in received.values()}) > 1
        assert None not in {s.compute for s in received.values()}
        assert state.published_through() > max(received)
        replayed = {n: state.get_step(n) for n in received}
        assert [n for n in received if replayed[n] != received[n]] == []
    finally:
        redis.cleanup()
