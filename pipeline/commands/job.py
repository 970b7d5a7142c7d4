"""`odb-pipeline job delete|reset ID`: remove a job's state, where `serve` keeps it.

    odb-pipeline job reset sft-1 --config deploy/local/odb.yaml   # start it over, this config
    odb-pipeline job delete sft-1 --redis-url redis://redis:6379/0

`delete` removes every key of the job (plan, cursors, leases, counters, quarantine, worlds, an
SDO job's ledger) and its registry entry. `reset` does the same, then registers the job anew
from the config (`--config`, the `ODB_*` environment), so the next `serve` of that config
starts it from its first step instead of refusing it as changed.

Where the state is: `--redis-url`, else the config's `redis_url`, else the embedded default
of its `state_dir`: the Redis of the `serve` running there (refused if it serves the job: stop
it first), or, with none running, the embedded Redis started here for the command and stopped
after it (its AOF fsynced). A job whose producer, ranks or consumers still hold a live lease is
refused too: a service is using it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import UserError

if TYPE_CHECKING:
    import redis

    from pipeline.config import ServiceConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("delete", "reset"),
                        help="the action: delete forgets the job; reset deletes it, then "
                             "registers it anew from the config (the next serve starts it "
                             "from its first step)")
    parser.add_argument("job", metavar="ID")
    parser.add_argument("--config", metavar="FILE",
                        help="the service config (its redis_url or state_dir; reset: the job)")
    parser.add_argument("--redis-url", metavar="URL", help="the job's Redis (over the config's)")


def run(args: argparse.Namespace) -> int:
    from pipeline.config import load_config
    from pipeline.coordinator import registry

    config = load_config(args.config)
    job = None
    if args.action == "reset":
        try:
            job = config.job(args.job)
        except KeyError:
            raise UserError(f"job {args.job!r} is not in {args.config or 'the configuration'}: "
                            "reset registers it from its config (give --config); `job delete` "
                            "forgets a job without one") from None
    with _state(args, config) as (client, where):
        if registry.read_job(client, args.job) is None:
            known = registry.list_jobs(client)
            raise UserError(f"no job {args.job!r} in {where}"
                            + (f" (its jobs: {', '.join(known)})" if known else " (no jobs)"))
        live = registry.live_holders(client, args.job)
        if live:
            raise UserError(f"job {args.job!r} in {where} is in use: live leases of "
                            f"{', '.join(live)}; stop the service that serves it (and its "
                            "trainers) first")
        registry.delete_job(client, args.job)
        if job is None:
            print(f"job {args.job}: deleted from {where}")
            return 0
        _register(client, job)
        print(f"job {args.job}: reset in {where}; the next `odb-pipeline serve` of this config "
              "starts it from its first step")
    return 0


def _register(client: redis.Redis, job) -> None:
    from pipeline.config import RefillJobConfig
    from pipeline.coordinator import RedisJobState, registry

    if isinstance(job, RefillJobConfig):
        registry.register_refill_job(client, job.job_id, config_hash=registry.config_hash(job),
                                     seed=job.seed, config=registry.config_record(job))
    else:
        RedisJobState.connect(client, job)


@contextmanager
def _state(args: argparse.Namespace, config: ServiceConfig
           ) -> Iterator[tuple[redis.Redis, str]]:
    """(client, where, for messages) of the Redis holding the jobs."""
    from pipeline import local_services
    from pipeline.redis_client import connect, redact
    from pipeline.redis_server import LocalRedis

    with ExitStack() as stack:
        url = args.redis_url or config.redis_url
        where = f"the Redis at {redact(url)}" if url else ""
        if not url:
            state_dir = config.state_dir
            running = local_services.running(state_dir)
            serving = [s for s in running if args.job in s.token_envs]
            if serving:
                raise UserError(f"job {args.job!r} is served by {serving[0].describe()}, whose "
                                f"state is in {state_dir}: stop it first (Ctrl-C), then run "
                                "this again")
            if running:
                url = running[0].redis_url
                where = f"the embedded Redis of {running[0].describe()} (state in {state_dir})"
            elif (Path(state_dir) / "redis").is_dir():
                url = stack.enter_context(LocalRedis.durable(state_dir)).url
                where = f"the embedded state in {state_dir}"
            else:
                raise UserError(f"no state in {state_dir} (the embedded default's state_dir; "
                                "give --config, ODB_STATE_DIR or --redis-url for the job's)")
        client = connect(url)
        stack.callback(client.close)
        yield client, where
