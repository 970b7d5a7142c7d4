"""The benchmark's text, all shipped with the repo: the sample chats (text records), prepared by
the project's real preprocessing (Qwen tokenizer, chat template) into training pairs, and a
request file for the refill job (the same chats with a planned generation length each)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.config import RefillJobConfig
from pipeline.preprocess.process import Processor
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.sources import expand_sources, plan_chunks, read_chunk
from pipeline.producer.refill_producer import prompt_and_answer

ROOT = Path(__file__).resolve().parents[2]
CHATS = ROOT / "pipeline" / "sample_data" / "chats.jsonl"
GEN_LENGTHS = (32, 64, 128, 256)  # multiples of the decoding block


def text_records() -> list[dict]:
    """The shipped chats without images (their pixels are not part of a refill request)."""
    out = []
    for line in CHATS.read_bytes().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the deliberately bad row
        if "images" not in rec:
            out.append(rec)
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def processed(path: Path) -> list[ProcessedSample]:
    job = RefillJobConfig(job_id="prep", source={"paths": [str(path)]})
    proc = Processor(job, 0)
    out = []
    for chunk in plan_chunks(expand_sources(job.source), 64):
        out += [s for s in proc.process(chunk.file, read_chunk(chunk))
                if isinstance(s, ProcessedSample)]
    return out


def training_pairs(samples: list[ProcessedSample]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, reference answer) Qwen ids per sample: the split a refill request makes."""
    pairs = []
    for s in samples:
        prompt, n = prompt_and_answer(s)
        if n:
            pairs.append((prompt, s.input_ids[len(prompt):]))
    return pairs


def request_records(records: list[dict], n: int, seed: int) -> list[dict]:
    """`n` requests: the chats (the prompt is everything before the last answer), each with a
    planned `max_new_tokens` (mixed generation lengths; prompt lengths vary with the chats)."""
    rng = np.random.default_rng(seed)
    return [{**records[i % len(records)], "max_new_tokens": int(rng.choice(GEN_LENGTHS))}
            for i in range(n)]
