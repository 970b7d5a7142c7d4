"""A killable trainer rank process for the fault tests (run by them, not collected).

Consumes its rank's stream for all epochs, appending one JSON line per delivered batch
({"epoch", "step", "ids", "digest"}) and saving its state_dict after every batch (atomic
rename, so a SIGKILL never leaves half a checkpoint). Restarted with the same --state it resumes.
Ends with {"done": true} or, on a refused stream, {"error": CODE, "details": ...} (exit 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


from fault_helpers import HEARTBEAT_S

from trainer_client import BatchStream, StreamError


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--job", default="j")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--group-size", type=int, default=1)  # a member of the rank's group
    p.add_argument("--group-rank", type=int, default=0)
    args = p.parse_args()
    state = Path(args.state)
    stream = BatchStream(args.address, args.job, args.rank, args.world, prefetch=2,
                         backoff=(0.05, 0.5), heartbeat_s=HEARTBEAT_S,
                         group_size=args.group_size, group_rank=args.group_rank)
    if state.exists():
        stream.load_state_dict(json.loads(state.read_text()))
    with open(args.out, "a") as log:
        def emit(rec: dict) -> None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
            os.fsync(log.fileno())

        try:
            while not stream.done:
                for batch in stream:
                    emit({"epoch": batch.info.epoch, "step": batch.info.step,
                          "ids": list(batch.info.sample_ids), "digest": batch.digest(),
                          "filler": batch.info.filler})
                    time.sleep(args.sleep)  # "training"
                    tmp = state.with_suffix(".tmp")
                    tmp.write_text(json.dumps(stream.state_dict()))
                    tmp.replace(state)
        except StreamError as exc:
            emit({"error": exc.code.name, "details": exc.details})
            sys.exit(3)
        emit({"done": True})
    stream.close()


if __name__ == "__main__":
    main()
