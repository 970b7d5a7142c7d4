"""Ranks balanced by tokens vs by fitted compute time (docs/compute-balancing.md), measured.

    python bench/compute_balance_bench.py            # full run (an idle machine)
    python bench/compute_balance_bench.py --quick    # a small run that proves it works

A served job (in this process, in-memory state, loopback gRPC) feeds W rank processes on CPU.
Each rank trains a tiny Qwen2-style LM plus a small vision tower (an MLP over the embeddings of
image positions, so an image costs per patch on top of its tokens) on a text+image mix, times
forward + backward with `stream.timed(batch)` (the report rides on its next ack), then
all-reduces its gradients by hand (gloo) and times that wait apart. Two arms over the same
samples: `tokens` (compute balancing off) and `calibrated` (on: the gate opens once the fit
predicts held-out batches within 10%). Per step: max/mean of the ranks' measured compute (p50,
p90, over the steps after the gate opened for `calibrated`), the exposed wait (max minus own,
mean over ranks), steps/s; where the gate opened. JSON and a PNG go to --out (the committed
ones: bench/results/compute/).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from results_dir import add_out_argument, out_dir  # noqa: E402

VOCAB = 512
IMAGE = 1  # the token id that marks an image patch position (its visual tokens)


def make_samples(n: int, seed: int, image_share: float, patches: int, max_len: int) -> list:
    """Chat-like text (log-normal lengths) and, in `image_share` of the samples, one image of
    `patches` visual tokens at the front."""
    from pipeline.preprocess.sample import IGNORE_INDEX, ProcessedSample

    rng = np.random.default_rng(seed)
    out = []
    for row in range(n):
        text = int(min(max_len, max(8, rng.lognormal(5.0, 0.7))))
        vis = patches if rng.random() < image_share else 0
        ids = rng.integers(2, VOCAB, size=text + vis, dtype=np.int32)
        ids[:vis] = IMAGE
        labels = ids.copy()
        labels[: vis + text // 3] = IGNORE_INDEX
        out.append(ProcessedSample(f"mix:{row}", "mix", row, ids, labels,
                                   num_visual_tokens=vis, cost=text + vis))
    return out


def rank_main(rank: int, world: int, address: str, port: int, out: str, dim: int) -> None:
    """One trainer rank: forward + backward timed and reported; the all-reduce timed apart."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer_client import BatchStream

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True))
    vision = torch.nn.Sequential(*[m for _ in range(3) for m in (
        torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))])
    params = list(lm.parameters()) + list(vision.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    rows = []
    with BatchStream(address, "bench", rank, world) as stream:
        while not stream.done:
            for batch in stream:
                start = time.perf_counter()
                ids = torch.as_tensor(batch["input_ids"]).long()
                labels = torch.as_tensor(batch["labels"]).long()
                mask = torch.as_tensor(batch["attention_mask"]).long()
                emb = lm.get_input_embeddings()(ids)
                image = ids == IMAGE
                if image.any():  # the vision tower runs on image positions only
                    patches = emb[image]
                    emb = emb.index_put(image.nonzero(as_tuple=True), patches + vision(patches))
                logits = lm(inputs_embeds=emb, attention_mask=mask).logits
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1),
                    ignore_index=-100)
                loss.backward()
                compute = time.perf_counter() - start
                stream.report_compute(batch, compute)  # rides on the next ack
                t0 = time.perf_counter()
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                  .reshape(-1) for p in params])
                dist.all_reduce(flat)
                wait = time.perf_counter() - t0
                opt.step()
                opt.zero_grad(set_to_none=True)
                rows.append({"step": batch.info.step, "compute": compute, "wait": wait,
                             "t": time.time()})
    dist.destroy_process_group()
    Path(out).write_text("\n".join(json.dumps(r) for r in rows))


