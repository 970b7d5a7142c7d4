"""What `odb-pipeline plan` prints and writes, for the plain and the SDO plan alike: the
summary (or one JSON object with --json), the --emit-plan file (one step per line) and the
first quarantined samples.

A plan's input (plan.py's lengths file or data source) gives its `name`, whether it
`preprocesses`, and its own `to_dict()` keys and `summary_text()` lines.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.errors import UserError

QUARANTINE_SHOWN = 20


class PlanOutput:
    """The plan's report, its --emit-plan file and the first quarantined samples, fed with each
    epoch's events (`observe`). Entered before the input (an unwritable path is a one-line
    error before any work); the file is closed on exit."""

    def __init__(self, report, emit_plan: str | None) -> None:
        self.report = report
        self.quarantine_lines: list[str] = []
        self._path = emit_plan
        self._file = None

    def __enter__(self) -> PlanOutput:
        if self._path:
            try:
                self._file = open(self._path, "w", encoding="utf-8")
            except OSError as exc:
                raise UserError(f"cannot write --emit-plan {self._path}: {exc.strerror}"
                                ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()

    def write_line(self, line: str) -> None:
        """One more line of the --emit-plan file (SDO writes each epoch's visits)."""
        if self._file is not None:
            self._file.write(line + "\n")

    def observe(self, events) -> None:
        from pipeline.planner.types import Quarantined, Step

        for ev in events:
            self.report.observe(ev)
            if isinstance(ev, Step):
                self.write_line(step_json(ev))
            elif isinstance(ev, Quarantined) and len(self.quarantine_lines) < QUARANTINE_SHOWN:
                self.quarantine_lines.append(
                    f"  {ev.sample.sample_id}: {ev.reason.value}: {ev.detail}")

    def print_result(self, args: argparse.Namespace, source, policy, elapsed: float,
                     extra: dict | None = None, extra_text: str = "") -> int:
        """Print the plan's summary (or one JSON object), with a mode's `extra` keys and
        lines."""
        report = self.report
        preprocessed = source.seconds  # (part of `elapsed`, but not planning)
        elapsed = max(elapsed - preprocessed, 0.0)
        result = report.to_dict()
        result["mode"] = args.mode
        result["world_size"] = args.world_size
        result["token_budget"] = args.token_budget
        result["lookahead_tokens"] = policy.lookahead_tokens
        result["max_window_samples"] = policy.max_window_samples
        result["collate"] = args.collate
        result["planning_seconds"] = round(elapsed, 4)
        result["samples_per_second"] = (round(report.samples_in / elapsed) if elapsed > 0
                                        else None)
        result.update(source.to_dict())
        result.update(extra or {})
        if args.json:
            json.dump(result, sys.stdout)
            sys.stdout.write("\n")
            return 0
        print(
            f"plan: {source.name}  W={args.world_size}  budget={args.token_budget}"
            f"  mode={args.mode}  collate={args.collate}  lookahead={policy.lookahead_tokens}"
        )
        if source.preprocesses:
            print(source.summary_text())
        print(report.summary_text())
        if extra_text:
            print(extra_text)
        if self.quarantine_lines:
            print(f"quarantined samples (first {QUARANTINE_SHOWN}):")
            print("\n".join(self.quarantine_lines))
        what = (f"preprocessed in {preprocessed:.1f} s (Ray's start "
                f"{source.ray_start_seconds:.1f} s), " if source.preprocesses else "")
        print(f"{what}planned in {elapsed:.3f} s ({result['samples_per_second']} samples/s)")
        return 0


def step_json(step) -> str:
    opt = step.info.optimizer_step
    return json.dumps(
        {
            "epoch": step.epoch,
            "step": step.step,
            **({"optimizer_step": opt} if opt is not None else {}),
            "batches": [
                {
                    "rank": b.rank,
                    **({"micro": b.micro} if opt is not None else {}),
                    "samples": list(b.sample_ids),
                    "cost": b.cost,
                    **({"over_budget": True} if b.over_budget else {}),
                    **({"filler": True} if b.filler else {}),
                    **(
                        {"truncated_to": {str(k): v for k, v in b.truncated_to.items()}}
                        if b.truncated_to
                        else {}
                    ),
                }
                for b in step.batches
            ],
        },
        separators=(",", ":"),
    )
