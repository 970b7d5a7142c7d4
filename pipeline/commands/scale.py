"""`odb-pipeline scale`: move the rest of a job onto a new world size (docs/elastic.md).

    odb-pipeline scale --job sft-1 --world-size 8
    odb-pipeline scale --endpoint svc:50051 --job sft-1 --world-size 8 --token-env ODB_TOKEN

Finds the service as `status` does (`pipeline.status.sources`: --endpoint, else
the local service as `serve` configured itself; the job's token from --token/--token-env or
its `token_env`; TLS likewise) and makes the authenticated Scale call on any replica. The
service ends the current world at a step every rank can reach, ends each of its ranks there with
END(reconfigure) carrying the new size, and re-plans what they will not run for the new world.
Prints both worlds (`--json`: one object with `changed`, `world`, `previous`); exit 2 with the
service's reason when it refuses (a size out of range, an unknown job, a switch still in
progress, a fully planned job).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline.commands.job_call import call_job
from pipeline.errors import UserError
from pipeline.status import sources as status_sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, metavar="ID")
    parser.add_argument("--world-size", required=True, type=int, metavar="N",
                        help="the new world size (>= 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    status_sources.add_arguments(parser)  # where the service is: as `status` finds it


def _world(w: Any) -> dict[str, Any]:
    return {"generation": w.generation, "world_size": w.world_size, "first_step": w.first_step,
            "last_step": None if w.last_step < 0 else w.last_step,
            "rank_last_steps": list(w.rank_last_steps), "reason": w.reason,
            "returned_samples": w.returned_samples}


def run(args: argparse.Namespace) -> int:
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    if args.world_size < 1:
        raise UserError(f"--world-size must be >= 1, got {args.world_size}")
    reply = call_job(args, "Scale", pb.ScaleRequest(job_id=args.job, world_size=args.world_size))
    out = {"job_id": reply.job_id, "changed": reply.changed, "world": _world(reply.world),
           "previous": _world(reply.previous) if reply.HasField("previous") else None}
    if args.json:
        print(json.dumps(out))
    elif not reply.changed:
        print(f"job {args.job}: already {reply.world.world_size} ranks; nothing to do")
    else:
        prev, new = out["previous"], out["world"]
        print(f"job {args.job}: world {prev['world_size']} -> {new['world_size']} ranks: the "
              f"old world runs through step {prev['last_step']} (last step per rank "
              f"{prev['rank_last_steps']}), {prev['returned_samples']} samples re-planned; the "
              f"new world starts at step {new['first_step']}")
    sys.stdout.flush()
    return 0
