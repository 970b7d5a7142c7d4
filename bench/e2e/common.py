"""Workloads, collation and the training loop shared by every contender.

Every contender trains the same model (`TinyCausalLM`, Qwen2 architecture from a config:
2 layers, hidden 128, 4096 vocab buckets over the Qwen tokenizer's 151k ids) with AdamW, one
torch thread, and the same padded collation (right padding, labels -100 on padding, position
ids 0..n-1), so only the batching (and where it runs) differs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CHATS = ROOT / "pipeline" / "sample_data" / "chats.jsonl"
IGNORE = -100
FULL_BUDGET = 16384
# (name, CV, mean) of the planner issue; lengths clipped to [16, 8192] at full scale.
SYNTHETIC = [("cv0.29_mean700", 0.29, 700), ("cv0.48_mean1400", 0.48, 1400),
             ("cv1.00_mean1000", 1.0, 1000)]
MODEL = {"hidden": 128, "layers": 2, "vocab_buckets": 4096}
LR = 3e-3


@dataclass
class Workload:
    name: str
    budget: int
    train: list  # ProcessedSample
    held_out: list  # ProcessedSample, for the eval loss
    note: str = ""
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def p99(self) -> int:
        return int(np.percentile([s.num_tokens for s in self.train], 99))

    @property
    def standard_batch(self) -> int:
        """Standard's fixed batch size: same peak padded tokens as the budget (B by p99)."""
        return max(1, self.budget // self.p99)


def lognormal_lengths(cv: float, mean: float, n: int, seed: int, lo: int, hi: int) -> np.ndarray:
    sigma2 = math.log(1 + cv * cv)
    mu = math.log(mean) - sigma2 / 2
    x = np.random.default_rng(seed).lognormal(mu, math.sqrt(sigma2), n)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def tokenize_chats(path: Path = CHATS) -> list:
    """The shipped chats, preprocessed in-process with the pipeline's own `Processor`."""
    from pipeline.config import load_config
    from pipeline.preprocess.process import Processor
    from pipeline.preprocess.sample import ProcessedSample
    from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk

    job = job_config_dict("chats", 1, 4096, 256, str(path))
    cfg = load_config(environ={}, overrides={"jobs": [job]}).jobs[0]
    proc = Processor(cfg, 0)
    out = []
    for c in plan_chunks(expand_sources(cfg.source), 256):
        out += [s for s in proc.process(c.file, read_chunk(c)) if isinstance(s, ProcessedSample)]
    return out


def corpus_samples(lengths: Sequence[int], corpus: np.ndarray, corpus_labels: np.ndarray,
                   seed: int, source: str) -> list:
    """Samples of the given lengths cut from real tokenized chats (learnable, unlike random ids):
    each is a window of the concatenated token stream, with the chats' own loss mask."""
    from pipeline.preprocess.sample import ProcessedSample

    rng = np.random.default_rng(seed)
    n_tok = len(corpus)
    out = []
    for row, n in enumerate(lengths):
        n = int(n)
        start = int(rng.integers(0, n_tok))
        idx = (start + np.arange(n)) % n_tok
        ids = corpus[idx].astype(np.int32)
        lab = corpus_labels[idx].astype(np.int32)
        if not (lab != IGNORE).any():
            lab[n // 2:] = ids[n // 2:]
        out.append(ProcessedSample(f"{source}:{row}", source, row, ids, lab, cost=n))
    return out


def build_workloads(n_synth: int, scale: int, n_real: int | None, real_budget: int,
                    eval_n: int = 48) -> list[Workload]:
    """Three log-normal workloads (lengths and budget divided by `scale`: same shapes, same
    samples per batch) plus the shipped chats (real lengths, `real_budget`)."""
    chats = tokenize_chats()
    n_hold = max(8, len(chats) // 10)
    train_chats, hold_chats = chats[:-n_hold], chats[-n_hold:]
    corpus = np.concatenate([s.input_ids for s in train_chats])
    corpus_lab = np.concatenate([s.labels for s in train_chats])
    hold_corpus = np.concatenate([s.input_ids for s in hold_chats])
    hold_lab = np.concatenate([s.labels for s in hold_chats])
    out = []
    budget = FULL_BUDGET // scale
    lo, hi = 16, 8192 // scale
    for i, (name, cv, mean) in enumerate(SYNTHETIC):
        lengths = lognormal_lengths(cv, mean / scale, n_synth + eval_n, 12345 + i, lo, hi)
        train = corpus_samples(lengths[:n_synth], corpus, corpus_lab, 100 + i, name)
        held = corpus_samples(lengths[n_synth:], hold_corpus, hold_lab, 200 + i, name + "-eval")
        out.append(Workload(name, budget, train, held, lengths=lengths[:n_synth],
                            note=f"log-normal CV {cv} mean {mean}/{scale}, clip [{lo}, {hi}]"))
    real = train_chats if n_real is None else train_chats[:n_real]
    out.append(Workload("chats_real", real_budget, real, hold_chats,
                        lengths=np.array([s.num_tokens for s in real]),
                        note="pipeline/sample_data/chats.jsonl, Qwen tokenizer + chat template"))
    return out


def job_config_dict(job_id: str, world: int, budget: int, buffer: int, path: str,
                    max_seq_len: int = 8192, shuffle: bool | None = None) -> dict:
    """`shuffle`: the source's order (None: the config's default, shuffled)."""
    source: dict = {"paths": [path]}
    if shuffle is not None:
        source["shuffle"] = shuffle
    return {
        "job_id": job_id, "world_size": world, "mode": "join", "seed": 0,
        "source": source,
        "preprocess": {"max_seq_len": max_seq_len, "augment": {"enabled": False}},
        "batching": {"token_budget": budget, "collate": "padded", "max_window_samples": buffer,
                     "over_budget": "truncate"},
    }


def service_overrides(jobs: list[dict], prefetch_steps: int = 4) -> dict:
    return {"redis_url": None, "metrics_port": None,
            "grpc": {"host": "127.0.0.1", "port": 0, "prefetch_steps": prefetch_steps},
            "jobs": jobs}


# --- collation for the in-trainer contenders (identical bytes to the server's padded collate)


def as_item(s) -> dict:
    import torch

    return {"input_ids": torch.from_numpy(s.input_ids), "labels": torch.from_numpy(s.labels)}


class SampleDataset:
    """Map-style dataset of preprocessed samples (what a user's Dataset would return)."""

    def __init__(self, samples: Sequence) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return as_item(self.samples[i])


def pad_collate(items: list[dict]) -> dict:
    import torch

    lens = [int(it["input_ids"].shape[0]) for it in items]
    b, width = len(items), max(lens)
    ids = torch.zeros((b, width), dtype=torch.int64)
    labels = torch.full((b, width), IGNORE, dtype=torch.int64)
    mask = torch.zeros((b, width), dtype=torch.int64)
    pos = torch.zeros((b, width), dtype=torch.int64)
    ramp = torch.arange(width, dtype=torch.int64)
    for i, (it, n) in enumerate(zip(items, lens, strict=True)):
        ids[i, :n] = it["input_ids"]
        labels[i, :n] = it["labels"]
        mask[i, :n] = 1
        pos[i, :n] = ramp[:n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": pos}


# --- the model and the loop


def make_model():
    import torch

    from pipeline.demo.tiny_model import TinyCausalLM

    model = TinyCausalLM(vocab_buckets=MODEL["vocab_buckets"], hidden=MODEL["hidden"],
                         layers=MODEL["layers"], seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, opt


TENSOR_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


def train(batches: Callable[[], Iterable[dict]], label: str, log: Callable[[str], None]) -> dict:
    """One epoch of forward+backward+AdamW over `batches()`; per-step records + totals.

    Wall time runs from asking for the iterator (loader start, stream open) to the end of the
    last optimizer step: what the trainer really spends on the epoch.
    """
    import torch

    torch.manual_seed(0)
    model, opt = make_model()
    model.train()
    steps = []
    ch0 = _children_cpu()
    cpu0 = time.process_time()
    t_start = time.perf_counter()
    it = iter(batches())
    while True:
        t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        if hasattr(b, "to_model_inputs"):  # ours: wire dtypes to the model's, as a trainer does
            b = b.to_model_inputs()
        t1 = time.perf_counter()
        t = {k: b[k] for k in TENSOR_KEYS if k in b}  # position_ids: where the collate has them
        loss, n = model(**t)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        steps.append({"samples": int(t["input_ids"].shape[0]),
                      "real_tokens": int(t["attention_mask"].sum()),
                      "padded_tokens": int(t["input_ids"].numel()),
                      "loss": loss.item(), "loss_tokens": int(n),
                      "wait_s": t1 - t0, "compute_s": t2 - t1})
    wall = time.perf_counter() - t_start
    res = summarize(steps, wall)
    res["trainer_cpu_s"] = time.process_time() - cpu0
    del it  # shuts the loader's processes down (reaped: their CPU shows in RUSAGE_CHILDREN)
    time.sleep(0.2)
    res["loader_cpu_s"] = _children_cpu() - ch0
    res["model"] = model
    log(f"    {label}: {res['samples']} samples, {res['steps']} steps, "
        f"{res['samples_per_s']:.1f} samples/s, pad eff {res['padding_efficiency']:.3f}, "
        f"wait {res['wait_fraction']:.1%}")
    return res


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def summarize(steps: list[dict], wall: float) -> dict:
    samples = sum(s["samples"] for s in steps)
    real = sum(s["real_tokens"] for s in steps)
    padded = sum(s["padded_tokens"] for s in steps)
    wait = sum(s["wait_s"] for s in steps)
    first = steps[0]["wait_s"] if steps else 0.0
    steady_wall = wall - first
    return {
        "steps": len(steps), "samples": samples, "real_tokens": real, "padded_tokens": padded,
        "wall_s": wall, "samples_per_s": samples / wall if wall else 0.0,
        "real_tokens_per_s": real / wall if wall else 0.0,
        "padded_tokens_per_s": padded / wall if wall else 0.0,
        "steady_samples_per_s": (samples - (steps[0]["samples"] if steps else 0)) / steady_wall
        if steady_wall > 0 else 0.0,
        "first_batch_s": first, "wait_fraction": wait / wall if wall else 0.0,
        "steady_wait_fraction": (wait - first) / steady_wall if steady_wall > 0 else 0.0,
        "padding_efficiency": real / padded if padded else 1.0,
        "compute_s": sum(s["compute_s"] for s in steps),
        "step_wait_p50_us": float(np.median([s["wait_s"] for s in steps[1:]]) * 1e6)
        if len(steps) > 1 else None,
        "curve": [[s["samples"], s["loss"], s["loss_tokens"]] for s in steps],
    }


def eval_loss(model, held_out: Sequence, batch_tokens: int) -> float:
    """Token-weighted mean loss over the held-out samples' label tokens (no grad)."""
    import torch

    model.eval()
    tot, n_tok = 0.0, 0
    items = sorted(held_out, key=lambda s: s.num_tokens)
    i = 0
    with torch.no_grad():
        while i < len(items):
            k = max(1, batch_tokens // items[min(len(items) - 1, i)].num_tokens)
            chunk = items[i:i + k]
            while len(chunk) > 1 and len(chunk) * chunk[-1].num_tokens > batch_tokens:
                chunk = chunk[:-1]
            b = pad_collate([as_item(s) for s in chunk])
            loss, n = model(**b)
            tot += float(loss) * n
            n_tok += n
            i += len(chunk)
    model.train()
    return tot / n_tok if n_tok else float("nan")
