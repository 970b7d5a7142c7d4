"""Quarantine records as the operator sees them: id, a bounded `reason` label, the full text.

`JobRuntime.quarantined` holds strings: preprocessing writes "<source>:<row>: <kind>" (kind is a
short machine word such as `bad_json`), the planner writes "<sample_id>: <sentence>". The label
must have few values (it is a Prometheus label), so planner sentences map to a fixed set.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

# Planner reasons (pipeline/planner/step_planner.py `_admit`), most specific first.
_PLANNER_REASONS = (
    ("invalid size", "invalid_size"),
    ("num_visual_tokens=", "over_visual_cap"),
    ("num_tokens=", "over_budget"),
)
PLANNER_REASONS = frozenset(label for _, label in _PLANNER_REASONS)
_KIND = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    sample_id: str
    reason: str  # bounded label
    detail: str  # the text as recorded

    def as_dict(self) -> dict[str, str]:
        return {"sample_id": self.sample_id, "reason": self.reason, "detail": self.detail}


def parse_record(text: str) -> QuarantineRecord:
    sample_id, sep, rest = text.partition(": ")
    if not sep:
        return QuarantineRecord("", "other", text)
    for prefix, label in _PLANNER_REASONS:
        if rest.startswith(prefix):
            return QuarantineRecord(sample_id, label, rest)
    kind = rest.partition(": ")[0]  # "<kind>" or "<kind>: <detail>"
    return QuarantineRecord(sample_id, kind if _KIND.match(kind) else "other", rest)


def by_reason(records: list[str]) -> dict[str, int]:
    return dict(sorted(Counter(parse_record(r).reason for r in records).items()))
