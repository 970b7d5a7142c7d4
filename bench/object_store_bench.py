"""Object-store memory of a served Ray job: bounded by back-pressure, not by the dataset.

    .venv/bin/python bench/object_store_bench.py [--quick]

A private Ray and Redis; one replica (`start_service`) serves a Ray-preprocessed job of
generated chats (15% with pictures) to 4 rank threads that consume at a steady pace. Ray's
plasma usage is sampled every 0.25 s. A batch's payload object is released once its rank
acknowledged the step and the epoch's blocks once every row of them is staged, so the peak
stays near `preprocess.object_store_mb` plus the staged steps (`max_ahead` per rank), whatever
the dataset's size: the run reports the peak next to the bytes delivered.
Writes object_store_bench{,_quick}.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_dir import add_out_argument, out_dir  # noqa: E402

WORLD = 4


def _plasma_mib() -> float:
    import ray
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return float(re.search(r"Plasma memory usage (\d+) MiB", text)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,500 chats instead of 6,000")
    add_out_argument(ap, "object_store")
    args = ap.parse_args()
    from pipeline.config import ServiceConfig
    from pipeline.producer.actor import stop_producer
    from pipeline.ray_runtime import PrivateRay
    from pipeline.redis_server import LocalRedis
    from pipeline.sample_data import IMAGES_DIR
    from pipeline.sample_data.generate import generate
    from pipeline.service.server import start_service
    from trainer_client import BatchStream

    rows = 1500 if args.quick else 6000
    cap_mb = 64
    tmp = Path(tempfile.mkdtemp(prefix="odb-osbench-"))
    data = tmp / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(
        rows, 11, image_prefix=str(IMAGES_DIR))))
    job = {"job_id": "os", "world_size": WORLD, "source": {"paths": [str(data)]},
           "preprocess": {"object_store_mb": cap_mb},
           "batching": {"token_budget": 8192, "pool_steps": 2}}
    samples: list[tuple[float, float]] = []
    delivered = [0]
    with LocalRedis() as redis, PrivateRay(object_store_mb=1024):
        cfg = ServiceConfig.model_validate({"redis_url": redis.url, "metrics_port": None,
                                            "grpc": {"port": 0}, "jobs": [job]})
        svc = start_service(cfg)
        t0 = time.monotonic()
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append((time.monotonic() - t0, _plasma_mib()))
                time.sleep(0.25)

        def rank(r: int) -> None:
            with BatchStream(svc.address, "os", r, WORLD) as s:
                for b in s:
                    delivered[0] += sum(t.numel() * t.element_size() for t in b.values())
                    time.sleep(0.05)  # a trainer step

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ranks = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join()
        done.set()
        sampler.join()
        wall = time.monotonic() - t0
        state = svc.runtimes["os"].state
        counters = state.counters()
        svc.stop(grace=0.5)
        stop_producer("os")
    peak = max(m for _, m in samples)
    result = {
        "command": "python bench/object_store_bench.py" + (" --quick" if args.quick else ""),
        "rows": rows, "world_size": WORLD, "preprocess_object_store_mb": cap_mb,
        "samples_in": counters.samples_in, "delivered_mb": delivered[0] / 2**20,
        "wall_s": wall, "peak_plasma_mib": peak,
        "mean_plasma_mib": sum(m for _, m in samples) / len(samples),
        "load_avg_at_end": os.getloadavg()[0], "series": samples,
    }
    out_path = out_dir(args, "object_store")
    stem = "object_store_bench_quick" if args.quick else "object_store_bench"
    (out_path / f"{stem}.json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t for t, _ in samples], [m for _, m in samples], label="plasma in use")
    ax.axhline(cap_mb, ls="--", color="grey", label="preprocess.object_store_mb")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title(f"{rows} chats, {delivered[0] / 2**20:.0f} MiB delivered: peak {peak:.0f} MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path / f"{stem}.png", dpi=110)
    print(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
