"""VLM-size data for the chunked-delivery tests: chat records with 1024 x 1024 pictures (the
default `image_max_pixels`: ~6.1 MB of uint8 patches each) and their samples after the real
preprocessing (`Processor`: chat template, tokenizer, Qwen2-VL patches)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from PIL import Image

from pipeline.config import TrainingJobConfig
from pipeline.preprocess.process import Processor
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.sources import SourceFile
from pipeline.sample_data import IMAGES_DIR

PICTURES = ["astronaut.jpg", "coffee.jpg", "chelsea.jpg", "rocket.jpg"]


def write_records(folder: Path, n: int) -> Path:
    """`n` one-picture chats and their pictures, enlarged to 1024 x 1024, in `folder`."""
    for name in PICTURES:
        if not (folder / name).exists():
            Image.open(IMAGES_DIR / name).convert("RGB").resize((1024, 1024)).save(
                folder / name, quality=90)
    records = [{"messages": [
        {"role": "user", "content": [{"type": "image", "image": PICTURES[i % len(PICTURES)]},
                                     {"type": "text", "text": f"What is in picture {i}?"}]},
        {"role": "assistant", "content": f"Picture {i} shows one of the sample photos."}]}
        for i in range(n)]
    path = folder / "pictures.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def vlm_job(job_id: str, world_size: int, records: Path, pixel_dtype: str = "uint8",
            **batching: object) -> dict:
    """A job at the default budget and image limits unless `batching` says otherwise."""
    return {"job_id": job_id, "world_size": world_size, "source": {"paths": [str(records)]},
            "preprocess": {"pixel_dtype": pixel_dtype}, "batching": batching}


def preprocess(job: dict) -> list[ProcessedSample]:
    """Every record of the job's source through the real preprocessing, in order."""
    cfg = TrainingJobConfig.model_validate(job)
    path = Path(cfg.source.paths[0])
    rows = [(i, line.encode()) for i, line in enumerate(path.read_text().splitlines())]
    out = Processor(cfg, 0).process(SourceFile(path.name, str(path), "jsonl"), rows)
    assert all(isinstance(s, ProcessedSample) for s in out), out
    return out


def repeated(samples: list[ProcessedSample], n: int) -> list[ProcessedSample]:
    """`n` samples cycling through `samples` under ids of their own (their payloads shared):
    many batches of real preprocessed pictures without preprocessing each again."""
    return [dataclasses.replace(samples[i % len(samples)], sample_id=f"pic:{i}", row=i)
            for i in range(n)]
