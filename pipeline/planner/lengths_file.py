"""Reading a lengths file for `odb-pipeline plan`.

Two formats, told apart by the first non-blank line:
- plain: one integer per line; the sample id is the 0-based line number;
- JSONL: one object per line with `sample_id`, `num_tokens` and optional `num_visual_tokens`.
Blank lines are skipped (they still count as line numbers). Errors name the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.planner.types import MeasuredSample


class LengthsFileError(ValueError):
    """The file is missing or malformed; the message names the file and the line."""


def read_lengths(path: str | Path) -> list[MeasuredSample]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LengthsFileError(f"lengths file not found: {p}") from None
    except IsADirectoryError:
        raise LengthsFileError(f"lengths file is a directory: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LengthsFileError(f"cannot read lengths file {p}: {exc}") from None
    return parse_lengths(text.splitlines(), name=str(p))


def parse_lengths(lines: list[str], name: str = "<lengths>") -> list[MeasuredSample]:
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    if first.startswith("{"):
        return _parse_jsonl(lines, name)
    out: list[MeasuredSample] = []
    for i, raw in enumerate(lines):
        s = raw.strip()
        if not s:
            continue
        try:
            n = int(s)
        except ValueError:
            raise LengthsFileError(
                f"{name}: line {i + 1}: expected an integer token count, got {s[:40]!r}"
            ) from None
        if n < 0:
            raise LengthsFileError(f"{name}: line {i + 1}: token count must be >= 0, got {n}")
        out.append(MeasuredSample(i, n))
    return out


def _int_field(obj: dict, key: str, name: str, line: int, default: int | None = None) -> int:
    if key not in obj:
        if default is not None:
            return default
        raise LengthsFileError(f"{name}: line {line}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise LengthsFileError(f"{name}: line {line}: {key} must be an integer, got {v!r}")
    if v < 0:
        raise LengthsFileError(f"{name}: line {line}: {key} must be >= 0, got {v}")
    return v


def _parse_jsonl(lines: list[str], name: str) -> list[MeasuredSample]:
    out: list[MeasuredSample] = []
    seen: set = set()
    for i, raw in enumerate(lines):
        s = raw.strip()
        if not s:
            continue
        line = i + 1
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as exc:
            raise LengthsFileError(f"{name}: line {line}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise LengthsFileError(f"{name}: line {line}: expected a JSON object")
        if "sample_id" not in obj:
            raise LengthsFileError(f"{name}: line {line}: missing field 'sample_id'")
        sid = obj["sample_id"]
        if isinstance(sid, bool) or not isinstance(sid, (int, str)):
            raise LengthsFileError(
                f"{name}: line {line}: sample_id must be an integer or string, got {sid!r}"
            )
        if sid in seen:
            raise LengthsFileError(f"{name}: line {line}: duplicate sample_id {sid!r}")
        seen.add(sid)
        n = _int_field(obj, "num_tokens", name, line)
        v = _int_field(obj, "num_visual_tokens", name, line, default=0)
        out.append(MeasuredSample(sid, n, v))
    return out
