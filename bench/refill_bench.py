"""Refill vs static batching for a diffusion LM consumer (issue #18), through the real service.

    .venv/bin/python bench/refill_bench.py            # full: 2 min training + 3 levels
    .venv/bin/python bench/refill_bench.py --quick    # a smoke run (~5 min on 2 loaded cores)

A tiny masked-diffusion LM (bench/mdlm, built from a config, trained for `--train-seconds` on the
shipped chats tokenized by the project's real preprocessing) decodes requests of mixed prompt
and generation lengths block-wise with a confidence threshold under two schedulers with the same
token capacity: static batching (a batch runs until all its members finish) and block-grained
eviction + token-budgeted refill through `odb-pipeline`'s Refill RPC (in-process `serve` over
loopback gRPC, a private redis-server, `trainer_client.RefillStream`). Convergence heterogeneity
is the spread of the per-request confidence threshold (0 = every request the same threshold).
For every level it checks output equality (each request's tokens identical under both
schedulers) and reports requests/s and tokens/s. Writes <name>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mdlm import data  # noqa: E402
from mdlm.decode import start  # noqa: E402
from mdlm.model import MaskedDiffusionLM, ModelConfig, train  # noqa: E402
from mdlm.schedulers import refill_through_service, static_batches  # noqa: E402
from mdlm.vocab import Vocab  # noqa: E402
from results_dir import add_out_argument, out_dir  # noqa: E402


def fetch_all(endpoint: str, job: str) -> list:
    """Every request of `job` once, in arrival order (the static scheduler's input: the very
    prompts the service hands out)."""
    from trainer_client import RefillStream

    got: list = []
    with RefillStream(endpoint, job, consumer_id="fetch") as s:
        held: list[str] = []
        while not s.exhausted:
            batch = s.refill(10**9, held)
            held = [r.id for r in batch]
            got += batch
            if not batch:
                time.sleep(0.01)
    return sorted(got, key=lambda r: int(r.id.rsplit(":", 1)[1]))


def wait_enqueued(redis_url: str, job: str, timeout: float = 120.0) -> None:
    from pipeline.coordinator.refill_state import RefillState

    st = RefillState.connect(redis_url, job)
    deadline = time.monotonic() + timeout
    while not st.counts().exhausted:
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job}: the producer did not read the source in {timeout}s")
        time.sleep(0.05)
    st.close()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r["spread"] for r in result["levels"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, label in ((axes[0], "requests_per_s", "requests/s"),
                           (axes[1], "tokens_per_s", "generated tokens/s")):
        s = [r["static"][key] for r in result["levels"]]
        f = [r["refill"][key] for r in result["levels"]]
        x = np.arange(len(levels))
        ax.bar(x - 0.2, s, 0.4, label="static batching")
        ax.bar(x + 0.2, f, 0.4, label="eviction + refill (service)")
        for i, r in enumerate(result["levels"]):
            ax.text(x[i] + 0.2, f[i], f"{r['speedup_requests']:.2f}x", ha="center",
                    va="bottom", fontsize=8)
        ax.set_xticks(x, [f"spread {v:g}" for v in levels])
        ax.set_ylabel(label)
        ax.set_title(label)
    ax = axes[2]  # the load-independent view: positions computed per request
    x = np.arange(len(levels))
    ax.bar(x - 0.2, [r["static"]["work_tokens_per_request"] for r in result["levels"]], 0.4)
    ax.bar(x + 0.2, [r["refill"]["work_tokens_per_request"] for r in result["levels"]], 0.4)
    for i, r in enumerate(result["levels"]):
        ax.text(x[i] + 0.2, r["refill"]["work_tokens_per_request"], f"/{r['work_ratio']:.2f}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"spread {v:g}" for v in levels])
    ax.set_title("positions computed per request (lower is better)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"tiny masked-diffusion LM, capacity {result['capacity_tokens']} tokens, "
                 f"{result['requests']} requests (CPU)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a result file")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--capacity", type=int, default=4096, help="consumer capacity in tokens")
    ap.add_argument("--train-seconds", type=float)
    ap.add_argument("--spreads", help="threshold spreads (heterogeneity); default 0,0.5,1 "
                    "(--quick: 0,1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name")
    add_out_argument(ap, "refill")
    args = ap.parse_args()
    if args.replot:
        src = Path(args.replot)
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
        return 0
    n = args.requests or (8 if args.quick else 64)
    train_s = args.train_seconds if args.train_seconds is not None else (20 if args.quick else 120)
    spreads = [float(x) for x in (args.spreads or ("0,1" if args.quick else "0,0.5,1")).split(",")]
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    from pipeline.config import ServiceConfig
    from pipeline.redis_server import LocalRedis
    from pipeline.service.server import start_service

    tmp = Path(tempfile.mkdtemp(prefix="odb-refill-bench-"))
    records = data.text_records()
    t0 = time.monotonic()
    samples = data.processed(data.write_jsonl(tmp / "train.jsonl", records))
    pairs = data.training_pairs(samples)
    vocab = Vocab.fit((np.concatenate(p) for p in pairs), size=1024)
    local = [(vocab.encode(p), vocab.encode(r)) for p, r in pairs]
    cfg = ModelConfig(vocab_size=len(vocab))
    model = MaskedDiffusionLM(cfg)
    print(f"model: {model.num_params():,} params; training {train_s:g}s on {len(local)} "
          f"(prompt, answer) pairs ...", flush=True)
    training = train(model, local, train_s, seed=args.seed)
    print(f"  loss {training['first_loss']:.2f} -> {training['final_loss']:.2f} in "
          f"{training['steps']} steps", flush=True)

    src = data.write_jsonl(tmp / "requests.jsonl", data.request_records(records, n, args.seed))
    jobs = [{"job_id": "pool", "mode": "refill", "source": {"paths": [str(src)]},
             "refill": {"generation_tokens_field": "max_new_tokens", "queue_depth": n + 1,
                        "max_request_tokens": args.capacity, "over_budget": "truncate"}}]
    jobs += [{**jobs[0], "job_id": f"refill-{i}"} for i in range(len(spreads))]
    redis = LocalRedis().start()
    svc = start_service(ServiceConfig.model_validate({
        "grpc": {"port": 0}, "metrics_port": None, "redis_url": redis.url, "jobs": jobs}))
    levels = []
    try:
        for j in jobs:
            wait_enqueued(redis.url, j["job_id"])
        requests = fetch_all(svc.address, "pool")
        n = len(requests)  # (a chat the template cannot render is quarantined)

        for i, spread in enumerate(spreads):
            def begin(r, spread=spread):
                return start(r.id, vocab.encode(r.input_ids), r.generation_tokens, r.cost,
                             spread, cfg.max_prompt)

            # Warm-up (first calls of each shape are slower): a few steps, not timed.
            static_batches(model, requests[:2], args.capacity, begin)
            st = static_batches(model, requests, args.capacity, begin)
            rf = refill_through_service(model, svc.address, f"refill-{i}", args.capacity, begin)
            same = sum(st.outputs[k] == rf.outputs.get(k) for k in st.outputs)
            lvl = {"spread": spread, "static": st.summary(), "refill": rf.summary(),
                   "speedup_requests": rf.summary()["requests_per_s"] /
                   st.summary()["requests_per_s"],
                   "speedup_tokens": rf.summary()["tokens_per_s"] /
                   st.summary()["tokens_per_s"],
                   # The same ratio in positions computed: what an accelerator's time follows,
                   # free of this shared CPU's load.
                   "work_ratio": st.work_tokens / max(1, rf.work_tokens),
                   "outputs_equal": same, "outputs_total": len(st.outputs)}
            levels.append(lvl)
            print(f"spread {spread:g}: static {st.summary()['requests_per_s']:.2f} req/s "
                  f"{st.summary()['tokens_per_s']:.0f} tok/s | refill "
                  f"{rf.summary()['requests_per_s']:.2f} req/s "
                  f"{rf.summary()['tokens_per_s']:.0f} tok/s | x{lvl['speedup_requests']:.2f}"
                  f" (work x{lvl['work_ratio']:.2f}, steps/block "
                  f"{rf.summary()['steps_per_block']:.1f}) | outputs equal "
                  f"{same}/{len(st.outputs)}", flush=True)
    finally:
        svc.stop(grace=0.5)
        redis.cleanup()
    result = {
        "benchmark": "refill vs static batching, tiny masked-diffusion LM",
        "command": "python bench/refill_bench.py" + " ".join(
            [""] + [a for a in sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "loadavg_at_end": os.getloadavg()},
        "requests": n, "capacity_tokens": args.capacity, "seed": args.seed,
        "generation_lengths": list(data.GEN_LENGTHS), "block": 32,
        "training": training, "wall_seconds": time.monotonic() - t0, "levels": levels,
    }
    out_path = out_dir(args, "refill")
    name = args.name or ("quick" if args.quick else "full")
    (out_path / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out_path / f"{name}.png")
    print(f"wrote {out_path / name}.json and .png", flush=True)
    return 0 if all(r["outputs_equal"] == r["outputs_total"] for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
