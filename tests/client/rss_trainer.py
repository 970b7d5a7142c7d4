"""A trainer rank in a process of its own for the byte-window test (run by it, not collected):

    python rss_trainer.py ADDRESS JOB PREFETCH PREFETCH_BYTES STEP_SECONDS

Takes every batch of its stream, spending STEP_SECONDS on each (the queue fills meanwhile), and
prints one JSON line: its RSS once torch and the client are imported, its peak RSS while
streaming (Linux VmHWM, restarted after the imports), the batches and the largest batch's bytes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch  # noqa: F401  (a trainer has torch loaded)

from trainer_client import BatchStream


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    address, job, prefetch, prefetch_bytes, step_s = sys.argv[1:6]
    stream = BatchStream(address, job, 0, 1, prefetch=int(prefetch),
                         prefetch_bytes=int(prefetch_bytes))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from here
    baseline = status_kb("VmRSS")
    batches = largest = 0
    with stream:
        for batch in stream:
            batches += 1
            largest = max(largest, batch.nbytes)
            time.sleep(float(step_s))
    print(json.dumps({"baseline_kb": baseline, "peak_kb": status_kb("VmHWM"),
                      "batches": batches, "largest": largest}))


if __name__ == "__main__":
    main()
