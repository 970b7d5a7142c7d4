"""`odb-pipeline plan`: dry-run the batching core on a lengths file or a dataset.

`--lengths FILE` plans recorded token counts. `--data FILE...` runs the real preprocessing
(private local Ray, as `inspect` does) and plans each sample's measured size, epoch by epoch
(augmentation seeded per epoch); the JSON adds `quarantined_records`, `preprocess_epochs`,
`rows` and `preprocess_seconds` (Ray's start included, `ray_start_seconds`: `planning_seconds`
is the planner's alone). `--config FILE [--job ID]` takes the job's settings as defaults (and,
without --lengths or --data, its source); explicit flags win; without it the defaults are the
job config's own (pipeline/config.py), the ones `serve` uses.
Prints a summary (or one JSON object with --json) of the plan the service would make: steps,
padding efficiency, budget violations, over-budget handling, per-rank steps, rank balance,
carry-over, quota mode's filler batches. `--emit-plan OUT.jsonl` writes the plan itself, one
step per line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter
from typing import TYPE_CHECKING

from pipeline.commands.plan_output import QUARANTINE_SHOWN, PlanOutput
from pipeline.errors import UserError
from pipeline.modes import DGAP_MODES, JobMode, OverBudgetPolicy

if TYPE_CHECKING:
    from pipeline.config import TrainingJobConfig

HELP = "dry-run batching on a dataset or a lengths file (steps, padding efficiency, balance)"


# Flags that a --config job supplies: dest -> job field path. Without --config a flag left out
# takes the job config's own default (pipeline/config.py), so `plan` plans what `serve` would;
# --world-size and --token-budget must then be given.
_JOB_FLAGS: dict[str, tuple[str, ...]] = {
    "world_size": ("world_size",),
    "token_budget": ("batching", "token_budget"),
    "mode": ("mode",),
    "lookahead_tokens": ("batching", "lookahead_tokens"),
    "max_window_samples": ("batching", "max_window_samples"),
    "collate": ("batching", "collate"),
    "over_budget": ("batching", "over_budget"),
    "max_visual_tokens": ("batching", "max_visual_tokens"),
    "attn_a": ("batching", "attn_a"),
    "attn_b": ("batching", "attn_b"),
    "pool_steps": ("batching", "pool_steps"),
    "pad_to_multiple": ("batching", "pad_to_multiple"),
    "global_token_budget": ("batching", "global_token_budget"),
    "epochs": ("epochs",),
    "seed": ("seed",),
    "shuffle": ("source", "shuffle"),
    # SDO (docs/sdo.md): the job's organization block.
    "organization": ("organization", "kind"),
    "knn_k": ("organization", "knn_k"),
    "locality": ("organization", "locality"),
    "coverage_epochs": ("organization", "coverage_epochs"),
    "visits_per_epoch": ("organization", "visits_per_epoch"),
    "embedding_model": ("organization", "embedding", "model"),
    "embedding_column": ("organization", "embedding", "column"),
}
_REQUIRED_WITHOUT_CONFIG = ("world_size", "token_budget")
_FLAG_OF = {path: "--" + dest.replace("_", "-") for dest, path in _JOB_FLAGS.items()}


def _config_default(path: tuple[str, ...]) -> object:
    from pipeline.config import TrainingJobConfig

    model, value = TrainingJobConfig, None
    for key in path:  # a field's default, in the model of the block that holds it
        field = model.model_fields[key]
        value = field.get_default(call_default_factory=True)
        model = field.annotation
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("input (exactly one of --lengths / --data)")
    src.add_argument(
        "--lengths",
        metavar="FILE",
        help="one integer token count per line (sample id = 0-based line number), or JSONL "
        "objects with sample_id, num_tokens and optional num_visual_tokens",
    )
    src.add_argument(
        "--data",
        action="append",
        metavar="FILE",
        help="JSONL/Parquet file, folder or URI, run through the real Ray preprocessing "
        "(repeatable; a private local Ray is started unless one is up)",
    )
    src.add_argument(
        "--config",
        metavar="FILE",
        help="YAML/JSON service config (its first job, or --job) or a single job mapping: the "
        "job's preprocessing, seed, epochs, world size, mode and batching settings are the "
        "defaults; explicit flags override them",
    )
    src.add_argument("--job", metavar="ID", help="job of --config to take settings from")
    src.add_argument(
        "--limit", type=int, default=None, metavar="N", help="--data: only the first N records"
    )
    src.add_argument(
        "--export-lengths",
        metavar="OUT.jsonl",
        help="--data: write {sample_id, num_tokens, num_visual_tokens} per sample (first epoch), "
        "to re-plan quickly with --lengths",
    )
    parser.add_argument(
        "--world-size", type=int, default=None, metavar="W",
        help="ranks (required unless --config)",
    )
    parser.add_argument(
        "--token-budget", type=int, default=None, metavar="T",
        help="max token cost per batch (required unless --config)",
    )
    parser.add_argument(
        "--global-token-budget", type=int, default=None, metavar="G",
        help="tokens of one optimizer step, all ranks together (>= the budget): steps that "
        "do not depend on the world size, each rank's share in micro-batches of up to the "
        "budget (docs/global-steps.md); default: one batch per rank and step",
    )
    parser.add_argument("--mode", choices=[m.value for m in DGAP_MODES], default=None,
                        help="DGAP mode (default join)")
    parser.add_argument(
        "--lookahead-tokens", type=int, default=None, metavar="N",
        help="online window in tokens (>= the budget; default 128 x the budget)",
    )
    parser.add_argument(
        "--max-window-samples", type=int, default=None, metavar="N",
        help="safety cap on the samples in that window (default 65536)",
    )
    parser.add_argument("--collate", choices=["padded", "packed"], default=None,
                        help="default padded")
    parser.add_argument(
        "--over-budget",
        choices=[p.value for p in OverBudgetPolicy],
        default=None,
        help="what to do with a sample that cannot fit a batch on its own (default truncate)",
    )
    parser.add_argument(
        "--max-visual-tokens", type=int, default=None, metavar="V", help="cap per batch"
    )
    parser.add_argument(
        "--attn-a",
        type=float,
        default=None,
        help="compute model a*L + b*L^2 per sample (balances ranks; default a=1, b=0: tokens)",
    )
    parser.add_argument("--attn-b", type=float, default=None, help="see --attn-a")
    parser.add_argument(
        "--pool-steps",
        type=int,
        default=None,
        metavar="P",
        help="steps' worth of batches pooled for rank balancing (default: ~256 batches)",
    )
    parser.add_argument(
        "--pad-to-multiple", type=int, default=None, metavar="M",
        help="pad every sequence to a multiple of M (context parallelism: 2 x CP); the budget "
        "caps the padded lengths (default: no padding)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, metavar="E",
        help="default 1 (--data: each epoch re-preprocessed with its augmentation seed)",
    )
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="default 0")
    parser.add_argument(
        "--shuffle", action=argparse.BooleanOptionalAction, default=None,
        help="--data: the job's order, shuffled by (seed, epoch) as `serve` reads it (default: "
        "the config's source.shuffle, on); --no-shuffle: file order. --lengths: the same "
        "order over the file's lines (default: as given)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--emit-plan", metavar="OUT.jsonl", help="write one JSON line per step "
                        "(with --organization sdo, each epoch's visits first)")
    org = parser.add_argument_group("structure-aware data organization (--data only; "
                                    "docs/sdo.md)")
    org.add_argument("--organization", choices=["none", "sdo"], default=None,
                     help="sdo: KNN-local batches from frozen embeddings, exposure-balanced "
                     "epochs; the JSON adds locality (vs none on the same data) and exposure")
    org.add_argument("--knn-k", type=int, default=None, metavar="K", help="neighbors per sample")
    org.add_argument("--locality", type=float, default=None, metavar="L",
                     help="0..1: 0 = ODB's window (padding), 1 = traversal order (locality)")
    org.add_argument("--coverage-epochs", type=int, default=None, metavar="C",
                     help="every sample is trained at least once in every C epochs")
    org.add_argument("--visits-per-epoch", type=int, default=None, metavar="V",
                     help="sample visits per epoch (default: the number of samples)")
    org.add_argument("--embedding-model", default=None, metavar="NAME",
                     help="packaged model name or local sentence-transformers folder "
                     "(default all-MiniLM-L6-v2)")
    org.add_argument("--embedding-column", default=None, metavar="FIELD",
                     help="read each record's vector from this field instead of a model")


def _require(args: argparse.Namespace) -> None:
    for name in _REQUIRED_WITHOUT_CONFIG:
        if getattr(args, name) is None:
            raise UserError(f"{_FLAG_OF[_JOB_FLAGS[name]]} is required (or a --config job)")


def _check_input(args: argparse.Namespace) -> None:
    if args.lengths is not None and args.data:
        raise UserError("--lengths and --data are mutually exclusive: give one")
    if args.lengths is None and not args.data and not args.config:
        raise UserError("one of --lengths FILE, --data FILE or --config FILE (its job's "
                        "source) is required")
    if args.lengths is not None:
        for flag, value in (("--limit", args.limit), ("--export-lengths", args.export_lengths)):
            if value is not None:
                raise UserError(f"{flag} needs --data (it has no effect with --lengths)")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")


def _job_overrides(args: argparse.Namespace) -> dict:
    """The flags given (or filled) as a partial job mapping."""
    out: dict = {}
    for name, path in _JOB_FLAGS.items():
        if getattr(args, name) is None:
            continue
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = getattr(args, name)
    return out


def _resolve(args: argparse.Namespace) -> TrainingJobConfig:
    """Fill unset flags from the --config job (or the job config's defaults); returns the job
    the flags describe, validated by the config model (the one owner of every bound: an error
    names the flag), with the --data sources (the job `--data` preprocesses with)."""
    from pipeline.commands.cli_job import job_config
    from pipeline.config import TrainingJobConfig

    base = None
    if args.config or args.job:
        base = job_config(args.config, args.job, args.data, default_job_id="plan")
        if base.mode is JobMode.REFILL:
            raise UserError(f"job {base.job_id!r} is a `mode: refill` job: it has no plan "
                            "(plan dry-runs training jobs)")
    for name, path in _JOB_FLAGS.items():
        if getattr(args, name) is not None:
            continue
        if base is not None:
            value = base
            for key in path:
                value = getattr(value, key)
            setattr(args, name, value)
        elif name not in _REQUIRED_WITHOUT_CONFIG:
            setattr(args, name, _config_default(path))
    _require(args)
    job = job_config(args.config, args.job, args.data, default_job_id="plan",
                     overrides=_job_overrides(args), names=_FLAG_OF)
    assert isinstance(job, TrainingJobConfig)  # (a refill base was refused above)
    return job


def run(args: argparse.Namespace) -> int:
    from pipeline.planner.epochs import epoch_order, plan_epoch
    from pipeline.planner.plan_report import PlanReport
    from pipeline.planner.step_planner import StepPlanner

    _check_input(args)
    args.shuffle_flag = args.shuffle  # as given (None: the job's own order decides)
    job = _resolve(args)
    policy = job.batching.policy()
    planner = StepPlanner(policy, job.world_size, job.mode, job.seed, job.batching.pool_steps)
    preprocess = args.lengths is None  # --data, or the --config job's own source
    if not preprocess and job.organization.kind == "sdo":
        raise UserError("--organization sdo needs --data (embeddings come from the records); "
                        "plan lengths with --organization none")
    if preprocess:
        from pipeline.preprocess.sources import expand_sources

        expand_sources(job.source)  # missing input: fail in one line before starting Ray
        if job.organization.kind == "sdo":
            from pipeline.commands.plan_sdo import run_sdo
            from pipeline.producer.sdo_feed import reading_job

            # SDO orders its visits itself: it reads the data in file order, as its feed does.
            return run_sdo(args, job, policy,
                           _DataSource(reading_job(job), args.limit, args.export_lengths))
        source = _DataSource(job, args.limit, args.export_lengths)
    else:
        source = _LengthsSource(args.lengths)

    t0 = time.perf_counter()
    # --data reads the job's own order (the served one); a lengths file is shuffled on request.
    shuffle_lengths = not args.data and args.shuffle_flag is True
    with PlanOutput(PlanReport(policy, job.world_size), args.emit_plan) as out, source:
        for epoch in range(job.epochs):
            source.announce(epoch, job.epochs)
            if source.preprocesses and job.source.mixture is not None:  # as the producer does
                planner.set_source_targets(source.epoch_counts(epoch), job.source.mix_by)
            counted = _Counted(epoch_order(source.epoch(epoch), epoch, seed=job.seed,
                                           shuffle=shuffle_lengths))
            events = plan_epoch(planner, counted, last=epoch == job.epochs - 1)
            out.report.samples_in += counted.n
            out.observe(events)
    return out.print_result(args, source, policy, time.perf_counter() - t0)


class _Counted:
    """Counts what the planner takes from a (possibly streamed) epoch."""

    def __init__(self, items) -> None:
        self.items = items
        self.n = 0

    def __iter__(self):
        for it in self.items:
            self.n += 1
            yield it


class _LengthsSource:
    """--lengths: the same samples every epoch."""

    preprocesses = False
    seconds = 0.0  # (nothing preprocessed)

    def __init__(self, path: str) -> None:
        from pipeline.planner.lengths_file import LengthsFileError, read_lengths

        self.name = path
        try:
            self.samples = read_lengths(path)
        except LengthsFileError as exc:
            raise UserError(str(exc)) from None

    def __enter__(self) -> _LengthsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def announce(self, epoch: int, epochs: int) -> None:
        pass

    def epoch(self, epoch: int):
        return self.samples

    def to_dict(self) -> dict:
        return {}


class _DataSource:
    """--data: each epoch preprocessed for real (Ray Data, augmentation seeded by epoch); the
    planner sees `ProcessedSample.measured()`, quarantined records are counted by reason.
    `seconds`: the time spent starting Ray and producing samples (not planning them)."""

    preprocesses = True

    def __init__(self, job, limit: int | None, export_path: str | None) -> None:
        from pipeline.ray_runtime import PrivateRay

        self.job = job
        self.limit = limit
        self.export_path = export_path
        self._order = None
        if job.source.schedule:
            from pipeline.commands.cli_job import progress

            progress("plan", "note: source.schedule is not planned (the service changes the "
                     "weights at each entry's step); this plan keeps the configured weights")
        paths = [p for s in job.source.mixture_value().sources for p in s.paths]
        self.name = paths[0] + (f" (+{len(paths) - 1} more)" if len(paths) > 1 else "")
        self.ray = PrivateRay(prefix="odb-plan-ray-")
        self.epochs: list[dict] = []
        self.by_reason: Counter = Counter()
        self.examples: list[dict] = []  # first few quarantined records (each listed once)
        self._shown: set[str] = set()
        self._first: dict = {}  # sample_id -> num_tokens in epoch 0 (augmentation effect)
        self._export = None
        self.seconds = 0.0
        self.ray_start_seconds = 0.0

    def __enter__(self) -> _DataSource:
        if self.export_path:
            try:
                self._export = open(self.export_path, "w", encoding="utf-8")
            except OSError as exc:
                raise UserError(
                    f"cannot write --export-lengths {self.export_path}: {exc.strerror}"
                ) from None
        from pipeline.commands.cli_job import progress

        progress("plan", "starting a private Ray (a few seconds)")
        t0 = time.perf_counter()
        try:
            self.ray.__enter__()
            self.ray_start_seconds = time.perf_counter() - t0
            self.seconds += self.ray_start_seconds
        except BaseException:
            if self._export is not None:
                self._export.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.ray.__exit__(*exc)
        finally:
            if self._export is not None:
                self._export.close()

    def announce(self, epoch: int, epochs: int) -> None:
        from pipeline.commands.cli_job import progress

        progress("plan", f"preprocessing {self.name}" + (f", epoch {epoch + 1} of {epochs}"
                                                          if epochs > 1 else ""))

    @property
    def order(self):
        """The served order (its sources indexed once, once Ray is up: a large file's line
        index is found by Ray tasks)."""
        if self._order is None:
            from pipeline.order.job_order import JobOrder

            self._order = JobOrder(self.job.source, self.job.seed)
            # a mixture's samples name their source (the planner keeps each one's share)
            self.source_of = {f.source: i for i, lay in enumerate(self._order.layouts)
                              for f in lay.files}
        return self._order

    def epoch_counts(self, epoch: int) -> list[int]:
        """The samples of each source the epoch holds (the configured mixture's)."""
        from pipeline.order.cursor import OrderCursor

        return self.order.epoch(epoch, OrderCursor()).source_totals()

    def epoch(self, epoch: int):
        """The epoch's measured samples; the time spent producing them counts in `seconds`."""
        started = time.perf_counter()
        for m in self._measured(epoch):
            self.seconds += time.perf_counter() - started
            yield m
            started = time.perf_counter()
        self.seconds += time.perf_counter() - started

    def _measured(self, epoch: int):
        from pipeline.preprocess.pipeline import PreprocessStats, iter_samples
        from pipeline.preprocess.process import split_sample_id
        from pipeline.preprocess.sample import QuarantinedRecord

        stats = PreprocessStats()
        changed = 0
        token_delta = 0
        export = self._export if epoch == 0 else None
        order = self.order
        for item in iter_samples(self.job, epoch, limit=self.limit, stats=stats, order=order):
            if isinstance(item, QuarantinedRecord):
                self.by_reason[item.reason] += 1
                if len(self.examples) < QUARANTINE_SHOWN and item.sample_id not in self._shown:
                    self._shown.add(item.sample_id)
                    self.examples.append({"epoch": epoch, "sample_id": item.sample_id,
                                          "reason": item.reason, "detail": item.detail})
                continue
            m = item.measured()
            m = dataclasses.replace(m, source=self.source_of[split_sample_id(m.sample_id)[0]])
            if epoch == 0:
                self._first[m.sample_id] = m.num_tokens
            elif m.sample_id in self._first:
                d = m.num_tokens - self._first[m.sample_id]
                changed += d != 0
                token_delta += d
            if export is not None:
                export.write(json.dumps({"sample_id": m.sample_id, "num_tokens": m.num_tokens,
                                         "num_visual_tokens": m.num_visual_tokens}) + "\n")
            yield m
        counts = stats.to_dict()
        counts["epoch"] = epoch
        if epoch > 0:
            counts["samples_changed_vs_epoch0"] = changed
            counts["num_tokens_delta_vs_epoch0"] = token_delta
        self.epochs.append(counts)

    def to_dict(self) -> dict:
        total = sum(e["quarantined"] for e in self.epochs)
        return {
            "data": [p for s in self.job.source.mixture_value().sources for p in s.paths],
            "order": "shuffled" if self.job.source.shuffle else "file order",
            "rows": sum(e["rows"] for e in self.epochs),
            "quarantined_records": {
                "total": total,
                "by_reason": dict(sorted(self.by_reason.items())),
                "examples": self.examples,
            },
            "preprocess_epochs": self.epochs,
            "preprocess_seconds": round(self.seconds, 4),  # Ray's start included
            "ray_start_seconds": round(self.ray_start_seconds, 4),
            **({"exported_lengths": self.export_path} if self.export_path else {}),
        }

    def summary_text(self) -> str:
        d = self.to_dict()
        q = d["quarantined_records"]
        reasons = ", ".join(f"{k}={v}" for k, v in q["by_reason"].items())
        lines = [f"preprocessed       {d['rows']} rows over {len(self.epochs)} epoch(s):"
                 f" {d['rows'] - q['total']} samples, {q['total']} quarantined"
                 + (f" ({reasons})" if reasons else "")]
        if len(self.epochs) > 1:
            for e in self.epochs:
                effect = ("" if e["epoch"] == 0 else
                          f"  ({e['samples_changed_vs_epoch0']} samples changed length,"
                          f" {e['num_tokens_delta_vs_epoch0']:+d} tokens vs epoch 0)")
                lines.append(f"  epoch {e['epoch']:<3}        {e['samples']} samples,"
                             f" {e['num_tokens']} tokens, {e['num_visual_tokens']} visual,"
                             f" {e['truncated']} truncated{effect}")
        for ex in q["examples"]:
            lines.append(f"  quarantined {ex['sample_id']}: {ex['reason']}: {ex['detail'][:60]}")
        if self.export_path:
            lines.append(f"lengths written to {self.export_path} (epoch 0; re-plan with"
                         " --lengths)")
        return "\n".join(lines)