def run_arm(arm: str, args: argparse.Namespace, samples: list, tmp: Path) -> dict:
    from pipeline.config import ServiceConfig
    from pipeline.preprocess.array_source import ArraySource
    from pipeline.redis_server import free_port
    from pipeline.service.server import start_service

    job = {"job_id": "bench", "world_size": args.world, "mode": "quota",
           "source": {"paths": ["arrays"]},
           "batching": {"token_budget": args.budget, "pool_steps": args.pool_steps,
                        "compute_balancing": {
               "enabled": arm == "calibrated", "min_reports": args.min_reports}}}
    cfg = ServiceConfig.model_validate({"grpc": {"port": 0}, "metrics_port": None,
                                        "jobs": [job]})
    svc = start_service(cfg, sample_sources={"bench": ArraySource(samples)})
    ctx = mp.get_context("spawn")
    port = free_port()
    outs = [tmp / f"{arm}-rank{r}.jsonl" for r in range(args.world)]
    t0 = time.perf_counter()
    try:
        procs = [ctx.Process(target=rank_main, args=(r, args.world, svc.address, port,
                                                      str(outs[r]), args.dim))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.timeout)
            if p.exitcode != 0:
                raise RuntimeError(f"{arm}: a rank failed (exit {p.exitcode})")
        wall = time.perf_counter() - t0
        state = svc.runtimes["bench"].state
        steps = [state.get_step(n) for n in range(state.published_through() + 1)]
        fit = state.compute_fit()
    finally:
        svc.stop(grace=0.5)
    gate_step = next((s.step for s in steps if s is not None and s.compute is not None), None)
    by_step: dict[int, list[dict]] = {}
    for path in outs:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], []).append(row)
    full = {n: rows for n, rows in by_step.items() if len(rows) == args.world}
    counted = [n for n in full if gate_step is None or arm == "tokens" or n >= gate_step]
    ratios, exposed = [], []
    for n in counted:
        c = [r["compute"] for r in full[n]]
        ratios.append(max(c) / mean(c))
        exposed.append(mean(max(c) - x for x in c))
    ratios.sort()
    return {
        "arm": arm, "steps": len(full), "steps_counted": len(counted), "wall_s": wall,
        "steps_per_s": len(full) / wall,
        "imbalance_p50": median(ratios) if ratios else None,
        "imbalance_p90": ratios[int(0.9 * len(ratios))] if ratios else None,
        "exposed_wait_s_mean": mean(exposed) if exposed else None,
        "compute_s_mean": mean(r["compute"] for rows in full.values() for r in rows),
        "gate_opened_at_step": gate_step,
        "fit": None if fit is None else {
            "gate_open": fit.gate_open, "error": fit.error, "reports": fit.reports,
            "last_error": fit.last_error, "accepted": fit.accepted, "rejected": fit.rejected,
            "coefficients": list(fit.coefficients)},
        "ratios": ratios,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if r["ratios"]:
            ys = np.arange(1, len(r["ratios"]) + 1) / len(r["ratios"])
            ax.plot(r["ratios"], ys, label=f"{r['arm']} (p50 {r['imbalance_p50']:.3f})")
    ax.set_xlabel("per-step max/mean measured rank compute")
    ax.set_ylabel("fraction of steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _shown(v: object) -> object:
    """A path as the command line gave it (relative to the repository when it is inside)."""
    if isinstance(v, Path):
        return str(v.relative_to(ROOT)) if v.is_relative_to(ROOT) else str(v)
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run that proves it works")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--image-share", type=float, default=0.25)
    ap.add_argument("--patches", type=int, default=256)
    ap.add_argument("--min-reports", type=int, default=32)
    ap.add_argument("--pool-steps", type=int, default=None,
                    help="the planner's balancing pool in steps (default: ~256 batches); a "
                    "model applies from the next pool released after the gate opens")
    ap.add_argument("--timeout", type=float, default=3600)
    add_out_argument(ap, "compute")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.budget, args.dim, args.pool_steps = 1200, 2048, 32, 4
    samples = make_samples(args.samples, 0, args.image_share, args.patches, 1024)
    args.out = out_dir(args, "compute")
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_arm(arm, args, samples, Path(tmp)) for arm in ("tokens", "calibrated")]
    name = "quick" if args.quick else "full"
    report = {"args": {k: _shown(v) for k, v in vars(args).items()},
              "load_avg": os.getloadavg(), "cpus": os.cpu_count(),
              "results": [{k: v for k, v in r.items() if k != "ratios"} for r in results]}
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / f"{name}.png")
    for r in report["results"]:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
