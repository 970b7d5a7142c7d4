"""SDO benchmark: what structure-aware organization buys and costs, side by side on real chats.

Data: the shipped chats (pipeline/sample_data: Python/numpy documentation and image captions)
plus short English dialogs by topic from `chatterbot-corpus` (trivia, food, science, ...), 10%
held out for evaluation. Real preprocessing (Qwen tokenizer and template, via Ray), real
embeddings (the packaged all-MiniLM-L6-v2, computed by the Ray stage, cached), a tiny real model
built from a config (`pipeline.demo.tiny_model.TinyCausalLM`, a 2-layer Qwen2), AdamW, CPU.

Arms, each trained from the same initial weights under the same token budget (padded cost):
- random: a shuffled order cut greedily under the budget (what a plain loader does);
- odb:    a shuffled order through the ODB planner (job window);
- sdo:    ODB+SDO: each epoch's visits (KNN traversal, exposure ledger, coverage floor) through
          the same planner with the window the `locality` knob gives (--locality, default 1).

Measured: held-out loss vs steps; within-batch gradient coherence (mean pairwise cosine of
per-sample gradients inside a batch, at the initial weights and after training); within-batch
embedding locality; the exposure histogram after the epochs; padding efficiency and locality
over a sweep of `locality` (the padding price of locality).

Run:  .venv/bin/python bench/sdo_bench.py [--quick] [--exposure-epochs N]
Writes sdo_bench{,_quick}.json and .png, and the exposure histograms (after
the trained epochs and after N planned epochs, default 20) to sdo_exposure{,_quick}.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from results_dir import add_out_argument, out_dir  # noqa: E402


def log(msg: str) -> None:
    print(f"[sdo-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- data ------------------------------------------------------------------------------------

def chatterbot_chats(per_topic: int | None, seed: int) -> list[dict]:
    """Dialogs of chatterbot-corpus (English) as OpenAI-style chats, `per_topic` per category."""
    import yaml

    folder = Path(importlib.util.find_spec("chatterbot_corpus").submodule_search_locations[0])
    rng = random.Random(seed)
    out = []
    for f in sorted((folder / "data" / "english").glob("*.yml")):
        convs = [c for c in (yaml.safe_load(f.read_text()).get("conversations") or [])
                 if isinstance(c, list) and len(c) >= 2 and all(isinstance(t, str) for t in c)]
        rng.shuffle(convs)
        for c in convs[:per_topic]:
            turns = c[: len(c) - len(c) % 2]
            out.append({"messages": [{"role": "user" if i % 2 == 0 else "assistant",
                                      "content": t} for i, t in enumerate(turns)]})
    return out


def write_data(folder: Path, quick: bool, seed: int) -> tuple[Path, Path]:
    from pipeline.sample_data import IMAGES_DIR, SAMPLE_CHATS

    lines = [ln for ln in SAMPLE_CHATS.read_bytes().split(b"\n") if ln.strip()]
    lines += [json.dumps(c).encode() for c in chatterbot_chats(25 if quick else None, seed)]
    random.Random(seed).shuffle(lines)
    cut = len(lines) // 10
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").symlink_to(IMAGES_DIR)
    train, held = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_bytes(b"\n".join(lines[cut:]) + b"\n")
    held.write_bytes(b"\n".join(lines[:cut]) + b"\n")
    return train, held


def job_for(path: Path, args) -> object:
    from pipeline.config import TrainingJobConfig

    return TrainingJobConfig.model_validate({
        "job_id": "sdo-bench", "world_size": 1, "seed": args.seed, "source": {"paths": [str(path)]},
        "preprocess": {"max_seq_len": args.max_seq_len},
        "batching": {"token_budget": args.token_budget},
        "organization": {"kind": "sdo", "knn_k": args.knn_k, "locality": args.locality,
                         "coverage_epochs": args.coverage_epochs,
                         "embedding": {"cache_dir": str(path.parent / "emb")}},
    })


def preprocess(job) -> list:
    from pipeline.preprocess.pipeline import iter_samples
    from pipeline.preprocess.sample import ProcessedSample

    return [s for s in iter_samples(job, 0) if isinstance(s, ProcessedSample)]


# -- arms: batches per epoch -------------------------------------------------------------------

def greedy_batches(order: list, budget: int) -> list[list]:
    out, cur, width = [], [], 0
    for m in order:
        w = max(width, m.num_tokens)
        if cur and (len(cur) + 1) * w > budget:
            out.append(cur)
            cur, w = [], m.num_tokens
        cur.append(m)
        width = w
    return out + ([cur] if cur else [])


def planner_batches(policy, samples: list) -> list[list]:
    from pipeline.planner.step_planner import StepPlanner
    from pipeline.planner.types import Step

    p = StepPlanner(policy, 1, "join", 0)
    events = p.feed_many(samples) + p.end_epoch(last_epoch=True)
    return [list(b.samples) for ev in events if isinstance(ev, Step) for b in ev.batches]


def plan_arms(measured: list, org, policy, args) -> tuple[dict, object]:
    """{arm: [[batches of sample ids] per epoch]} and the SDO ledger after the epochs."""
    from pipeline.organization.epoch_visits import plan_epoch_visits, split_visit_id
    from pipeline.organization.exposure_ledger import ExposureLedger

    by_id = {m.sample_id: m for m in measured}
    sdo_policy = dataclasses.replace(policy, lookahead_tokens=org.lookahead_tokens)
    ledger = ExposureLedger.initial(org.graph.digest, org.graph.size)
    arms: dict[str, list] = {"random": [], "odb": [], "sdo": []}
    for e in range(args.epochs):
        order = list(measured)
        random.Random(f"bench:{args.seed}:{e}").shuffle(order)
        arms["random"].append([[m.sample_id for m in b]
                               for b in greedy_batches(order, args.token_budget)])
        arms["odb"].append([[m.sample_id for m in b] for b in planner_batches(policy, order)])
        visits, ledger = plan_epoch_visits(org.graph, ledger, e, seed=args.seed,
                                           coverage_epochs=args.coverage_epochs,
                                           repeat_gap=org.repeat_gap)
        batches = planner_batches(sdo_policy, visits.planner_samples(by_id))
        arms["sdo"].append([[split_visit_id(m.sample_id)[0] for m in b] for b in batches])
    return arms, ledger


# -- training ----------------------------------------------------------------------------------

def tensors(samples: list) -> dict:
    import torch

    from pipeline.service.collate import Piece, collate

    return {k: torch.from_numpy(v) for k, v in collate([Piece(s) for s in samples],
                                                        "padded").items()}


def eval_loss(model, held: list) -> float:
    import torch

    tot = n = 0.0
    with torch.no_grad():
        for i in range(0, len(held), 8):
            loss, k = model(**tensors(held[i:i + 8]))
            tot += float(loss) * k
            n += k
    return tot / max(n, 1)


def flat_grad(model, sample) -> np.ndarray:
    import torch

    model.zero_grad(set_to_none=True)
    loss, _ = model(**tensors([sample]))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()
                      if p.grad is not None]).numpy().copy()


def grad_coherence(model, batches: list[list], samples: dict, n_batches: int,
                   per_batch: int) -> float | None:
    """Mean over batches of the mean pairwise cosine of per-sample gradients in the batch."""
    eligible = [list(dict.fromkeys(b)) for b in batches]
    eligible = [b for b in eligible if len(b) >= 2]
    if not eligible:
        return None
    picks = np.linspace(0, len(eligible) - 1, min(n_batches, len(eligible))).round().astype(int)
    vals = []
    for i in sorted(set(picks.tolist())):
        g = np.stack([flat_grad(model, samples[s]) for s in eligible[i][:per_batch]])
        g /= np.linalg.norm(g, axis=1, keepdims=True) + 1e-12
        s = g.sum(axis=0)
        vals.append(float((s @ s - len(g)) / (len(g) * (len(g) - 1))))
    model.zero_grad(set_to_none=True)
    return float(np.mean(vals))


def train_arm(name: str, epochs: list[list[list]], samples: dict, held: list, args) -> dict:
    import torch

    from pipeline.demo.tiny_model import TinyCausalLM

    torch.manual_seed(0)
    model = TinyCausalLM(vocab_buckets=args.vocab_buckets, hidden=args.hidden, seed=0)
    coh_init = grad_coherence(model, epochs[0], samples, args.grad_batches, args.grad_per_batch)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    curve = [[0, eval_loss(model, held)]]
    train = []
    step = 0
    t0 = time.perf_counter()
    for e, batches in enumerate(epochs):
        for b in batches:
            loss, _ = model(**tensors([samples[s] for s in b]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            train.append(round(loss.item(), 5))
            if step % args.eval_every == 0:
                curve.append([step, eval_loss(model, held)])
        log(f"  {name}: epoch {e} done, step {step}, held-out loss {eval_loss(model, held):.4f}"
            f" ({time.perf_counter() - t0:.0f} s)")
    if curve[-1][0] != step:
        curve.append([step, eval_loss(model, held)])
    coh_end = grad_coherence(model, epochs[-1], samples, args.grad_batches, args.grad_per_batch)
    return {"steps": step, "eval_curve": curve, "train_loss": train,
            "final_eval_loss": curve[-1][1], "grad_coherence_init": coh_init,
            "grad_coherence_end": coh_end, "train_seconds": round(time.perf_counter() - t0, 1)}


# -- plan-only figures ----------------------------------------------------------------------------

def plan_stats(batches: list[list], samples: dict, table) -> dict:
    from pipeline.organization.locality import batch_locality, batches_with_repeats

    real = padded = 0
    for b in batches:
        lens = [samples[s].num_tokens for s in b]
        real += sum(lens)
        padded += len(lens) * max(lens)
    return {"batches": len(batches), "padding_efficiency": round(real / padded, 6),
            "within_batch_cosine": round(batch_locality(batches, table.vector), 6),
            "batches_with_repeats": batches_with_repeats(batches)}


def locality_sweep(measured: list, org, policy, table, samples: dict, args) -> list[dict]:
    from pipeline.organization.epoch_visits import plan_epoch_visits, split_visit_id
    from pipeline.organization.exposure_ledger import ExposureLedger
    from pipeline.organization.locality import planner_lookahead, repeat_gap

    by_id = {m.sample_id: m for m in measured}
    mean = float(np.mean([m.num_tokens for m in measured]))
    out = []
    for loc in (0.0, 0.25, 0.5, 0.75, 1.0):
        window = planner_lookahead(loc, policy.lookahead_tokens, args.token_budget)
        visits, _ = plan_epoch_visits(org.graph, ExposureLedger.initial(org.graph.digest,
                                                                        org.graph.size),
                                      0, seed=args.seed, coverage_epochs=args.coverage_epochs,
                                      repeat_gap=repeat_gap(window, mean))
        batches = planner_batches(dataclasses.replace(policy, lookahead_tokens=window),
                                  visits.planner_samples(by_id))
        ids = [[split_visit_id(m.sample_id)[0] for m in b] for b in batches]
        out.append({"locality": loc, "window": window, **plan_stats(ids, samples, table)})
    return out


def long_exposure(org, args) -> object:
    """The SDO ledger after `args.exposure_epochs` epochs of visits (plans only, no training)."""
    from pipeline.organization.epoch_visits import plan_epoch_visits
    from pipeline.organization.exposure_ledger import ExposureLedger

    ledger = ExposureLedger.initial(org.graph.digest, org.graph.size)
    for e in range(args.exposure_epochs):
        _, ledger = plan_epoch_visits(org.graph, ledger, e, seed=args.seed,
                                      coverage_epochs=args.coverage_epochs,
                                      repeat_gap=org.repeat_gap)
    return ledger


# -- report ----------------------------------------------------------------------------------------

def plot_exposure(res: dict, path: Path) -> None:
    """The exposure histograms alone: after the trained epochs and after the long plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    for a, key, epochs in ((ax[0], "exposure", res["epochs"]),
                           (ax[1], "exposure_long", res["exposure_long"]["epochs"])):
        exp = np.array(res[key]["sdo_per_sample"])
        bins = np.arange(exp.min(), exp.max() + 2) - 0.5
        a.hist(exp, bins=bins, color="tab:red", label="sdo (ledger + coverage floor)")
        a.axvline(epochs, color="tab:blue", ls="--", label=f"random / odb: {epochs}x each")
        r = res[key]
        a.set(title=f"after {epochs} epochs: min {r['min']}, p50 {r['p50']}, max {r['max']}; "
                    f"longest unseen {r['max_epochs_unseen']}",
              xlabel="visits per sample", ylabel="samples (log scale)", yscale="log")
        a.title.set_fontsize(9)
        a.legend(fontsize=8)
    fig.suptitle(f"SDO exposure per sample ({res['graph']['nodes']} samples, k="
                 f"{res['graph']['k']}, coverage_epochs {res['settings']['coverage_epochs']}, "
                 f"max in-degree {res['graph']['max_in_degree']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    colors = {"random": "tab:gray", "odb": "tab:blue", "sdo": "tab:red"}
    for arm, r in res["training"].items():
        c = np.array(r["eval_curve"])
        ax[0, 0].plot(c[:, 0], c[:, 1], marker=".", label=f"{arm} ({r['steps']} steps)",
                      color=colors[arm])
    ax[0, 0].set(title="held-out loss vs steps", xlabel="step", ylabel="loss (token mean)")
    ax[0, 0].legend()
    arms = list(res["training"])
    x = np.arange(len(arms))
    for off, key, lab in ((-0.2, "grad_coherence_init", "initial weights"),
                          (0.2, "grad_coherence_end", "after training")):
        ax[0, 1].bar(x + off, [res["training"][a][key] or 0 for a in arms], 0.4, label=lab)
    ax[0, 1].set_xticks(x, [f"{a}\nemb. cosine {res['plans'][a]['within_batch_cosine']:.3f}"
                            for a in arms])
    ax[0, 1].set(title="within-batch gradient coherence (mean pairwise cosine)")
    ax[0, 1].legend()
    exp = np.array(res["exposure"]["sdo_per_sample"])
    bins = np.arange(exp.min(), exp.max() + 2) - 0.5
    ax[1, 0].hist(exp, bins=bins, color="tab:red", label="sdo")
    ax[1, 0].axvline(res["epochs"], color="tab:blue", ls="--",
                     label=f"random / odb: every sample {res['epochs']}x")
    ax[1, 0].set(title=f"exposure after {res['epochs']} epochs (sdo ledger)",
                 xlabel="visits per sample", ylabel="samples")
    ax[1, 0].legend()
    sw = res["locality_sweep"]
    ax[1, 1].plot([s["locality"] for s in sw], [s["padding_efficiency"] for s in sw], "o-",
                  color="tab:red", label="padding efficiency (sdo)")
    ax2 = ax[1, 1].twinx()
    ax2.plot([s["locality"] for s in sw], [s["within_batch_cosine"] for s in sw], "s--",
             color="tab:green", label="within-batch cosine (sdo)")
    for arm, ls in (("odb", ":"), ("random", "-.")):
        ax[1, 1].axhline(res["plans"][arm]["padding_efficiency"], color=colors[arm], ls=ls,
                         label=f"padding {arm}")
        ax2.axhline(res["plans"][arm]["within_batch_cosine"], color="tab:green", ls=ls, alpha=0.6,
                    label=f"cosine {arm}")
    ax[1, 1].set(title="the padding price of locality (epoch 0)", xlabel="locality knob",
                 ylabel="padding efficiency")
    ax2.set_ylabel("within-batch cosine")
    h1, l1 = ax[1, 1].get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax[1, 1].legend(h1 + h2, l1 + l2, fontsize=7, loc="lower left")
    fig.suptitle(f"SDO bench{' (quick)' if res['quick'] else ''}: {res['data']['train_samples']}"
                 f" train chats, budget {res['token_budget']}, CPU, load {res['load_avg']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="~700 chats, 2 epochs, smaller model figures (a few minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exposure-epochs", type=int, default=20,
                    help="epochs of visits planned (no training) for the long exposure histogram")
    ap.add_argument("--locality", type=float, default=1.0,
                    help="the sdo arm's knob (default 1: with the job's 128-budget window a "
                    "small dataset fits one window, and locality <= 0.5 plans exactly like odb)")
    add_out_argument(ap, "sdo")
    args = ap.parse_args()
    q = args.quick
    args.epochs = 2 if q else 4
    args.token_budget = 4096
    args.max_seq_len = 1024
    args.knn_k = 16
    args.coverage_epochs = 2
    args.vocab_buckets = 4096
    args.hidden = 64
    args.lr = 3e-3
    args.eval_every = 5 if q else 10
    args.grad_batches = 6 if q else 16
    args.grad_per_batch = 6 if q else 12

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)
    from pipeline.organization.embed_stage import embed_dataset
    from pipeline.organization.organizer import organize
    from pipeline.ray_runtime import PrivateRay

    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="odb-sdo-bench-"))
    train_path, held_path = write_data(work / "data", q, args.seed)
    job = job_for(train_path, args)
    with PrivateRay(prefix="odb-sdo-bench-ray-"):
        log("preprocessing (real tokenizer and template)")
        train = preprocess(job)
        held = preprocess(job.model_copy(update={"source": job.source.model_copy(
            update={"paths": [str(held_path)]})}))
        log(f"{len(train)} train / {len(held)} held-out samples; embedding (Ray stage)")
        t = time.perf_counter()
        emb = embed_dataset(job)
        embed_s = time.perf_counter() - t
    samples = {s.sample_id: s for s in train}
    measured = [s.measured() for s in train]
    org = organize(job, emb.table, measured, emb.path)
    policy = job.batching.policy()
    log(f"graph {org.graph.size} nodes, max in-degree {int(org.graph.in_degree.max())}; "
        f"sdo window {org.lookahead_tokens} tokens (job: {policy.lookahead_tokens})")
    arms, ledger = plan_arms(measured, org, policy, args)
    plans = {a: plan_stats([b for ep in eps for b in ep], samples, emb.table)
             for a, eps in arms.items()}
    sweep = locality_sweep(measured, org, policy, emb.table, samples, args)
    training = {}
    for arm in ("random", "odb", "sdo"):
        log(f"training {arm}: {sum(len(e) for e in arms[arm])} steps over {args.epochs} epochs")
        training[arm] = train_arm(arm, arms[arm], samples, held, args)
    exposure = ledger.summary()
    long_ledger = long_exposure(org, args)
    res = {
        "quick": q, "epochs": args.epochs, "token_budget": args.token_budget,
        "settings": {k: getattr(args, k) for k in ("max_seq_len", "knn_k",
                                                   "locality", "coverage_epochs", "hidden",
                                                   "vocab_buckets", "lr", "seed")},
        "data": {"train_samples": len(train), "held_out_samples": len(held),
                 "sources": ["pipeline/sample_data/chats.jsonl", "chatterbot-corpus english"],
                 "train_tokens": int(sum(m.num_tokens for m in measured))},
        "embedding": {"made_by": emb.table.made_by, "dim": emb.table.dim,
                      "seconds": round(embed_s, 1), "cached": emb.cached},
        "graph": {"nodes": org.graph.size, "k": org.graph.k,
                  "max_in_degree": int(org.graph.in_degree.max()),
                  "sdo_lookahead_tokens": org.lookahead_tokens, "repeat_gap": org.repeat_gap,
                  "job_lookahead_tokens": policy.lookahead_tokens},
        "plans": plans,
        "locality_sweep": sweep,
        "exposure": {**exposure, "sdo_per_sample": ledger.exposure.tolist()},
        "exposure_long": {**long_ledger.summary(),
                          "sdo_per_sample": long_ledger.exposure.tolist()},
        "training": training,
        "load_avg": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "wall_seconds": round(time.perf_counter() - t_all, 1),
        "note": "measured on a shared, loaded 2-core machine: compare arms within this run only",
    }
    stem = "sdo_bench_quick" if q else "sdo_bench"
    out_path = out_dir(args, "sdo")
    (out_path / f"{stem}.json").write_text(json.dumps(res, indent=1))
    plot(res, out_path / f"{stem}.png")
    plot_exposure(res, out_path / f"{stem.replace('bench', 'exposure')}.png")
    print("\n| arm | steps | final held-out loss | grad coherence init / end | emb. cosine "
          "| pad eff |")
    print("|---|---|---|---|---|---|")
    for arm, r in training.items():
        p = plans[arm]
        print(f"| {arm} | {r['steps']} | {r['final_eval_loss']:.4f} | "
              f"{r['grad_coherence_init']:.4f} / {r['grad_coherence_end']:.4f} | "
              f"{p['within_batch_cosine']:.4f} | {p['padding_efficiency']:.4f} |")
    print(f"exposure after {args.epochs} epochs (sdo): {exposure}")
    print(f"exposure after {args.exposure_epochs} planned epochs (sdo): "
          f"{long_ledger.summary()}")
    print(f"\nwrote {out_path / (stem + '.json')}, .png and "
          f"{stem.replace('bench', 'exposure')}.png ({res['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
