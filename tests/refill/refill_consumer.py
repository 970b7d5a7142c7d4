"""A refill consumer process for the kill tests: finishes its requests after random times and
appends every id the service confirmed as completed by it to a log (one line each, flushed).

    python refill_consumer.py ENDPOINT JOB CONSUMER_ID LOG SEED CAPACITY
"""

from __future__ import annotations

import random
import sys
import time

from trainer_client import RefillStream


def main() -> int:
    endpoint, job, consumer, log, seed, capacity = sys.argv[1:7]
    rng = random.Random(int(seed))
    cap = int(capacity)
    held: dict[str, int] = {}  # id -> cost
    with RefillStream(endpoint, job, consumer_id=consumer) as stream, open(log, "a") as out:
        finished: list[str] = []
        while not stream.exhausted:
            for rid in finished:
                held.pop(rid)
            got = stream.refill(cap - sum(held.values()), finished)
            for rid in stream.completed:
                out.write(rid + "\n")
            out.flush()
            held.update({r.id: r.cost for r in got})
            finished = [rid for rid in held if rng.random() < 0.4]
            time.sleep(0.01 if held else 0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
