"""End-to-end benchmark: what a trainer really consumes, against the anchors (issue #9).

Side by side in one run, on this machine's CPU, the same tiny real transformer (Qwen2
architecture from a config: 2 layers, hidden 128, the Qwen tokenizer's ids folded onto 4096
buckets) doing forward + backward + AdamW with one torch thread:

1. throughput: emitted samples/s and real tokens/s of training, one epoch per contender —
   Standard fixed batches (B = budget // p99), the public `online-dynamic-batching` 0.1.2
   DataLoader (its single-process path), odb-pipeline over gRPC (service in its own process,
   `BatchStream` on loopback) — on the three log-normal workloads of the planner issue
   (lengths and budget divided by --scale: same shapes, same samples per batch) and on the
   shipped chats (tokenized in-process by the pipeline's `Processor`); loss vs samples seen
   and a held-out eval loss per contender;
2. stall: fraction of rank wall time waiting for the next batch, 2 and 8 rank streams, with
   Ray preprocessing in the loop (RaySource) and without (ArraySource);
3. scaling: Ray preprocessing with 1 vs 2 workers; a simulated 256-rank job (no model) with
   the server's time split (planner / collate / encode / gRPC+rest), in-memory and Redis state;
4. alignment: gloo all_gather of per-rank token counts per step vs odb-pipeline's in-band
   step info (no collective);
5. order: the cost of the shuffled order (docs/data-order.md) with Ray preprocessing in the
   loop: samples/s and the first batch, shuffled vs file order, and the producer actor's peak
   memory with a source 10x larger (the shuffle's buffer is bounded, not a share of the data).

Run:  .venv/bin/python bench/e2e_bench.py [--quick] [--out bench/results/e2e] [--parts ...]
Writes e2e_bench{,_quick}.json and e2e_{throughput,loss,stall,scaling}{,_quick}.png.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from e2e import align, common, scaling, stall, throughput  # noqa: E402
from e2e.serve import ServiceProcess  # noqa: E402
from results_dir import add_out_argument, out_dir  # noqa: E402

from pipeline.planner.oracle import gmt_batches  # noqa: E402

PARTS = ("throughput", "stall", "scaling", "align", "order")
QUICK = {"scale": 16, "n_synth": 400, "n_real": 72, "real_budget": 8192, "buffer": 256,
         "reps": 1, "stall_s": 8.0, "stall_copies": 12, "speeds": [10], "ray_copies": 4,
         "ray_order": [1, 2], "sim_steps": 6, "sim_scale": 16, "sim_deadline_s": 20.0,
         "sim_states": [("memory", None, 256), ("redis", 1088, 256), ("redis", None, 32)],
         "align_worlds": [2], "align_iters": 300, "order_copies": 4, "order_s": 20.0,
         "order_reps": 1}
FULL = {"scale": 8, "n_synth": 1200, "n_real": None, "real_budget": 16384, "buffer": 1024,
        "reps": 3, "stall_s": 20.0, "stall_copies": 10, "speeds": [1, 10], "ray_copies": 10,
        "ray_order": [1, 2, 2, 1], "sim_steps": 12, "sim_scale": 8, "sim_deadline_s": 30.0,
        "sim_states": [("memory", None, 256), ("redis", None, 256), ("redis", 1088, 256),
                       ("redis", None, 32)],
        "align_worlds": [2, 4, 8], "align_iters": 1000, "order_copies": 10, "order_s": 45.0,
        "order_reps": 3}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def replicated_chats(copies: int, tmp: Path) -> str:
    """The shipped chats repeated `copies` times (a bigger real dataset for Ray to chew on)."""
    path = tmp / f"chats_x{copies}.jsonl"
    if not path.exists():
        raw = common.CHATS.read_bytes()  # bytes: the shipped file has deliberately bad records
        if not raw.endswith(b"\n"):
            raw += b"\n"
        path.write_bytes(raw * copies)
    return str(path)


# --- parts -------------------------------------------------------------------------------------


def part_throughput(cfg: dict, svc: ServiceProcess) -> dict:
    log("[1/5] training throughput (standard | peer odb 0.1.2 | ours over gRPC)")
    ws = common.build_workloads(cfg["n_synth"], cfg["scale"], cfg["n_real"], cfg["real_budget"])
    out = {}
    for i, w in enumerate(ws):
        # Rotate who goes first per workload (and reverse per round) to spread load drift.
        order = list(throughput.METHODS[i % 3:] + throughput.METHODS[: i % 3])
        log(f"  {w.name}: {len(w.train)} samples, budget {w.budget}, standard B="
            f"{w.standard_batch} (p99 {w.p99}), order {order}")
        runs = throughput.run_workload(w, svc, cfg["buffer"], cfg["reps"], order, log)
        out[w.name] = {"note": w.note, "budget": w.budget, "n": len(w.train),
                       "standard_batch": w.standard_batch, "p99": w.p99,
                       "mean_len": float(np.mean(w.lengths)),
                       "cv": float(np.std(w.lengths) / np.mean(w.lengths)),
                       "runs": runs, "summary": summarize_workload(runs),
                       "gmt_projection": gmt_projection([x.num_tokens for x in w.train],
                                                        w.budget, runs)}
    return out


def gmt_projection(lengths: list[int], budget: int, runs: dict) -> dict:
    """The GMT oracle's batches (`planner.oracle`) for these lengths, and the samples/s they would
    reach at ours' measured seconds per padded token (the tiny model's CPU step is linear in
    padded tokens)."""
    batches = gmt_batches(lengths, budget)
    padded = sum(b[0] * len(b) for b in batches)  # padded collate: the longest sample sets it
    steps = len(batches)
    ours = runs["ours"]
    per_token = _mean([r["wall_s"] / r["padded_tokens"] for r in ours])
    samples_per_s = len(lengths) / (per_token * padded)
    std = _mean([r["samples_per_s"] for r in runs["standard"]])
    return {"steps": steps, "padding_efficiency": sum(lengths) / padded,
            "seconds_per_padded_token": per_token, "samples_per_s": samples_per_s,
            "vs_standard": samples_per_s / std,
            "ours_vs_gmt": _mean([r["samples_per_s"] for r in ours]) / samples_per_s}


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else float("nan")


def summarize_workload(runs: dict) -> dict:
    """Per method: means over rounds; ratios are per round (same round = same load), averaged."""
    s: dict = {}
    for m, rs in runs.items():
        cpu = [r["trainer_cpu_s"] + r["loader_cpu_s"]
               + (r.get("server") or {}).get("process_cpu_s", 0.0) for r in rs]
        s[m] = {k: _mean([r[k] for r in rs]) for k in (
            "samples", "steps", "samples_per_s", "real_tokens_per_s", "padding_efficiency",
            "wait_fraction", "first_batch_s", "eval_loss", "steady_samples_per_s")}
        s[m]["cpu_s_per_1k_samples"] = _mean([c / r["samples"] * 1000
                                              for c, r in zip(cpu, rs, strict=True)])
        s[m]["step_wait_p50_us"] = _mean([r["step_wait_p50_us"] or 0.0 for r in rs])
    base = runs["standard"]
    for m, rs in runs.items():
        s[m]["vs_standard"] = _mean([r["samples_per_s"] / b["samples_per_s"]
                                     for r, b in zip(rs, base, strict=True)])
        s[m]["cpu_vs_standard"] = s["standard"]["cpu_s_per_1k_samples"] / \
            s[m]["cpu_s_per_1k_samples"]
    s["ours"]["vs_peer"] = _mean([r["samples_per_s"] / p["samples_per_s"]
                                  for r, p in zip(runs["ours"], runs["peer"], strict=True)])
    return s


def _log_stall(source: str, world: int, speed: float, r: dict) -> None:
    errors = f" errors {r['errors'][:1]}" if r["errors"] else ""
    log(f"    {source} W={world} {speed}x: stall {r['stall']:.1%} (steady "
        f"{r['steady_stall']:.1%}), first batch {r['first_batch_s']:.2f} s, "
        f"{r['samples_per_s']:.0f} samples/s{errors}")


def part_stall(cfg: dict, svc: ServiceProcess, tmp: Path, tok_s: float) -> list[dict]:
    log(f"[2/5] data stall (ranks simulate a device at {tok_s:,.0f} padded tokens/s = 1x)")
    out = []
    chats = common.tokenize_chats()
    arr = [s for _ in range(cfg["stall_copies"]) for s in chats]
    arr = [type(s)(f"{s.source}:{i}", s.source, i, s.input_ids, s.labels, cost=s.cost)
           for i, s in enumerate(arr)]
    budget, buf, dur = 4096, cfg["buffer"], cfg["stall_s"]

    def grid(source: str, label: str, **data) -> None:
        for world in (2, 8):
            for speed in cfg["speeds"]:
                r = stall.run_stall(svc, world, budget, buf, tok_s * speed, dur,
                                    label=f"{label}, device {speed}x", **data)
                r["source"], r["speed"] = source, speed
                out.append(r)
                _log_stall(source, world, speed, r)

    grid("array", "ArraySource", samples=arr)
    try:
        t0 = time.perf_counter()
        svc.call("ray_init", 2, timeout=300)
        log(f"    ray.init(num_cpus=2) in the service process: {time.perf_counter() - t0:.1f} s")
        path = replicated_chats(cfg["stall_copies"], tmp)
        t0 = time.perf_counter()
        svc.call("ray_warm", common.service_overrides(
            [common.job_config_dict("warm", 1, budget, buf, path)]), timeout=300)
        log(f"    Ray warm-up epoch (512 rows): {time.perf_counter() - t0:.1f} s")
        grid("ray", "RaySource", data_path=path)
    except Exception as exc:
        log(f"    Ray stall part failed: {exc}")
        out.append({"source": "ray", "error": str(exc)})
    return out


def part_scaling(cfg: dict, svc: ServiceProcess, tmp: Path) -> dict:
    log("[3/5] scaling")
    out: dict = {}
    path = replicated_chats(cfg["ray_copies"], tmp)
    out["ray"] = scaling.ray_workers(path, cfg["ray_order"], 256, log)
    # Simulated job: W ranks, cv0.48 workload at sim_scale, enough samples for ~sim_steps steps.
    from pipeline.preprocess.array_source import synthetic_samples

    s = cfg["sim_scale"]
    world = max(w for _, _, w in cfg["sim_states"])
    budget = common.FULL_BUDGET // s
    mean = 1400 / s
    per_batch = budget * 0.94 / mean
    n = int(world * per_batch * cfg["sim_steps"])
    lengths = common.lognormal_lengths(0.48, mean, n, 7, 16, 8192 // s)
    samples = synthetic_samples(n, seed=7, lengths=lengths.tolist(), vocab=151669)
    sims = []
    from pipeline.redis_server import LocalRedis

    for state, pool, w in cfg["sim_states"]:
        redis = None
        try:
            url = None
            if state == "redis":
                redis = LocalRedis().start()
                url = redis.url
            sims.append(scaling.many_ranks(svc, w, samples, budget, cfg["buffer"], 4, url,
                                           log, redis_max_connections=pool,
                                           deadline_s=cfg["sim_deadline_s"]))
        except Exception as exc:
            log(f"    W={w} {state} state failed: {type(exc).__name__}: {exc}")
            sims.append({"world_size": w, "state": state,
                         "error": f"{type(exc).__name__}: {exc}"})
            try:  # the service process may hold a half-started job
                svc.stop()
            except Exception as exc2:
                log(f"    (stop after failure: {exc2})")
        finally:
            if redis is not None:
                redis.stop()
    out["many_ranks"] = sims
    out["many_ranks_setup"] = {"budget": budget, "mean_len": mean, "samples": n,
                               "workload": f"log-normal CV 0.48 mean 1400/{s}"}
    return out


def part_order(cfg: dict, svc: ServiceProcess, tmp: Path, tok_s: float) -> dict:
    """Shuffled vs file order through Ray (W=2, a device 10x the tiny model: the data plane is
    the bottleneck), alternating per round; then the shuffled order on a source 10x larger:
    the producer's peak memory must not grow with the data."""
    log("[5/5] order: shuffled vs file order, and a source 10x larger")
    out: dict = {"rounds": [], "memory": []}
    try:
        svc.call("ray_init", 2, timeout=300)
    except Exception as exc:  # (already started by the stall part)
        if "already" not in str(exc).lower():
            log(f"    ray_init: {exc}")
    small = replicated_chats(cfg["order_copies"], tmp)
    big = replicated_chats(10 * cfg["order_copies"], tmp)
    svc.call("ray_warm", common.service_overrides(
        [common.job_config_dict("warm", 1, 4096, cfg["buffer"], small)]), timeout=300)
    for rep in range(cfg["order_reps"]):
        for shuffle in ((False, True) if rep % 2 == 0 else (True, False)):
            r = stall.run_stall(svc, 2, 4096, cfg["buffer"], tok_s * 10, cfg["order_s"],
                                data_path=small, shuffle=shuffle,
                                label=f"shuffle={shuffle}, round {rep}")
            r["shuffle"] = shuffle
            out["rounds"].append(r)
            _log_stall(f"shuffle={shuffle}", 2, 10, r)
    for path, label in ((small, "1x"), (big, "10x")):
        r = stall.run_stall(svc, 2, 4096, cfg["buffer"], tok_s * 10, cfg["order_s"],
                            data_path=path, label=f"source {label}")
        peak = (r.get("server") or {}).get("producer_peak_rss_mb") or {}
        out["memory"].append({"source": label, "producer_peak_rss_mb": max(
            (v for v in peak.values() if v is not None), default=None),
            "samples_per_s": r["samples_per_s"], "first_batch_s": r["first_batch_s"]})
        log(f"    source {label}: producer peak {out['memory'][-1]['producer_peak_rss_mb']} MB")

    def mean(shuffle: bool, key: str) -> float:
        return _mean([r[key] for r in out["rounds"] if r["shuffle"] == shuffle])

    out["summary"] = {
        "shuffled_vs_file_order_samples_per_s": mean(True, "samples_per_s")
        / mean(False, "samples_per_s"),
        "first_batch_s": {"shuffled": mean(True, "first_batch_s"),
                          "file_order": mean(False, "first_batch_s")},
        "producer_peak_rss_mb": {m["source"]: m["producer_peak_rss_mb"] for m in out["memory"]},
    }
    log(f"    {out['summary']}")
    return out


