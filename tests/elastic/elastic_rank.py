"""A trainer rank of an elastic job in its own process (run by the tests, not collected).

Consumes its rank's stream until an END, appending one JSON line per batch ({"world", "rank",
"step", "epoch", "ids", "digest", "step_samples", "rank_samples", "step_tokens", "rank_tokens",
"filler", and of a global step's micro-batch "micro", "micros", "opt"})
and saving its state_dict after every batch (atomic rename: a SIGKILL never leaves half a
checkpoint). `--restore` loads a state saved by any rank of any world of the job. At the END it
saves its state once more, writes {"end": reason, "world_size", "final_step", "done"} and exits
0; a refused stream writes {"error": CODE, "details"} and exits 3. With `--gate FILE` it holds
after `--hold-after` batches (its stream open, heartbeating) until FILE exists: a test acts on a
world mid-epoch however slowly the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trainer_client import BatchStream, StreamError


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--restore", default="")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--gate", default="")
    p.add_argument("--hold-after", type=int, default=0)
    args = p.parse_args()
    state = Path(args.state)
    # Heartbeats well within the tests' short leases (1-2 s): a live rank never lapses.
    stream = BatchStream(args.address, args.job, args.rank, args.world, prefetch=2,
                         backoff=(0.05, 0.25), tensors="numpy", heartbeat_s=0.25)
    if args.restore:
        stream.load_state_dict(json.loads(Path(args.restore).read_text()))

    def save() -> None:
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps(stream.state_dict()))
        tmp.replace(state)

    with open(args.out, "a") as log:
        def emit(rec: dict) -> None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
            os.fsync(log.fileno())

        try:
            for taken, batch in enumerate(stream, 1):
                i = batch.info
                emit({"world": args.world, "rank": args.rank, "step": i.step, "epoch": i.epoch,
                      "ids": list(i.sample_ids), "digest": batch.digest(),
                      "step_samples": i.step_samples, "rank_samples": i.rank_samples,
                      "step_tokens": i.step_tokens, "rank_tokens": i.rank_tokens,
                      "filler": i.filler, "micro": i.micro_index, "micros": i.micro_count,
                      "opt": i.optimizer_step})
                time.sleep(args.sleep)  # "training"
                save()
                while args.gate and taken == args.hold_after and not Path(args.gate).exists():
                    time.sleep(0.02)
        except StreamError as exc:
            emit({"error": exc.code.name, "details": exc.details})
            sys.exit(3)
        save()
        end = stream.last_end
        emit({"end": end.reason, "world_size": end.world_size, "final_step": end.final_step,
              "done": stream.done})
    stream.close()


if __name__ == "__main__":
    main()
