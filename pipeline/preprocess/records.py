"""Parse one raw source record into a normalized conversation, or say precisely why not.

Two input shapes are accepted:
- OpenAI style: ``{"messages": [{"role": ..., "content": str | [parts]}], "images"?: [...]}``
  where an image part is ``{"type": "image", "image": REF}``, ``{"type": "image_url",
  "image_url": {"url": REF}}`` or a bare ``{"type": "image"}`` that takes the next top-level image.
- ShareGPT style: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}],
  "images"?: [...], "image"?: REF}`` with ``<image>`` placeholders in the text (LLaVA
  convention; images with no placeholder are put before the first user turn's text).
Both take an optional top-level ``system`` string. An image REF is a file path (relative to the
source file's folder), a ``data:...;base64,`` URI, raw bytes, or ``{"bytes": ..., "path": ...}``
(the Hugging Face ``Image`` feature layout Parquet files carry).

Every failure raises `RecordError` with a reason from `pipeline.quarantine.QuarantineReason`, so
the caller can quarantine the record instead of crashing the stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pipeline.quarantine import QuarantineReason as R

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "model": "assistant", "bot": "assistant"}
_ROLES = ("system", "user", "assistant")
IMAGE_TAG = "<image>"


class RecordError(Exception):
    """A record that cannot become a sample: its reason (a vocabulary word) and the detail."""

    def __init__(self, reason: R, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ImageRef:
    """Where an image comes from; decoded later (vision.py) so parsing stays cheap."""

    path: str | None = None
    data: bytes | None = None

    def describe(self) -> str:
        return self.path if self.path is not None else f"<{len(self.data or b'')} bytes>"


@dataclass(frozen=True)
class Segment:
    """A piece of a turn: text, or one image at that point of the text."""

    text: str = ""
    image: ImageRef | None = None


@dataclass(frozen=True)
class Turn:
    role: str  # system | user | assistant
    segments: tuple[Segment, ...] = field(default_factory=tuple)

    @property
    def num_images(self) -> int:
        return sum(1 for s in self.segments if s.image is not None)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]

    @property
    def images(self) -> list[ImageRef]:
        return [s.image for t in self.turns for s in t.segments if s.image is not None]


def decode_line(raw: bytes) -> dict[str, Any]:
    """JSONL line bytes -> JSON object (strict UTF-8, so mojibake is caught, not trained on)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(R.BAD_UTF8, f"line is not valid UTF-8 ({exc.reason} at byte "
                                    f"{exc.start})") from None
    if not text.strip():
        raise RecordError(R.BAD_JSON, "empty line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(R.BAD_JSON, f"{exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise RecordError(R.BAD_RECORD, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _image_ref(value: Any) -> ImageRef:
    import base64

    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageRef(data=bytes(value))
    if isinstance(value, str):
        if value.startswith("data:"):
            _, _, b64 = value.partition(",")
            try:
                return ImageRef(data=base64.b64decode(b64, validate=True))
            except ValueError:
                raise RecordError(R.BAD_IMAGE, "data: URI is not valid base64") from None
        if value.startswith(("http://", "https://")):
            raise RecordError(R.MISSING_IMAGE, f"remote image URLs are not fetched: {value[:80]}")
        if not value:
            raise RecordError(R.MISSING_IMAGE, "empty image path")
        return ImageRef(path=value)
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            data = value["bytes"]
            if isinstance(data, str):
                try:
                    data = base64.b64decode(data, validate=True)
                except ValueError:
                    raise RecordError(R.BAD_IMAGE, "image bytes are not valid base64") from None
            return _image_ref(bytes(data))
        for key in ("path", "url", "image"):
            if value.get(key):
                return _image_ref(value[key])
    raise RecordError(R.MISSING_IMAGE, f"unusable image reference: {str(value)[:80]}")


def _top_images(rec: dict[str, Any]) -> list[Any]:
    imgs = rec.get("images")
    if imgs is None and rec.get("image") is not None:
        imgs = [rec["image"]]
    if imgs is None:
        return []
    if not isinstance(imgs, (list, tuple)):
        imgs = [imgs]
    return list(imgs)


def _text_segments(text: str, pool: list[Any]) -> list[Segment]:
    """Split text on `<image>` tags, each tag consuming the next image of `pool`."""
    parts = text.split(IMAGE_TAG)
    segs: list[Segment] = []
    for i, part in enumerate(parts):
        if i > 0:
            if not pool:
                raise RecordError(R.MISSING_IMAGE, "more <image> tags than images")
            segs.append(Segment(image=_image_ref(pool.pop(0))))
        if part:
            segs.append(Segment(text=part))
    return segs


def _openai_turn(msg: Any, pool: list[Any], idx: int) -> Turn:
    if not isinstance(msg, dict) or "role" not in msg:
        raise RecordError(R.MISSING_ROLES, f"messages[{idx}] has no 'role'")
    role = msg["role"]
    if role not in _ROLES:
        raise RecordError(R.MISSING_ROLES, f"messages[{idx}] has unsupported role {role!r}")
    content = msg.get("content")
    if content is None:
        raise RecordError(R.BAD_RECORD, f"messages[{idx}] has no 'content'")
    if isinstance(content, str):
        return Turn(role, tuple(_text_segments(content, pool)))
    if not isinstance(content, list):
        raise RecordError(R.BAD_RECORD, f"messages[{idx}].content must be a string or a list")
    segs: list[Segment] = []
    for part in content:
        if isinstance(part, str):
            segs.append(Segment(text=part))
            continue
        if not isinstance(part, dict):
            raise RecordError(R.BAD_RECORD, f"messages[{idx}] has a content part of bad type")
        kind = part.get("type") or ("image" if "image" in part else "text")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RecordError(R.BAD_RECORD, f"messages[{idx}] text part has no string 'text'")
            segs.append(Segment(text=part["text"]))
        elif kind in ("image", "image_url"):
            ref = part.get("image") or part.get("image_url") or part.get("path")
            if ref is None:
                if not pool:
                    raise RecordError(R.MISSING_IMAGE, f"messages[{idx}] image part without an "
                                                     "image and no top-level images left")
                ref = pool.pop(0)
            segs.append(Segment(image=_image_ref(ref)))
        else:
            raise RecordError(R.BAD_RECORD, f"messages[{idx}] has unsupported part type {kind!r}")
    return Turn(role, tuple(segs))


def parse_record(rec: dict[str, Any]) -> Conversation:
    """A decoded record (JSON object or Parquet row) -> a validated `Conversation`."""
    pool = _top_images(rec)
    turns: list[Turn] = []
    if rec.get("messages") is not None:
        msgs = rec["messages"]
        if not isinstance(msgs, (list, tuple)):
            raise RecordError(R.BAD_RECORD, "'messages' must be a list")
        turns = [_openai_turn(m, pool, i) for i, m in enumerate(msgs)]
    elif rec.get("conversations") is not None:
        convs = rec["conversations"]
        if not isinstance(convs, (list, tuple)):
            raise RecordError(R.BAD_RECORD, "'conversations' must be a list")
        for i, c in enumerate(convs):
            if not isinstance(c, dict) or "from" not in c:
                raise RecordError(R.MISSING_ROLES, f"conversations[{i}] has no 'from'")
            role = _SHAREGPT_ROLES.get(str(c["from"]).lower())
            if role is None:
                raise RecordError(R.MISSING_ROLES,
                                  f"conversations[{i}] has unsupported 'from' {c['from']!r}")
            if not isinstance(c.get("value"), str):
                raise RecordError(R.BAD_RECORD, f"conversations[{i}] has no string 'value'")
            turns.append(Turn(role, tuple(_text_segments(c["value"], pool))))
    else:
        raise RecordError(R.MISSING_ROLES, "record has neither 'messages' nor 'conversations'")

    if pool:
        placed = sum(t.num_images for t in turns)
        if placed:
            raise RecordError(R.BAD_RECORD, f"{placed + len(pool)} images but only {placed} "
                                          "image placeholders")
        # No placeholder at all: the images go before the first user turn's text (LLaVA style).
        first_user = next((i for i, t in enumerate(turns) if t.role == "user"), None)
        if first_user is not None:
            extra = tuple(Segment(image=_image_ref(v)) for v in pool)
            turns[first_user] = Turn("user", extra + turns[first_user].segments)

    system = rec.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise RecordError(R.BAD_RECORD, "'system' must be a string")
        if system and not (turns and turns[0].role == "system"):
            turns.insert(0, Turn("system", (Segment(text=system),)))

    roles = [t.role for t in turns]
    if "user" not in roles or "assistant" not in roles:
        raise RecordError(R.MISSING_ROLES, f"needs a user and an assistant turn, got {roles}")
    if "system" in roles[1:]:
        raise RecordError(R.MISSING_ROLES, "a system turn may only come first")
    if any(t.num_images for t in turns if t.role == "system"):
        raise RecordError(R.BAD_RECORD, "images in a system turn are not supported")
    return Conversation(tuple(turns))