def part_align(cfg: dict, ours_wait_us: float | None) -> dict:
    log("[4/5] per-step alignment cost")
    ags = []
    for w in cfg["align_worlds"]:
        r = align.all_gather_cost(w, cfg["align_iters"])
        ags.append(r)
        log(f"    gloo all_gather W={w}: p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us")
    return {"all_gather": ags, "ours_collectives_per_step": 0,
            "ours_take_batch_p50_us": ours_wait_us}


# --- tables ------------------------------------------------------------------------------------


def f(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    return format(v, spec)


def throughput_tables(tp: dict) -> str:
    lines = ["| workload | method | samples | steps | pad eff | samples/s | real tok/s "
             "| vs standard | CPU s / 1k samples | first batch s | wait | eval loss |",
             "|" + "---|" * 12]
    for name, w in tp.items():
        for m in throughput.METHODS:
            r = w["summary"][m]
            lines.append(
                f"| {name} | {m} | {r['samples']:.0f} | {r['steps']:.0f} "
                f"| {r['padding_efficiency']:.3f} | {r['samples_per_s']:.1f} "
                f"| {r['real_tokens_per_s']:,.0f} | {r['vs_standard']:.2f}x "
                f"| {r['cpu_s_per_1k_samples']:.1f} | {r['first_batch_s']:.2f} "
                f"| {r['wait_fraction']:.1%} | {r['eval_loss']:.3f} |")
    lines += ["", "| workload | peer / standard | ours / standard | ours / peer "
              "| CPU-time gain peer | CPU-time gain ours | GMT projected / standard "
              "| ours / GMT projected | standard B |",
              "|" + "---|" * 9]
    for name, w in tp.items():
        s = w["summary"]
        g = w.get("gmt_projection")  # "GMT projected": at ours' seconds per padded token
        gmt = (f"{g['vs_standard']:.2f}x ({g['steps']} steps, pad eff "
               f"{g['padding_efficiency']:.3f}) | {g['ours_vs_gmt']:.2f}x") if g else "- | -"
        lines.append(f"| {name} | {s['peer']['vs_standard']:.2f}x | "
                     f"{s['ours']['vs_standard']:.2f}x | {s['ours']['vs_peer']:.2f}x | "
                     f"{s['peer']['cpu_vs_standard']:.2f}x | "
                     f"{s['ours']['cpu_vs_standard']:.2f}x | {gmt} | {w['standard_batch']} |")
    return "\n".join(lines)


def stall_table(st: list[dict]) -> str:
    lines = ["| source | W | device speed | stall (all) | stall (after 1st batch) "
             "| first batch s | steps/rank | samples/s |", "|" + "---|" * 8]
    for r in st:
        if "error" in r:
            lines.append(f"| {r['source']} | - | - | error: {r['error'][:60]} | | | | |")
            continue
        lines.append(f"| {r['source']} | {r['world_size']} | {r['speed']}x "
                     f"({r['device_tokens_per_s']:,.0f} tok/s) | {r['stall']:.1%} "
                     f"| {r['steady_stall']:.1%} | {r['first_batch_s']:.2f} "
                     f"| {r['steps_per_rank']:.1f} | {r['samples_per_s']:.0f} |")
    return "\n".join(lines)


def server_split(prof: dict) -> dict:
    """Server CPU by stage: timers inside the data plane + per-thread CPU from /proc."""
    st = prof.get("stages", {})
    th = prof.get("threads", {})

    def cpu(k: str) -> float:
        return st.get(k, {}).get("cpu_s", 0.0)

    build = cpu("build_message")
    handler = th.get("grpc handler pool (Python)", 0.0)
    parts = {"planner": cpu("planner_feed"),
             "publish (state)": cpu("publish") + cpu("planner_checkpoint"),
             "flow control (acks)": cpu("flow_control"),
             "source": cpu("source"),
             "collate": cpu("collate"), "encode": cpu("encode"),
             "batch build other": max(0.0, build - cpu("collate") - cpu("encode")),
             "sender threads (state reads + send)": max(0.0, handler - build),
             "gRPC C-core threads": th.get("grpc core (C threads)", 0.0)}
    total = prof.get("process_cpu_s", 0.0)
    parts["rest"] = max(0.0, total - sum(parts.values()))
    return {"total_cpu_s": total, "parts": parts}


def scaling_tables(sc: dict) -> str:
    lines = ["| Ray workers | runs | cold samples/s | warm samples/s | warm tokens/s "
             "| first row s (cold) | warm vs 1 worker |", "|---|---|---|---|---|---|---|"]
    by_k: dict[int, list[dict]] = {}
    for r in sc.get("ray", []):
        if "error" in r:
            lines.append(f"| {r['workers']} | error: {r['error'][:60]} | | | | | |")
            continue
        by_k.setdefault(r["workers"], []).append(r)

    def m(rs: list[dict], phase: str, key: str) -> float:
        return _mean([r[phase][key] for r in rs])

    base = m(by_k[1], "warm", "samples_per_s") if 1 in by_k else float("nan")
    for k in sorted(by_k):
        rs = by_k[k]
        lines.append(f"| {k} | {len(rs)} | {m(rs, 'cold', 'samples_per_s'):.0f} "
                     f"| {m(rs, 'warm', 'samples_per_s'):.0f} "
                     f"| {m(rs, 'warm', 'tokens_per_s'):,.0f} "
                     f"| {m(rs, 'cold', 'first_item_s'):.1f} "
                     f"| {f(m(rs, 'warm', 'samples_per_s') / base, '.2f')}x |")
    lines += ["", "| ranks | state | first batch s | steps | samples | span s | steps/s "
              "| samples/s | MB/s "
              "| server CPU s | planner | publish | flow control | collate | encode | build other "
              "| sender threads | gRPC C-core | rest | consumers CPU s |", "|" + "---|" * 20]
    for r in sc.get("many_ranks", []):
        if "error" in r:
            lines.append(f"| {r['world_size']} | {r['state']} | error: {r['error'][:80]} |"
                         + " |" * 17)
            continue
        sp = server_split(r["server"])
        p = sp["parts"]
        lines.append(
            f"| {r['world_size']} | {r['state']} | {f(r['first_batch_s'], '.1f')} "
            f"| {r['steps']} | {r['samples']}{'' if r['epoch_complete'] else ' (partial)'} "
            f"| {r['stream_span_s']:.1f} | {r['steps_per_s']:.2f} | {r['samples_per_s']:,.0f} "
            f"| {r['mb_per_s']:.0f} | {sp['total_cpu_s']:.1f} | {p['planner']:.2f} "
            f"| {p['publish (state)']:.2f} | {p['flow control (acks)']:.2f} "
            f"| {p['collate']:.2f} | {p['encode']:.2f} "
            f"| {p['batch build other']:.2f} | {p['sender threads (state reads + send)']:.2f} "
            f"| {p['gRPC C-core threads']:.2f} | {p['rest']:.2f} | {r['consumer_cpu_s']:.1f} |")
    return "\n".join(lines)


def align_table(al: dict) -> str:
    lines = ["| approach | W | collectives / step | per-step cost p50 | p99 |",
             "|---|---|---|---|---|"]
    for r in al["all_gather"]:
        lines.append(f"| in-trainer all_gather of token counts (gloo, 1 host) | "
                     f"{r['world_size']} | 1 | {r['p50_us']:.0f} us | {r['p99_us']:.0f} us |")
    lines.append("| odb-pipeline (step info + END in band) | any | 0 | 0 (no collective) | - |")
    waits = al.get("take_batch_p50_us") or {}
    if waits:
        lines += ["", "Taking the next batch in the training loop (steady state, p50 over the "
                  "throughput runs; every loader pays this, alignment or not): "
                  + ", ".join(f"{m} {f(v, '.0f')} us" for m, v in waits.items()) + "."]
    return "\n".join(lines)


# --- plots -------------------------------------------------------------------------------------


def plots(res: dict, out: Path, suffix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = {"standard": "tab:gray", "peer": "tab:orange", "ours": "tab:blue"}
    tp = res.get("throughput")
    if tp:
        names = list(tp)
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        width = 0.27
        for i, m in enumerate(throughput.METHODS):
            xs = [j + (i - 1) * width for j in range(len(names))]
            for ax, key in ((axes[0], "vs_standard"), (axes[1], "padding_efficiency")):
                vals = [tp[n]["summary"][m][key] for n in names]
                ax.bar(xs, vals, width, label=m, color=colors[m])
                for x, v in zip(xs, vals, strict=True):
                    ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        axes[0].set_title("training samples/s vs Standard (higher is better)")
        axes[1].set_title("padding efficiency (real / padded tokens)")
        for ax in axes:
            ax.set_xticks(range(len(names)), names, fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        axes[0].axhline(1.0, color="k", lw=0.8)
        axes[0].legend(fontsize=8)
        fig.suptitle("end-to-end: tiny Qwen2 (2L, h128) fwd+bwd+AdamW on CPU, 1 thread")
        fig.tight_layout()
        p = out / f"e2e_throughput{suffix}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p.name)

        fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8))
        for ax, n in zip(np.atleast_1d(axes), names, strict=True):
            for m in throughput.METHODS:
                curve = tp[n]["runs"][m][0]["curve"]
                seen = np.cumsum([c[0] for c in curve])
                loss = np.array([c[1] for c in curve])
                k = max(1, len(loss) // 15)
                smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
                ax.plot(seen[k - 1:], smooth, label=f"{m} (eval "
                        f"{tp[n]['summary'][m]['eval_loss']:.2f})", color=colors[m])
            ax.set_title(n, fontsize=9)
            ax.set_xlabel("samples seen")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        np.atleast_1d(axes)[0].set_ylabel("train loss (moving mean over steps)")
        fig.tight_layout()
        p = out / f"e2e_loss{suffix}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p.name)
    st = [r for r in res.get("stall", []) if "error" not in r]
    if st:
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [f"{r['source']}\nW={r['world_size']} {r['speed']}x" for r in st]
        ax.bar(range(len(st)), [r["stall"] for r in st], 0.4, label="all (incl. first batch)",
               color="tab:red")
        ax.bar([i + 0.4 for i in range(len(st))], [r["steady_stall"] for r in st], 0.4,
               label="after the first batch", color="tab:green")
        ax.set_xticks([i + 0.2 for i in range(len(st))], labels, fontsize=8)
        ax.set_ylabel("fraction of rank wall time waiting")
        ax.set_title("data stall per rank (simulated device; 1x = tiny model's CPU speed)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / f"e2e_stall{suffix}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p.name)
    sims = [r for r in (res.get("scaling") or {}).get("many_ranks", []) if "error" not in r]
    if sims:
        fig, ax = plt.subplots(figsize=(8, 4))
        bottom = np.zeros(len(sims))
        keys = list(server_split(sims[0]["server"])["parts"])
        for k in keys:
            vals = np.array([server_split(r["server"])["parts"][k] for r in sims])
            ax.bar([f"W={r['world_size']} {r['state']}" for r in sims], vals, 0.5, bottom=bottom,
                   label=k)
            bottom += vals
        ax.set_ylabel("server process CPU seconds")
        ax.set_title("where the server's CPU goes (simulated many-rank job)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / f"e2e_scaling{suffix}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p.name)
    return written


def order_table(o: dict) -> str:
    rows = ["| order | samples/s | first batch (s) | producer peak RSS (MB) |", "|---|---|---|---|"]
    for shuffle in (False, True):
        rs = [r for r in o["rounds"] if r["shuffle"] == shuffle]
        rows.append(f"| {'shuffled' if shuffle else 'file order'} | "
                    f"{_mean([r['samples_per_s'] for r in rs]):.0f} | "
                    f"{_mean([r['first_batch_s'] for r in rs]):.2f} | |")
    for m in o["memory"]:
        rows.append(f"| shuffled, source {m['source']} | {m['samples_per_s']:.0f} | "
                    f"{m['first_batch_s']:.2f} | {m['producer_peak_rss_mb']} |")
    ratio = o["summary"]["shuffled_vs_file_order_samples_per_s"]
    return "\n".join(rows) + f"\n\nshuffled / file order samples/s: {ratio:.3f}"


def report(res: dict, out: Path, suffix: str) -> None:
    written = plots(res, out, suffix)
    if res.get("throughput"):
        print("\n## Training throughput\n\n" + throughput_tables(res["throughput"]))
    if res.get("stall"):
        print("\n## Data stall\n\n" + stall_table(res["stall"]))
    if res.get("scaling"):
        print("\n## Scaling\n\n" + scaling_tables(res["scaling"]))
    if res.get("align"):
        print("\n## Alignment cost\n\n" + align_table(res["align"]))
    if res.get("order"):
        print("\n## Order (shuffled vs file order)\n\n" + order_table(res["order"]))
    print(f"\nwrote {out / ('e2e_bench' + suffix + '.json')} and {', '.join(written)} "
          f"({res['meta']['wall_seconds']} s)")


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: < 5 minutes")
    add_out_argument(ap, "e2e")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--from-json", help="only re-render tables and plots from a results JSON")
    args = ap.parse_args(argv)
    if args.from_json:  # re-render tables and plots of a finished run
        res = json.loads(Path(args.from_json).read_text())
        report(res, Path(args.from_json).parent, "_quick" if res["meta"]["command"].endswith(
            "--quick") else "")
        return 0
    parts = [p for p in args.parts.split(",") if p]
    bad = set(parts) - set(PARTS)
    if bad:
        ap.error(f"unknown parts {sorted(bad)}")
    cfg = dict(QUICK if args.quick else FULL)
    out = out_dir(args, "e2e")
    suffix = "_quick" if args.quick else ""
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res: dict = {}
    svc = ServiceProcess()
    tmp = Path(tempfile.mkdtemp(prefix="odb-e2e-"))
    try:
        if "throughput" in parts:
            res["throughput"] = part_throughput(cfg, svc)
        tok_s = 4000.0
        ours_wait = None
        waits = {}
        tp = res.get("throughput")
        prev = out / f"e2e_bench{suffix}.json"
        if not tp and prev.exists():  # a subset run: take the device speed of the last one
            tp = json.loads(prev.read_text()).get("throughput")
        if tp:
            real = tp["chats_real"]["runs"]["ours"]
            tok_s = _mean([r["padded_tokens"] / r["compute_s"] for r in real])
            waits = {m: _mean([s["summary"][m]["step_wait_p50_us"] for s in tp.values()])
                     for m in throughput.METHODS}
            ours_wait = waits["ours"]
        if "stall" in parts:
            res["stall"] = part_stall(cfg, svc, tmp, tok_s)
        if "scaling" in parts:
            res["scaling"] = part_scaling(cfg, svc, tmp)
        if "align" in parts:
            res["align"] = part_align(cfg, ours_wait)
            res["align"]["take_batch_p50_us"] = waits
        if "order" in parts:
            res["order"] = part_order(cfg, svc, tmp, tok_s)
    finally:
        svc.close()
    meta = {
        "command": "bench/e2e_bench.py" + (" --quick" if args.quick else "")
        + ("" if args.parts == ",".join(PARTS) else f" --parts {args.parts}"),
        "config": cfg, "model": common.MODEL, "lr": common.LR, "torch_threads": 1,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "loadavg_end": list(os.getloadavg()), "date_utc": time.strftime("%Y-%m-%d %H:%M",
                                                                        time.gmtime()),
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    for w in (res.get("throughput") or {}).values():  # keep curves (plots), drop bulky server
        for rs in w["runs"].values():
            for r in rs:
                r.pop("model", None)
    path = out / f"e2e_bench{suffix}.json"
    doc = {"meta": meta, **res}
    if set(parts) != set(PARTS) and path.exists():
        # A subset run updates its parts in the existing results; the rest keep their meta.
        old = json.loads(path.read_text())
        runs = old.get("meta", {}).get("runs") or [old.get("meta", {})]
        meta["parts"] = parts
        doc = {**{k: v for k, v in old.items() if k != "meta"}, **res,
               "meta": {**meta, "runs": [m for m in runs if m] + [dict(meta)]}}
    path.write_text(json.dumps(doc, indent=1))
    report(doc, out, suffix)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
