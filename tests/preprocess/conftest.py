"""Shared helpers: jobs, tiny real images (scikit-image), JSONL writers, one Processor per job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import TrainingJobConfig
from pipeline.preprocess.sources import SourceFile

SOURCE_OPTIONS = ("shuffle", "read_unit_rows", "shuffle_block_rows", "shuffle_block_mb")


def make_job(paths: list[str] | None = None, **preprocess: Any) -> TrainingJobConfig:
    extra = {k: preprocess.pop(k) for k in ("seed", "batching") if k in preprocess}
    source = {k: preprocess.pop(k) for k in SOURCE_OPTIONS if k in preprocess}
    return TrainingJobConfig.model_validate({
        "job_id": "t", "world_size": 1,
        "source": {"paths": paths or ["unused.jsonl"], **source},
        "preprocess": preprocess, **extra,
    })


def chat(user: str = "Hi", assistant: str = "Hello!", **extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": assistant}], **extra}


def write_jsonl(path: Path, records: list[Any]) -> Path:
    lines = [r if isinstance(r, bytes) else json.dumps(r).encode() for r in records]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def src(path: Path | str = "mem.jsonl") -> SourceFile:
    # The file's name, not its tmp path, names the samples: augmentation is seeded by the
    # sample id, so a test's draws must not change with pytest's tmp directory.
    return SourceFile(Path(path).name, str(path), "jsonl")


@pytest.fixture(scope="session")
def image_dir(tmp_path_factory) -> Path:
    """astronaut (RGB, 512x512 -> 128x128), page (grayscale), and a truncated JPEG."""
    import skimage.data as d
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    Image.fromarray(d.astronaut()).resize((128, 128)).save(folder / "astro.png")
    Image.fromarray(d.astronaut()).save(folder / "astro_full.jpg", quality=85)
    Image.fromarray(d.page()).save(folder / "page.png")
    whole = (folder / "astro_full.jpg").read_bytes()
    (folder / "broken.jpg").write_bytes(whole[: len(whole) // 3])
    (folder / "not_an_image.png").write_bytes(b"hello, I am text")
    return folder


_processors: dict[tuple, Any] = {}


def processor_for(job: TrainingJobConfig, epoch: int = 0):
    """Processors are cheap once the tokenizer is cached, but building the image processor is
    not; share them across tests of the session."""
    from pipeline.preprocess.process import Processor

    key = (job.model_dump_json(), epoch)
    if key not in _processors:
        _processors[key] = Processor(job, epoch)
    return _processors[key]
