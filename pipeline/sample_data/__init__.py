"""A small real chat dataset shipped with the package (text + scikit-image pictures).

`chats.jsonl` was made once by `python -m pipeline.sample_data.generate --shipped` and is
committed; it mixes OpenAI-style and ShareGPT-style records, ~15% with images, and a few
deliberately bad records so quarantine has something to show.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
SAMPLE_CHATS = DATA_DIR / "chats.jsonl"
IMAGES_DIR = DATA_DIR / "images"


def sample_chats_path() -> str:
    return str(SAMPLE_CHATS)
