"""Wire bytes benchmark: the same batches framed as wire version 0 and wire version 2, side by side.

Version 0 (before issue #15): int64 input_ids / labels / attention_mask / position_ids, float32
normalized pixel patches. Version 2: int32 ids and labels, bool mask, position ids only in packed
batches (int32), raw uint8 pixel patches normalized by the trainer (or bfloat16, a per-job
choice). Both are framed by the server's own `batch_message_bytes` from the same collated
samples; bytes are whole serialized messages (headers included).

Batches: padded and packed text batches of synthetic log-uniform lengths cut greedily under a
16384-token budget; image batches from real pictures (scikit-image's bundled data) through the
real Qwen2-VL processor, once per pixel storage. Also timed, in one run: the client's decode
(version 0) against decode + `to_model_inputs("cpu")` (version 2: widening and normalization;
on a GPU trainer those run on the device after the transfer).

Run:  .venv/bin/python bench/wire_bench.py [--quick]
Writes into --out (committed: bench/results/wire/) wire_bench{,_quick}.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_dir import add_out_argument, out_dir  # noqa: E402

from pipeline.config import PreprocessConfig  # noqa: E402
from pipeline.preprocess.array_source import synthetic_samples  # noqa: E402
from pipeline.preprocess.sample import ProcessedSample  # noqa: E402
from pipeline.service.collate import Piece, collate  # noqa: E402
from pipeline.service.wire_codec import batch_message_bytes  # noqa: E402
from trainer_client.decode import decode_batch  # noqa: E402
from trainer_client.wire.odb.v1 import data_service_pb2 as pb  # noqa: E402

BUDGET = 16384
PICTURES = ["astronaut", "chelsea", "coffee", "camera", "rocket", "hubble_deep_field"]


def text_batches(n_samples: int, mode: str) -> list[list[ProcessedSample]]:
    """Greedy cuts under the budget (padded cost n*max_len, packed sum(len)), input order."""
    batches, cur = [], []
    for s in synthetic_samples(n_samples, min_len=64, max_len=4096, seed=7):
        trial = [*cur, s]
        lens = [x.num_tokens for x in trial]
        cost = len(trial) * max(lens) if mode == "padded" else sum(lens)
        if cost > BUDGET and cur:
            batches.append(cur)
            trial = [s]
        cur = trial
    return [*batches, cur]


def v0_arrays(arrays: dict[str, np.ndarray], mode: str) -> dict[str, np.ndarray]:
    """The same batch as wire version 0 laid it out."""
    out = {k: arrays[k].astype(np.int64) for k in ("input_ids", "labels")}
    if mode == "padded":
        mask = arrays["attention_mask"]
        out["attention_mask"] = mask.astype(np.int64)
        out["position_ids"] = np.where(mask, np.arange(mask.shape[1]), 0).astype(np.int64)
    else:
        out["position_ids"] = arrays["position_ids"].astype(np.int64)
        out["cu_seqlens"], out["max_seqlen"] = arrays["cu_seqlens"], arrays["max_seqlen"]
    return out


def image_samples(pixel_dtype: str, repeats: int) -> list[ProcessedSample]:
    import skimage.data
    from PIL import Image

    from pipeline.preprocess.vision import VisionProcessor

    vp = VisionProcessor(PreprocessConfig(pixel_dtype=pixel_dtype))
    out = []
    for row, name in enumerate(PICTURES * repeats):
        im = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
        pv, grid = vp.process([im])
        ids = np.arange(1, 65, dtype=np.int32)
        out.append(ProcessedSample(f"img:{row}", "img", row, ids, ids.copy(), pixel_values=pv,
                                   image_grid_thw=grid))
    return out


def message(arrays: dict[str, np.ndarray], mode: str) -> bytes:
    return batch_message_bytes(pb.Batch(step=0, collate=mode, sample_ids=["x"]), arrays)


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def client_cost(raw_v0: bytes, raw_v2: bytes, reps: int) -> dict:
    def v0() -> None:
        decode_batch(pb.ServerMessage.FromString(raw_v0).batch, "torch")

    def v2() -> None:
        decode_batch(pb.ServerMessage.FromString(raw_v2).batch, "torch").to_model_inputs("cpu")

    return {"v0_decode_ms": timed(v0, reps) * 1e3, "v2_decode_and_inputs_ms": timed(v2, reps) * 1e3}


def bench_text(mode: str, n_samples: int, reps: int) -> dict:
    v0_bytes = v2_bytes = padded_tokens = payload = 0
    biggest = None
    for batch in text_batches(n_samples, mode):
        arrays = collate([Piece(s) for s in batch], mode)
        new, old = message(arrays, mode), message(v0_arrays(arrays, mode), mode)
        v0_bytes += len(old)
        v2_bytes += len(new)
        padded_tokens += arrays["input_ids"].size
        payload += sum(a.nbytes for a in arrays.values())
        if biggest is None or len(old) > len(biggest[0]):
            biggest = (old, new)
    return {"batches": len(text_batches(n_samples, mode)), "padded_tokens": padded_tokens,
            "v0_bytes": v0_bytes, "v2_bytes": v2_bytes, "ratio": v0_bytes / v2_bytes,
            "v0_bytes_per_token": v0_bytes / padded_tokens,
            "v2_bytes_per_token": v2_bytes / padded_tokens,
            "v2_tensor_bytes_per_token": payload / padded_tokens,
            **client_cost(*biggest, reps)}


def bench_images(repeats: int, reps: int) -> dict:
    f32 = image_samples("float32", repeats)
    old = message(collate([Piece(s) for s in f32], "packed"), "packed")
    patches = sum(int(s.pixel_values.shape[0]) for s in f32)
    out: dict = {"images": len(f32), "patches": patches, "v0_bytes": len(old),
                 "v0_pixel_bytes_per_patch": sum(s.pixel_values.nbytes for s in f32) / patches}
    for dtype in ("uint8", "bfloat16"):
        samples = image_samples(dtype, repeats)
        new = message(collate([Piece(s) for s in samples], "packed"), "packed")
        out[dtype] = {"v2_bytes": len(new), "ratio": len(old) / len(new),
                      "pixel_bytes_per_patch": sum(s.pixel_values.nbytes for s in samples)
                      / patches, **client_cost(old, new, reps)}
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    modes = ["padded", "packed"]
    x = np.arange(len(modes))
    a.bar(x - 0.2, [results[m]["v0_bytes_per_token"] for m in modes], 0.4, label="wire v0")
    a.bar(x + 0.2, [results[m]["v2_bytes_per_token"] for m in modes], 0.4, label="wire v2")
    a.axhline(9, color="grey", linestyle=":", label="target 9 B (padded)")
    a.set_xticks(x, modes)
    a.set_ylabel("bytes per padded token (whole messages)")
    a.set_title("text batches")
    a.legend()
    img = results["images"]
    labels = ["float32 (v0)", "bfloat16", "uint8"]
    vals = [img["v0_pixel_bytes_per_patch"], img["bfloat16"]["pixel_bytes_per_patch"],
            img["uint8"]["pixel_bytes_per_patch"]]
    b.bar(labels, vals, color=["tab:blue", "tab:orange", "tab:green"])
    b.set_ylabel("pixel bytes per 14x14x2x3 patch")
    b.set_title(f"images: v0/v2 message bytes {img['uint8']['ratio']:.2f}x (uint8)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples and repeats")
    add_out_argument(ap, "wire")
    args = ap.parse_args()
    n, reps, repeats = (600, 3, 1) if args.quick else (6000, 20, 3)
    results = {}
    for mode in ("padded", "packed"):
        print(f"text {mode} ...", flush=True)
        results[mode] = bench_text(mode, n, reps)
    print("images ...", flush=True)
    results["images"] = bench_images(repeats, reps)
    stem = "wire_bench_quick" if args.quick else "wire_bench"
    out_path = out_dir(args, "wire")
    meta = {"command": "bench/wire_bench.py" + (" --quick" if args.quick else ""),
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (out_path / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results},
                                                     indent=1))
    plot(results, out_path / f"{stem}.png")
    for mode in ("padded", "packed"):
        r = results[mode]
        print(f"{mode}: {r['v0_bytes_per_token']:.2f} -> {r['v2_bytes_per_token']:.2f} B/token "
              f"(tensors alone {r['v2_tensor_bytes_per_token']:.2f}) "
              f"({r['ratio']:.2f}x); client {r['v0_decode_ms']:.2f} ms -> "
              f"{r['v2_decode_and_inputs_ms']:.2f} ms")
    img = results["images"]
    for dtype in ("uint8", "bfloat16"):
        print(f"images {dtype}: {img['v0_pixel_bytes_per_patch']:.0f} -> "
              f"{img[dtype]['pixel_bytes_per_patch']:.0f} B/patch; messages "
              f"{img[dtype]['ratio']:.2f}x fewer bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
