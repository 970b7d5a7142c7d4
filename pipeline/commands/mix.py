"""`odb-pipeline mix`: change a mixture job's weights while it runs (docs/data-order.md).

    odb-pipeline mix --job sft-1 --weights chat=0.7,code=0.3
    odb-pipeline mix --endpoint svc:50051 --job sft-1 --weights chat=1,code=1 --token-env T

Finds the service as `status` does (`pipeline.status.sources`) and makes the authenticated Mix
call on any replica. The job's producer applies the new weights from the next step it plans,
for every rank at one step boundary (like `scale`); the change is recorded in the plan, so a
resume replays it, and shows in `status` (`sources`). Every source of the mixture must be
named; 0 leaves a source out. Exit 2 with the service's reason when it refuses (an unknown or
missing source, weights that do not sum to a positive number, a job without a mixture or fully
planned, an unknown job).
"""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.commands.job_call import call_job
from pipeline.errors import UserError
from pipeline.status import sources as status_sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, metavar="ID")
    parser.add_argument("--weights", required=True, metavar="NAME=W,...",
                        help="a weight for every source of the job's mixture, e.g. a=0.5,b=0.5")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    status_sources.add_arguments(parser)  # where the service is: as `status` finds it


def run(args: argparse.Namespace) -> int:
    from pipeline.order.mixture import MixtureError, parse_weights
    from trainer_client.wire.odb.v1 import data_service_pb2 as pb

    try:
        weights = parse_weights(args.weights)
    except MixtureError as exc:
        raise UserError(str(exc)) from None
    reply = call_job(args, "Mix", pb.MixRequest(job_id=args.job, weights=weights))
    out = {"job_id": reply.job_id, "seq": reply.seq, "weights": dict(reply.weights)}
    if args.json:
        print(json.dumps(out))
    else:
        shown = ", ".join(f"{n}={w:g}" for n, w in weights.items())
        print(f"job {args.job}: mixture change {reply.seq} ({shown}) applies from the next step "
              f"the producer plans; `odb-pipeline status --job {args.job}` shows it as "
              f"\"mix {reply.seq}\"")
    sys.stdout.flush()
    return 0
