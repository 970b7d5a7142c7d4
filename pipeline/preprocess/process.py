"""One chunk of raw records -> ProcessedSample | QuarantinedRecord, the same code everywhere.

Ray actors (pipeline.py), the plain/multiprocessing benchmark baselines and `SampleStore`'s random
access all call `Processor.process`, so a sample rebuilt by id is byte-identical to the streamed
one. Work per chunk: parse -> augment -> decode images -> render template (per record), then ONE
batched tokenizer call for the chunk (the per-call overhead dominated short chats), then labels,
visual-token expansion, truncation and cost (per record, numpy). A Ray task runs its chunk in
parts (`process_parts`) closed by the bytes its prepared records hold, so a chunk of large images
yields bounded pieces as it goes; a chunk of chats is one part, as before.

Truncation happens here and nowhere else (not in the planner, not in the collate): a sample is
cut to its job's `max_sample_tokens()` tokens and `max_sample_visual_tokens()` visual tokens
(`TrainingJobConfig`, `RefillJobConfig`: the one owner of the limit), vision-safely
(truncation.py). Policy, in order:
- longer than preprocess.max_seq_len under preprocess.truncation=quarantine -> `too_long`;
- otherwise over a limit -> keep the longest prefix that splits no image (images that do not fit
  are dropped whole with their pixels), flagged `truncated`;
- that prefix has no assistant token (e.g. a first image too big for the limit precedes every
  answer) -> `no_loss_tokens`. Under `over_budget: alone` the limit is max_seq_len, so a sample
  over the budget stays whole and the planner emits it alone, flagged.
A sample with no trained token at all, whatever the template, is `no_loss_tokens` before any
of this: nothing is ever trained on it.

Content is data, never structure (chat_template.py, tokenizer.py): special-token strings in a
record's text (`<|im_start|>`, `<|image_pad|>`, ...) are tokenized as plain text, or the record
is quarantined as `special_tokens_in_content` (preprocess.special_tokens_in_content).
Building a `Processor` checks that the limit can hold the chat template's shortest trainable
sample (ConfigError naming the fields otherwise).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.config import ConfigError, JobConfig
from pipeline.preprocess import augment
from pipeline.preprocess.chat_template import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    RenderedChat,
    render,
    template_text,
)
from pipeline.preprocess.labels import IGNORE, assistant_spans, label_tokens
from pipeline.preprocess.records import (
    Conversation,
    RecordError,
    Segment,
    Turn,
    decode_line,
    parse_record,
)
from pipeline.preprocess.sample import ProcessedSample, QuarantinedRecord
from pipeline.preprocess.sources import SourceFile
from pipeline.preprocess.task_size import TOKEN_BYTES
from pipeline.preprocess.tokenizer import ChatTokenizer
from pipeline.preprocess.truncation import Cut, image_spans, vision_safe_cut
from pipeline.preprocess.vision import VisionProcessor, decode_image
from pipeline.quarantine import QuarantineReason as R

Item = ProcessedSample | QuarantinedRecord


COPY_SEP = "#"


def make_sample_id(source: str, row: int, copy: int = 0) -> str:
    """`<source>:<row>`, and `<source>:<row>#<k>` for the k-th copy (k >= 1) of a row in an
    epoch (a mixture's repeat): a sample of its own, augmented by its own id."""
    return f"{source}:{row}{COPY_SEP}{copy}" if copy else f"{source}:{row}"


def split_sample_id(sample_id: str) -> tuple[str, int, int]:
    """(source, row, copy) of a sample id (copy 0 when it names none)."""
    head, sep, copy = sample_id.rpartition(COPY_SEP)
    if not (sep and copy.isdigit() and head.rpartition(":")[2].isdigit()):
        head, copy = sample_id, "0"
    source, sep, row = head.rpartition(":")
    if not sep or not row.isdigit():
        raise KeyError(f"not a sample id (<source>:<row>[#<copy>]): {sample_id!r}")
    return source, int(row), int(copy)


# One raw record to process: its file, row, copy in the epoch, and raw value (bytes / dict).
RawRow = tuple[SourceFile, int, int, Any]


@dataclass
class _Prepared:
    file: SourceFile
    row: int
    copy: int
    chat: RenderedChat
    spans: list[tuple[int, int]]
    pixel_values: np.ndarray | None
    grid: np.ndarray | None

    @property
    def nbytes(self) -> int:
        """About the most this record's sample holds: its pixels, its text's ids and labels."""
        pixels = 0 if self.pixel_values is None else self.pixel_values.nbytes
        return pixels + TOKEN_BYTES * len(self.chat.text)


class Processor:
    """Everything needed to preprocess records of one job and epoch; build once per process.

    Raises ConfigError when the job's sample limit cannot hold the chat template's shortest
    trainable sample, so building one at start validates the job.
    """

    def __init__(self, job: JobConfig, epoch: int) -> None:
        self.job = job
        self.epoch = epoch
        self.cfg = job.preprocess
        self.chat_tokenizer = ChatTokenizer(self.cfg)
        self.tokenizer = self.chat_tokenizer.tokenizer
        self.template = template_text(self.cfg, self.tokenizer)
        self.eos = self.tokenizer.eos_token
        ids = self.tokenizer.convert_tokens_to_ids([IMAGE_PAD, VISION_START, VISION_END])
        self.image_pad_id, self.vision_start_id, self.vision_end_id = ids
        self._vision: VisionProcessor | None = None
        self.max_tokens = job.max_sample_tokens()
        floor = self._template_floor()
        if self.max_tokens < floor:
            raise ConfigError(
                f"jobs[{job.job_id}]: the sample {job.sample_limit_text()} is below the {floor} "
                f"tokens the chat template needs up to its first trained token: every record "
                f"would be quarantined; raise that limit")

    @property
    def vision(self) -> VisionProcessor:
        if self._vision is None:  # text-only jobs never build the image processor
            self._vision = VisionProcessor(self.cfg)
        return self._vision

    # -- per record -------------------------------------------------------------------------

    def _prepare(self, file: SourceFile, row: int, copy: int, raw: Any) -> _Prepared:
        rec = decode_line(raw) if isinstance(raw, (bytes, bytearray)) else raw
        if not isinstance(rec, dict):
            raise RecordError(R.BAD_RECORD, f"expected a record, got {type(rec).__name__}")
        conv = parse_record(rec)
        if self.cfg.special_tokens_in_content == "quarantine":
            self._refuse_special_tokens(conv)
        sid = make_sample_id(file.source, row, copy)
        # Decode every image (even ones augmentation drops this epoch) so whether a record is
        # quarantined never depends on the epoch.
        images = [decode_image(ref, file.path) for ref in conv.images]
        aplan = augment.plan(self.cfg.augment, conv, self.job.seed, self.epoch, sid)
        conv, scales = augment.apply(conv, aplan)
        images = images[: len(scales)]
        pixel_values = grid = None
        if images:
            pixel_values, grid = self.vision.process(images, scales)
        try:
            chat = render(conv, self.tokenizer, self.template)
        except Exception as exc:  # any Jinja/template failure quarantines the record
            raise RecordError(R.TEMPLATE_ERROR, f"{type(exc).__name__}: {exc}") from None
        return _Prepared(file, row, copy, chat, assistant_spans(chat, self.eos), pixel_values,
                         grid)

    def _refuse_special_tokens(self, conv: Conversation) -> None:
        for i, turn in enumerate(conv.turns):
            for seg in turn.segments:
                token = self.chat_tokenizer.first_special(seg.text)
                if token is not None:
                    raise RecordError(R.SPECIAL_TOKENS_IN_CONTENT,
                                      f"turn {i} ({turn.role}) contains the special token "
                                      f"{token}")

    def _finish(self, p: _Prepared, input_ids: np.ndarray, offsets: np.ndarray) -> Item:
        labels = label_tokens(input_ids, offsets, p.spans)
        if not (labels != IGNORE).any():
            raise RecordError(R.NO_LOSS_TOKENS, "the rendered chat has no assistant token to "
                                                "train on")
        n_images = 0 if p.grid is None else len(p.grid)
        pads = np.flatnonzero(input_ids == self.image_pad_id)
        if len(pads) != n_images:  # only the template can write one: content is plain text
            raise RecordError(R.TEMPLATE_ERROR, f"the template wrote {len(pads)} image "
                                                f"placeholders for {n_images} images")
        pixel_values, grid = p.pixel_values, p.grid
        per_image = self.vision.visual_tokens(grid) if n_images else np.zeros(0, np.int64)
        if n_images:
            reps = np.ones(len(input_ids), dtype=np.int64)
            reps[pads] = per_image
            input_ids = np.repeat(input_ids, reps)
            labels = np.repeat(labels, reps)
            labels[input_ids == self.image_pad_id] = IGNORE  # never train on image positions
        n = len(input_ids)
        if n > self.cfg.max_seq_len and self.cfg.truncation == "quarantine":
            raise RecordError(R.TOO_LONG, f"{n} tokens > preprocess.max_seq_len "
                                          f"{self.cfg.max_seq_len}")
        max_visual = self.job.max_sample_visual_tokens()
        truncated = n > self.max_tokens or (max_visual is not None
                                            and int(per_image.sum()) > max_visual)
        if truncated:
            spans = image_spans(pads, per_image, input_ids, self.vision_start_id,
                                self.vision_end_id)
            cut = vision_safe_cut(n, spans, per_image, self.max_tokens, max_visual)
            input_ids, labels = input_ids[: cut.tokens], labels[: cut.tokens]
            if cut.images < n_images:  # whole images only: their patch rows and grid rows
                rows = int(np.prod(grid[: cut.images], axis=1).sum())
                pixel_values, grid = ((pixel_values[:rows], grid[: cut.images]) if cut.images
                                      else (None, None))
            if not (labels != IGNORE).any():
                raise RecordError(R.NO_LOSS_TOKENS, self._cut_detail(n, spans, per_image, cut))
        return ProcessedSample(
            sample_id=make_sample_id(p.file.source, p.row, p.copy), source=p.file.source,
            row=p.row,
            input_ids=np.ascontiguousarray(input_ids, dtype=np.int32),
            labels=np.ascontiguousarray(labels, dtype=np.int32),
            num_visual_tokens=int((input_ids == self.image_pad_id).sum()),
            cost=self.job.sample_cost(len(input_ids)),
            pixel_values=pixel_values, image_grid_thw=grid, truncated=truncated,
        )

    def _cut_detail(self, n: int, spans: list[tuple[int, int]], per_image: np.ndarray,
                    cut: Cut) -> str:
        why = f"{n} tokens cut to {cut.tokens} ({self.job.sample_limit_text()})"
        if cut.images < len(spans):
            a, b = spans[cut.images]
            why += (f"; image {cut.images + 1} ({int(per_image[cut.images])} visual tokens, "
                    f"tokens {a}-{b}) does not fit and was dropped with any after it")
        return why + "; no assistant token is left"

    def _template_floor(self) -> int:
        """Tokens the chat template puts before the first trained token of the shortest chat
        (empty question, one-letter answer) plus that token: no trainable sample is shorter.
        1 when the template will not render that chat (nothing to check against)."""
        conv = Conversation((Turn("user", (Segment(text=""),)),
                             Turn("assistant", (Segment(text="a"),))))
        try:
            chat = render(conv, self.tokenizer, self.template)
        except Exception:  # a strict custom template: records will say what it refuses
            return 1
        (ids, offs), = self.chat_tokenizer.encode([chat])
        trained = np.flatnonzero(label_tokens(ids, offs, assistant_spans(chat, self.eos))
                                 != IGNORE)
        return int(trained[0]) + 1 if len(trained) else 1

    # -- per chunk --------------------------------------------------------------------------

    def process(self, file: SourceFile, rows: Sequence[tuple[int, Any]]) -> list[Item]:
        """Rows of one file (copy 0 each)."""
        return self.process_rows([(file, row, 0, raw) for row, raw in rows])

    def process_rows(self, rows: Sequence[RawRow]) -> list[Item]:
        """Rows of any files and copies, in order."""
        return self._finish_part([self._try_prepare(*r) for r in rows])

    def process_parts(self, rows: Sequence[RawRow], part_bytes: int) -> Iterator[list[Item]]:
        """`process_rows` in parts, each yielded once done: records are prepared one by one
        (parsed, images decoded and patchified) and a part is finished (one batched tokenizer
        call) as soon as what it holds reaches `part_bytes` (its pixels, and 8 bytes per
        character of text: int32 ids and labels, at most a token per character). A part holds at
        most `part_bytes` plus one record, whatever the chunk's rows turn out to carry; the
        items are those `process_rows` returns for the same rows (task_size.py)."""
        part: list[_Prepared | QuarantinedRecord] = []
        held = 0
        for r in rows:
            prepared = self._try_prepare(*r)
            part.append(prepared)
            held += prepared.nbytes if isinstance(prepared, _Prepared) else 0
            if held >= part_bytes:
                yield self._finish_part(part)
                part, held = [], 0
        if part:
            yield self._finish_part(part)

    def _try_prepare(self, file: SourceFile, row: int, copy: int, raw: Any
                     ) -> _Prepared | QuarantinedRecord:
        try:
            return self._prepare(file, row, copy, raw)
        except RecordError as exc:
            return QuarantinedRecord(file.source, row, exc.reason, exc.detail)
        except Exception as exc:  # a failure we did not foresee: keep the stream going
            return QuarantinedRecord(file.source, row, R.PREPROCESS_ERROR,
                                     f"{type(exc).__name__}: {exc}")

    def _finish_part(self, part: Sequence[_Prepared | QuarantinedRecord]) -> list[Item]:
        """Prepared records -> items, with ONE batched tokenizer call for their chats."""
        prepared = [p for p in part if isinstance(p, _Prepared)]
        chats = [p.chat for p in prepared]
        encoded: list[tuple[np.ndarray, np.ndarray] | Exception]
        try:
            encoded = list(self.chat_tokenizer.encode(chats))
        except Exception:  # one bad text fails the batch call: find which
            encoded = []
            for chat in chats:
                try:
                    encoded.append(self.chat_tokenizer.encode([chat])[0])
                except Exception as exc:  # that record is quarantined
                    encoded.append(exc)
        results = iter(encoded)  # in the order of `prepared`
        return [p if isinstance(p, QuarantinedRecord) else self._finish_one(p, next(results))
                for p in part]

    def _finish_one(self, p: _Prepared, enc: tuple[np.ndarray, np.ndarray] | Exception) -> Item:
        try:
            if isinstance(enc, Exception):
                raise RecordError(R.TOKENIZE_ERROR, f"{type(enc).__name__}: {enc}")
            return self._finish(p, enc[0], enc[1])
        except RecordError as exc:
            return QuarantinedRecord(p.file.source, p.row, exc.reason, exc.detail)
        except Exception as exc:  # see _try_prepare
            return QuarantinedRecord(p.file.source, p.row, R.PREPROCESS_ERROR,
                                     f"{type(exc).__name__}: {exc}")

    def process_one(self, file: SourceFile, row: int, raw: Any, copy: int = 0) -> Item:
        return self.process_rows([(file, row, copy, raw)])[0]
