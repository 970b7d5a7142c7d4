"""Image preprocessing per core: decode + resize + patchify through the Ray Data pipeline vs a
plain PIL/numpy loop in one process, over the same images (issue #32).

    .venv/bin/python bench/image_bench.py [--quick] [--profile]

Images: scikit-image's bundled pictures (no download), enlarged to VLM size (long side 1,344
px, JPEG quality 90), so the default `preprocess.image_max_pixels` (1024 x 1024) resizes each
to ~1 MP: ~5,000 Qwen2-VL patches, ~6 MB of uint8 pixels per image. Records: one image with a
one-line question and answer (the text is a rounding error next to the image).

Contenders, same images in the same order, each handing the driver numpy pixel arrays:
- plain loop: `vision.decode_image` (PIL) + `VisionProcessor.process` (resize + patchify) in one
  process, nothing else;
- Processor loop: the pipeline's `Processor.process_parts` on the same chunks in one process
  (what a Ray task runs: + record parsing, chat template, tokenizer, labels, visual-token
  expansion);
- Ray Data, k workers (k = 1 .. the cores): `iter_samples` — `build_dataset`'s `map_batches`
  tasks sized by bytes as the service sizes them (`preprocess.task_output_mb`, 64 MiB: 10 of
  these images a task), Arrow blocks through the object store, the driver turning rows into
  samples. Ray is started once (num_cpus = the cores); every k runs one warm-up epoch first
  (worker start-up and the per-worker `Processor` are not counted), then the timed rounds.

Per core: images/s divided by the processes doing the work (Ray: k workers), and CPU per image
of every process a contender runs on (driver; Ray: + its workers, daemons and actors), read from
/proc, so load from other jobs stretches wall time but not CPU per image. Against the plain
loop: per-core images/s and CPU per image; Ray's scaling: images/s at k workers / (k x at 1).
Rounds are interleaved (plain, Processor, Ray k = 1 ..) so load swings hit all alike; the best
round is shown, every round is in the JSON.

`--profile` also samples each contender with py-spy (`pip install py-spy`) and writes, per
contender, the share of CPU samples by what the frame does (decode, resize, patchify, Arrow
block, Ray serialization, driver row conversion, ...) into the JSON.

Writes image_bench{,_quick}.{json,png}. TOKENIZERS_PARALLELISM=false and
OMP_NUM_THREADS=1 everywhere (PIL and numpy run single-threaded): one process = one core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from preprocess_bench import cpu_since, tree_cpu  # noqa: E402
from results_dir import add_out_argument, out_dir  # noqa: E402

from pipeline.config import TrainingJobConfig  # noqa: E402
from pipeline.preprocess.sources import expand_sources  # noqa: E402
from pipeline.preprocess.task_size import rows_per_task  # noqa: E402

# skimage.data pictures that ship with the wheel (no pooch download).
PICTURES = ["astronaut", "coffee", "chelsea", "rocket", "retina", "hubble_deep_field", "camera",
            "coins", "moon", "logo", "brick", "page", "text"]
LONG_SIDE = 1344
ROLES = {"plain": ("driver",), "ray": ("driver", "ray workers", "ray daemons")}


def write_images(folder: Path) -> list[str]:
    """The pictures as RGB JPEGs whose long side is LONG_SIDE (bicubic); file names."""
    import numpy as np
    import skimage.data
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for name in PICTURES:
        a = np.asarray(getattr(skimage.data, name)())
        if a.dtype == bool:
            a = a.astype(np.uint8) * 255
        im = Image.fromarray(a).convert("RGB")
        scale = LONG_SIDE / max(im.size)
        im = im.resize((round(im.width * scale), round(im.height * scale)),
                       Image.Resampling.BICUBIC)
        im.save(folder / f"{name}.jpg", quality=90)
        names.append(f"{name}.jpg")
    return names


def write_records(path: Path, names: list[str], n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            image = {"type": "image", "image": f"images/{names[i % len(names)]}"}
            rec = {"messages": [
                {"role": "user", "content": [image, {"type": "text",
                                                     "text": "Describe this image."}]},
                {"role": "assistant", "content": f"A picture, number {i}."}]}
            f.write(json.dumps(rec) + "\n")


class Meter:
    def __init__(self, roles: tuple[str, ...]) -> None:
        self.roles = roles
        self.cpu0 = tree_cpu()
        self.t0 = time.perf_counter()
        self.images = self.patch_bytes = 0

    def add(self, pixel_values) -> None:
        self.images += 1
        self.patch_bytes += pixel_values.nbytes

    def result(self, name: str, workers: int) -> dict:
        wall = time.perf_counter() - self.t0
        by_role = cpu_since(self.cpu0, self.roles)
        cpu = sum(by_role.values())
        per_image = 1000 / max(1, self.images)
        return {"name": name, "workers": workers, "images": self.images,
                "patch_mb": round(self.patch_bytes / 2**20, 1), "wall_s": round(wall, 3),
                "images_per_s": round(self.images / wall, 2),
                "images_per_s_per_core": round(self.images / wall / workers, 2),
                "cpu_s": round(cpu, 3), "cpu_ms_per_image": round(per_image * cpu, 2),
                "cpu_ms_per_image_by_role": {k: round(per_image * v, 2)
                                             for k, v in by_role.items()}}


def plain_loop(job: TrainingJobConfig, data: Path) -> dict:
    """PIL decode + resize + patchify, one process: the floor the pipeline is measured by."""
    from pipeline.preprocess.records import ImageRef
    from pipeline.preprocess.vision import VisionProcessor, decode_image

    vision = VisionProcessor(job.preprocess)
    refs = [json.loads(line)["messages"][0]["content"][0]["image"]
            for line in data.read_text().splitlines()]
    m = Meter(ROLES["plain"])
    for ref in refs:
        pixels, _ = vision.process([decode_image(ImageRef(path=ref), str(data))])
        m.add(pixels)
    return m.result("plain loop (PIL + numpy)", 1)


def processor_loop(proc, job: TrainingJobConfig) -> dict:
    """The Ray task's own code (`Processor.process_parts` per chunk, the chunks Ray's tasks
    get) in this process."""
    from pipeline.preprocess.sample import ProcessedSample
    from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
    from pipeline.preprocess.task_size import rows_per_task, task_bytes

    m = Meter(ROLES["plain"])
    for c in plan_chunks(expand_sources(job.source), lambda f: rows_per_task(job, f)):
        for part in proc.process_parts([(c.file, r, 0, raw) for r, raw in read_chunk(c)],
                                       task_bytes(job)):
            for it in part:
                if isinstance(it, ProcessedSample):
                    m.add(it.pixel_values)
    return m.result("Processor loop (1 process)", 1)


def ray_pass(job: TrainingJobConfig, workers: int) -> dict:
    from pipeline.preprocess.pipeline import iter_samples
    from pipeline.preprocess.sample import ProcessedSample

    m = Meter(ROLES["ray"])
    for it in iter_samples(job, 0, concurrency=workers):
        if isinstance(it, ProcessedSample):
            m.add(it.pixel_values)
    return m.result(f"Ray Data, {workers} worker{'s' * (workers > 1)}", workers)


# What a sampled stack does: the first category matching a frame, from the leaf up. A frame is
# "function (file:line)"; a process is "process PID:\"command line\"".
CATEGORIES = [
    ("decode (PIL)", ("decode_image (",)),
    ("resize (PIL)", ("Image.resize (",)),
    ("PIL image to numpy", ("__array_interface__ (",)),
    ("patchify (numpy)", ("_patchify_into (", "_normalized (", "bfloat16_bits (")),
    ("Arrow block (to_table)", ("to_table (",)),
    ("rows back to samples (from_table)", ("from_table (", "from_row (")),
    ("tokenizer", ("tokenization_utils",)),
    ("template, parse, labels", ("chat_template.py", "records.py", "labels.py", "augment.py")),
    ("Ray worker in C++ or idle (not told apart)", ("Worker.main_loop (",)),
    ("Ray Data streaming executor", ("(ray/data/",)),
    ("Ray other", ("(ray/",)),
]


def categorize(frames: list[str]) -> str:
    for frame in reversed(frames):  # leaf first
        for cat, needles in CATEGORIES:
            if any(n in frame for n in needles):
                return cat
    return "other"


def profile(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """py-spy sampling `pid` and its children (Ray's workers) into a raw collapsed-stack file:
    only threads on a CPU (no --idle)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--subprocesses",
                             "--rate", "200", "--format", "raw", "--duration", str(int(seconds)),
                             "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def profile_summary(path: Path, driver: int) -> dict:
    """Share of the samples by process (driver, Ray workers, other Ray processes) and what the
    stack does. A Ray worker waiting for its next task is not always told apart from one
    working in C++ (py-spy sees `Worker.main_loop` either way): read that row with the CPU by
    process from /proc."""
    by: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        last = procs[-1] if procs else ""
        role = ("driver" if last.startswith(f"process {driver}:") else
                "ray workers" if "default_worker.py" in last or "ray::" in last else
                "other Ray processes")
        by[(role, categorize([f for f in frames if not f.startswith("process ")]))] += int(count)
    total = sum(by.values())
    out: dict[str, dict[str, float]] = {}
    for (role, cat), n in by.most_common():
        out.setdefault(role, {})[cat] = round(n / total, 3)
    return {"samples": total, "share": out}


def run(job: TrainingJobConfig, data: Path, tmp: Path, rounds: int, max_workers: int,
        with_profile: bool) -> dict:
    import ray

    from pipeline.preprocess.process import Processor

    proc = Processor(job, 0)
    ray.init(num_cpus=max_workers, include_dashboard=False, _temp_dir=str(tmp / "ray"),
             log_to_driver=False, configure_logging=False,
             object_store_memory=768 * 1024 * 1024)
    ks = list(range(1, max_workers + 1))
    contenders = {"plain": lambda: plain_loop(job, data),
                  "processor": lambda: processor_loop(proc, job),
                  **{f"ray{k}": lambda k=k: ray_pass(job, k) for k in ks}}
    runs: dict[str, list[dict]] = {}
    profiles: dict[str, dict] = {}
    try:
        for k in ks:  # warm-up: start k workers, each loads its Processor once
            ray_pass(job, k)
        for _ in range(rounds):
            for key, fn in contenders.items():
                runs.setdefault(key, []).append(fn())
        if with_profile:
            for key, fn in contenders.items():
                out = tmp / f"profile_{key}.txt"
                spy = profile(os.getpid(), 2 + 1.5 * min(r["wall_s"] for r in runs[key]), out)
                time.sleep(0.5)  # py-spy attached
                fn()
                spy.wait()
                profiles[key] = (profile_summary(out, os.getpid()) if out.exists()
                                 else {"error": "py-spy wrote nothing (ptrace not allowed?)"})
    finally:
        ray.shutdown()
    best = {key: max(rs, key=lambda r: r["images_per_s"]) for key, rs in runs.items()}
    plain, ray1 = best["plain"], best["ray1"]
    for key, r in best.items():
        r["rounds_images_per_s"] = [x["images_per_s"] for x in runs[key]]
        r["rounds_cpu_ms_per_image"] = [x["cpu_ms_per_image"] for x in runs[key]]
        r["per_core_vs_plain"] = round(r["images_per_s_per_core"] / plain["images_per_s"], 3)
        r["cpu_vs_plain"] = round(plain["cpu_ms_per_image"] / r["cpu_ms_per_image"], 3)
        if key.startswith("ray"):
            r["scaling_vs_1_worker"] = round(
                r["images_per_s"] / (r["workers"] * ray1["images_per_s"]), 3)
    return {"results": list(best.values()), "profiles": profiles}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cx) = plt.subplots(1, 2, figsize=(14, 4.5))
    names = [r["name"] for r in results]
    bars = ax.barh(names, [r["images_per_s_per_core"] for r in results], color="#58c")
    ax.bar_label(bars, fmt="%.1f")
    ax.axvline(0.9 * results[0]["images_per_s"], ls="--", color="k", lw=0.8,
               label="0.9x the plain loop")
    ax.set_xlabel("images/s per core (best round)")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    ax.set_title("decode + resize + patchify, per core")
    left = [0.0] * len(results)
    roles = ["driver", "ray workers", "ray daemons"]
    for role, color in zip(roles, ("#4a7", "#58c", "#c63"), strict=True):
        vals = [r["cpu_ms_per_image_by_role"].get(role, 0.0) for r in results]
        cx.barh(names, vals, left=left, color=color, label=role)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    cx.set_xlabel("CPU ms per image, by process")
    cx.invert_yaxis()
    cx.legend(fontsize=8)
    cx.set_title("CPU per image (all processes of the contender)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="32 images, 1 round instead of 192 and 3")
    ap.add_argument("--images", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--max-workers", type=int, default=os.cpu_count() or 1,
                    help="Ray workers up to this many (default: the cores)")
    ap.add_argument("--profile", action="store_true", help="py-spy each contender once more")
    add_out_argument(ap, "image")
    args = ap.parse_args()
    n = args.images or (32 if args.quick else 192)
    rounds = args.rounds or (1 if args.quick else 3)
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="odb-image-bench-"))
    try:
        names = write_images(tmp / "images")
        data = tmp / "images.jsonl"
        write_records(data, names, n)
        job = TrainingJobConfig.model_validate({
            "job_id": "images", "world_size": 1, "source": {"paths": [str(data)]},
            "preprocess": {"augment": {"enabled": False}}})
        rows = rows_per_task(job, expand_sources(job.source)[0])
        got = run(job, data, tmp, rounds, args.max_workers, args.profile)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out_path = out_dir(args, "image")
    stem = "image_bench" + ("_quick" if args.quick else "")
    meta = {"images": n, "rounds": rounds, "pictures": PICTURES, "long_side_px": LONG_SIDE,
            "image_max_pixels": job.preprocess.image_max_pixels,
            "pixel_dtype": job.preprocess.pixel_dtype,
            "task_output_mb": job.preprocess.task_output_mb, "rows_per_task": rows,
            "cpus": os.cpu_count(), "max_workers": args.max_workers,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(),
            "python": sys.version.split()[0], "platform": platform.platform(),
            "command": " ".join(["python", "bench/image_bench.py", *sys.argv[1:]])}
    (out_path / f"{stem}.json").write_text(json.dumps({"meta": meta, **got}, indent=2))
    plot(got["results"], out_path / f"{stem}.png")
    print(f"{n} images (~{got['results'][0]['patch_mb'] / max(1, n):.1f} MB of patches each), "
          f"{rounds} round(s); 1-min load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| contender | images/s | per core | per core vs plain | CPU ms/image | CPU vs plain "
          "| scaling vs 1 worker | CPU ms/image by process |")
    print("|---|---|---|---|---|---|---|---|")
    for r in got["results"]:
        print(f"| {r['name']} | {r['images_per_s']} | {r['images_per_s_per_core']} "
              f"| {r['per_core_vs_plain']}x | {r['cpu_ms_per_image']} | {r['cpu_vs_plain']}x "
              f"| {r.get('scaling_vs_1_worker', '-')} | {r['cpu_ms_per_image_by_role']} |")
    for key, p in got["profiles"].items():
        print(f"profile {key}: {p}")
    print(f"wrote {out_path / (stem + '.json')} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
