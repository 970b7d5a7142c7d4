"""Which chat template to render with, and rendering a conversation to text.

`chat_template`: None = the tokenizer's own; 'qwen3' / 'qwen2' = the files shipped in
templates/ (qwen2 is the Qwen2-VL template, which also understands image content parts);
anything else = a path to a .jinja file. Images are passed to every template as the Qwen
placeholder text `<|vision_start|><|image_pad|><|vision_end|>` inside string content, so templates
that only accept string content (Qwen3's) still work; the single `<|image_pad|>` is expanded to
the image's visual tokens after tokenization (vision.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

from pipeline.config import PreprocessConfig
from pipeline.errors import UserError
from pipeline.preprocess.records import Conversation

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END

_TEMPLATES = Path(__file__).with_name("templates")
NAMED = {"qwen2": "qwen2.jinja", "qwen3": "qwen3.jinja"}


@functools.lru_cache(maxsize=16)
def _read(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"preprocess.chat_template = {path!r}: not 'qwen2', 'qwen3' or a file")
    return p.read_text(encoding="utf-8")


def template_text(cfg: PreprocessConfig, tokenizer) -> str:
    name = cfg.chat_template
    if name is None:
        text = getattr(tokenizer, "chat_template", None)
        if not text:
            raise UserError("the tokenizer has no chat template; set preprocess.chat_template")
        return text
    if name in NAMED:
        return _read(str(_TEMPLATES / NAMED[name]))
    return _read(name)


def to_messages(conv: Conversation) -> list[dict[str, str]]:
    """Conversation -> template input: role + string content with image placeholders inline."""
    return [
        {"role": t.role,
         "content": "".join(IMAGE_PLACEHOLDER if s.image is not None else s.text
                            for s in t.segments)}
        for t in conv.turns
    ]


def render(conv: Conversation, tokenizer, template: str) -> str:
    """The exact training text (no generation prompt: the last turn is the assistant's)."""
    return tokenizer.apply_chat_template(
        to_messages(conv), chat_template=template, tokenize=False, add_generation_prompt=False
    )
