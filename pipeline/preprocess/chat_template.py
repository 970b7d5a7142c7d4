"""Which chat template to render with, and rendering a conversation to text whose content is
known to the character.

`chat_template`: None = the tokenizer's own; 'qwen3' / 'qwen2' = the files shipped in
templates/ (qwen2 is the Qwen2-VL template, which also understands image content parts);
anything else = a path to a .jinja file.

Content is opaque to the template. The template is rendered with every segment of every turn
replaced by a marker (private-use characters and the segment's number), so whatever the template
writes (roles, headers, separators, special tokens) comes from the template alone and the data
never reaches Jinja. The markers are then replaced by the segments: a text segment by its text,
recorded as a `ContentSpan` (the one place the data is in the rendered text: tokenized as plain
text, labelled by its turn), an image by the Qwen placeholder
`<|vision_start|><|image_pad|><|vision_end|>`, which is structure like the template's own tokens
(the single `<|image_pad|>` is expanded to the image's visual tokens after tokenization,
vision.py). So a message cannot forge a turn, a header or an image slot, whatever it contains.
A template that inspects content (Qwen3 moving `<think>...</think>` out of an answer, a
`startswith` test) sees the marker: content it would have rewritten is kept as written.

So the template's output depends only on the conversation's shape (each turn's role and number
of segments), not on its content: the rendered skeleton is kept per shape (`_skeleton`, an LRU of
`SKELETON_CACHE` shapes per process) and a record of a known shape costs only the splice of its
content, not a Jinja render (~0.1 ms a record in a tight loop, ~0.4 ms between images, whose
work evicts Jinja's code from the caches). A template that calls `strftime_now` or `random`
is rendered every time (its output may change between calls).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import PreprocessConfig
from pipeline.errors import UserError
from pipeline.preprocess.records import Conversation, Segment

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END

_TEMPLATES = Path(__file__).with_name("templates")
NAMED = {"qwen2": "qwen2.jinja", "qwen3": "qwen3.jinja"}

# Private-use characters: no tokenizer or template gives them meaning, and the data never enters
# the text they are searched in (only the template's own output does).
_MARK = "\ue000{}\ue001"
_MARKER = re.compile("\ue000([0-9]+)\ue001")


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


@dataclass(frozen=True, slots=True)
class ContentSpan:
    """Where one text segment of turn `turn` landed: characters [start, end) of the text."""

    turn: int
    start: int
    end: int


@dataclass(frozen=True)
class RenderedChat:
    """The exact training text and where the data is in it (in text order). Everything outside
    `content` was written by the template (or is an image placeholder)."""

    text: str
    content: tuple[ContentSpan, ...]
    roles: tuple[str, ...]  # role of each turn of the conversation

    def turn_extent(self, turn: int) -> tuple[int, int] | None:
        """[start, end) from the turn's first content character to its last (None: the template
        left the turn's content out)."""
        spans = [c for c in self.content if c.turn == turn]
        return (spans[0].start, spans[-1].end) if spans else None


SKELETON_CACHE = 1024  # conversation shapes kept per process (a dataset has a handful)
# Template calls whose output may change between renders (a substring test: a false alarm only
# costs the cache).
_VOLATILE = ("strftime_now", "random")


def render(conv: Conversation, tokenizer, template: str) -> RenderedChat:
    """The exact training text (no generation prompt: the last turn is the assistant's), with
    every text segment placed by the template as opaque content (see the module doc)."""
    pieces: list[tuple[int, str | None]] = []  # per marker: (turn, text | None for an image)
    shape = []
    for t, turn in enumerate(conv.turns):
        # An empty turn still gets a marker: its place in the text is where its labels start.
        for seg in turn.segments or (Segment(),):
            pieces.append((t, None if seg.image is not None else seg.text))
        shape.append((turn.role, max(1, len(turn.segments))))
    cached = not _volatile(template)
    literals, markers = (_skeleton if cached else _render_skeleton)(tuple(shape), tokenizer,
                                                                    template)
    out: list[str] = []
    spans: list[ContentSpan] = []
    length = 0
    for literal, marker in zip(literals, markers, strict=False):
        out.append(literal)
        length += len(literal)
        turn, text = pieces[marker]
        if text is None:
            out.append(IMAGE_PLACEHOLDER)
            length += len(IMAGE_PLACEHOLDER)
        else:
            out.append(text)
            spans.append(ContentSpan(turn, length, length + len(text)))
            length += len(text)
    out.append(literals[-1])
    return RenderedChat("".join(out), tuple(spans), tuple(t.role for t in conv.turns))


def _render_skeleton(shape: tuple[tuple[str, int], ...], tokenizer, template: str
                     ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The template's text for a conversation of `shape`, every segment a numbered marker, as
    (the template's own text between the markers: one more than the markers, which markers)."""
    messages, n = [], 0
    for role, segments in shape:
        messages.append({"role": role, "content": "".join(_MARK.format(n + i)
                                                          for i in range(segments))})
        n += segments
    skeleton = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=False)
    literals: list[str] = []
    markers: list[int] = []
    pos = 0
    for m in _MARKER.finditer(skeleton):
        literals.append(skeleton[pos:m.start()])
        markers.append(int(m.group(1)))
        pos = m.end()
    literals.append(skeleton[pos:])
    return tuple(literals), tuple(markers)


@functools.lru_cache(maxsize=16)
def _volatile(template: str) -> bool:
    """Whether the template calls something whose output may change between renders (once per
    template, not once per record)."""
    return any(word in template for word in _VOLATILE)


# Keyed by the tokenizer object (one per process and directory, tokenizer.py) and the template
# text (its hash is cached by the str); a template that raises is not cached and raises again.
_skeleton = functools.lru_cache(maxsize=SKELETON_CACHE)(_render_skeleton)
