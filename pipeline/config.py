"""The one typed configuration: file (YAML/JSON) < environment (ODB_*) < flags, validated at start.

Environment names are derived from the model (`ODB_` + field path joined by `__`, upper case,
e.g. `ODB_GRPC__PORT`), so deploy manifests and docs can be checked against `env_var_names()`
instead of a second hand-written list. Jobs are a list and come from the file only; a job's
secret token comes from the environment variable its `token_env` names.

A job is one of two kinds, told apart by its `mode` (`JobConfig`): a `TrainingJobConfig`
(`join` | `quota`, the default: ranks, a world, batching, organization) or a `RefillJobConfig`
(`refill`: requests for inference consumers). Each holds only its own options; another kind's
option is refused by name. The choices (mode, rank failure policy, over-budget policy) are the
shared enums of `pipeline/modes.py`. Every setting has one place: the planner's balancing pool,
for one, is `batching.pool_steps` and nothing else.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.errors import UserError
from pipeline.modes import DGAP_MODES, JobMode, OverBudgetPolicy, RankFailurePolicy
from pipeline.order.epoch_order import OrderSettings
from pipeline.order.mixture import DEFAULT_SOURCE, NAME_PATTERN, MixSource, Mixture, ScheduleEntry
from pipeline.planner.compute_fit import FitSettings
from pipeline.planner.policy import LOOKAHEAD_BUDGETS, MAX_WINDOW_SAMPLES, BatchingPolicy

ENV_PREFIX = "ODB_"
# The order's defaults, chosen from measured shuffle quality (docs/data-order.md).
READ_UNIT_ROWS = 64
SHUFFLE_BLOCK_ROWS = 65536
SHUFFLE_BLOCK_MB = 64


class ConfigError(UserError):
    """A config value is wrong; the message names the field path and the value."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class MixtureSourceConfig(_Model):
    """One named source of a mixture: its files, and at most one of repeat / choose / weight
    (none: every row once per epoch). docs/data-order.md."""

    name: str = Field(pattern=NAME_PATTERN, description="how `mix`, `schedule` and status name it")
    paths: list[str] = Field(min_length=1, description="JSONL/Parquet files, dirs or URIs")
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    repeat: float | None = Field(None, ge=0, description="copies per epoch (1.5: every row once "
                                 "and half of them again, rotated over epochs)")
    choose: int | None = Field(None, ge=0, description="rows per epoch")
    weight: float | None = Field(None, ge=0, description="share of the epoch (relative to the "
                                 "other sources' weights)")


class ScheduleEntryConfig(_Model):
    from_step: int = Field(ge=0, description="the first step planned with these weights")
    weights: dict[str, float] = Field(description="source name -> weight, every source")


class SourceConfig(_Model):
    """What a job reads, and in what order (docs/data-order.md): `paths` (one source), or a
    `mixture` of named sources; shuffled by default."""

    paths: list[str] | None = Field(None, min_length=1,
                                    description="JSONL/Parquet files, dirs or URIs")
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    mixture: list[MixtureSourceConfig] | None = Field(
        None, min_length=1, description="named sources instead of `paths`, each with at most "
        "one of repeat / choose / weight")
    mix_by: Literal["samples", "loss_tokens"] = Field(
        "samples", description="what each source's share holds in every part of an epoch: its "
        "samples, or its trained (loss) tokens in every window of steps")
    epoch_samples: int | None = Field(None, ge=1, description="samples per epoch of a weighted "
                                      "mixture (None: as many as all sources have rows)")
    schedule: list[ScheduleEntryConfig] = Field(
        default_factory=list, description="weight changes from a step on: "
        "[{from_step: N, weights: {name: w}}]")
    shuffle: bool = Field(True, description="a seeded permutation of every epoch (false: file "
                          "order, each source's files one after another)")
    read_unit_rows: int = Field(
        READ_UNIT_ROWS, gt=0, multiple_of=64, description="JSONL rows per read unit (one "
        "ranged read; Parquet reads whole row groups)")
    shuffle_block_rows: int = Field(SHUFFLE_BLOCK_ROWS, gt=0, description="positions one "
                                    "shuffle block spans (the shuffle's buffer)")
    shuffle_block_mb: int = Field(SHUFFLE_BLOCK_MB, gt=0, description="raw source bytes one "
                                  "shuffle block may hold (fewer rows for large rows)")

    @model_validator(mode="after")
    def _one_kind_of_source(self) -> SourceConfig:
        if (self.paths is None) == (self.mixture is None):
            raise ValueError("give exactly one of paths (one source) or mixture (named sources)")
        if self.mixture is None and (self.schedule or self.mix_by != "samples"):
            given = "schedule" if self.schedule else f"mix_by {self.mix_by}"
            raise ValueError(f"{given} needs a mixture (source.mixture): a job of paths is one "
                             "source")
        self.mixture_value().check("mixture")  # the mixture owns the rules between fields
        return self

    def mixture_value(self) -> Mixture:
        """The job's sources as a `Mixture` (a job of `paths` is one source, "default")."""
        if self.mixture is None:
            sources = (MixSource(DEFAULT_SOURCE, tuple(self.paths or ()), self.format),)
        else:
            sources = tuple(MixSource(m.name, tuple(m.paths), m.format, m.repeat, m.choose,
                                      m.weight) for m in self.mixture)
        schedule = tuple(ScheduleEntry(e.from_step, tuple(e.weights.items()))
                         for e in self.schedule)
        return Mixture(sources, self.mix_by, self.epoch_samples, schedule)

    def order_settings(self) -> OrderSettings:
        return OrderSettings(shuffle=self.shuffle, block_rows=self.shuffle_block_rows,
                             block_bytes=self.shuffle_block_mb * 2**20)


class AugmentConfig(_Model):
    """Cost-changing augmentation, seeded by (job seed, epoch, sample_id)."""

    enabled: bool = True
    system_prompts: list[str] = Field(default_factory=list)
    system_prompt_prob: float = Field(0.0, ge=0.0, le=1.0)
    turn_subsample_prob: float = Field(0.0, ge=0.0, le=1.0)
    image_scale_min: float = Field(1.0, gt=0.0, le=4.0)
    image_scale_max: float = Field(1.0, gt=0.0, le=4.0)

    @model_validator(mode="after")
    def _scale_range(self) -> AugmentConfig:
        if self.image_scale_min > self.image_scale_max:
            raise ValueError(
                f"image_scale_min ({self.image_scale_min}) > image_scale_max "
                f"({self.image_scale_max})"
            )
        return self


# Qwen2-VL: 14-pixel patches merged 2x2, so one visual token covers 28x28 resized pixels
# (tests/preprocess check this against the image processor).
PIXELS_PER_VISUAL_TOKEN = 28 * 28


class PreprocessConfig(_Model):
    tokenizer_dir: str | None = Field(None, description="local tokenizer dir; None = bundled Qwen")
    chat_template: str | None = Field(None, description="'qwen2' | 'qwen3' | a Jinja file path")
    max_seq_len: int = Field(4096, gt=0)
    truncation: Literal["truncate", "quarantine"] = Field(
        "truncate", description="a sample over max_seq_len: cut it (vision-safe, see "
        "JobConfig.max_sample_tokens) or quarantine it as too_long")
    image_min_pixels: int = Field(56 * 56, gt=0)
    image_max_pixels: int = Field(1024 * 1024, gt=0)
    pixel_dtype: Literal["uint8", "bfloat16", "float32"] = Field(
        "uint8", description="how image patches are stored and sent: uint8 = raw pixels, "
        "normalized on the trainer's device (4x fewer bytes than float32); bfloat16 / float32 = "
        "normalized by preprocessing")
    special_tokens_in_content: Literal["text", "quarantine"] = Field(
        "text", description="a record whose text holds a special-token string (<|im_start|>, "
        "<|image_pad|>, ...): `text` = tokenize it as plain text (it can never open a turn or "
        "an image slot); `quarantine` = set the record aside as special_tokens_in_content")
    augment: AugmentConfig = AugmentConfig()
    object_store_mb: int = Field(
        256, gt=0, description="Ray object-store memory the epoch's preprocessing may fill ahead "
        "of the planner before it waits (back-pressure); must hold a few blocks (each about "
        "task_output_mb)")
    task_output_mb: int = Field(
        64, gt=0, description="the output one Ray preprocessing task aims at, and the size of "
        "its blocks: a task reads as many rows as fit (estimated from its file's first rows, "
        "images at image_max_pixels in pixel_dtype; at most 256) and streams its output in "
        "blocks of about this size")

    @model_validator(mode="after")
    def _pixel_range(self) -> PreprocessConfig:
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError(f"image_min_pixels ({self.image_min_pixels}) > image_max_pixels "
                             f"({self.image_max_pixels})")
        return self

    @property
    def min_image_visual_tokens(self) -> int:
        """Visual tokens of an image resized to image_min_pixels, the least the image processor
        gives an image (it enlarges smaller ones)."""
        return -(-self.image_min_pixels // PIXELS_PER_VISUAL_TOKEN)


_FIT = FitSettings()  # the fit's defaults are its own (one place)


class ComputeBalancingConfig(_Model):
    """Balance ranks by measured compute (docs/compute-balancing.md): trainers report each
    batch's compute seconds, the job fits a cost model of them, and once it predicts held-out
    batches within `max_error` the planner balances ranks by predicted time instead of tokens."""

    enabled: bool = False
    max_error: float = Field(_FIT.max_error, gt=0.0, lt=1.0, description="the gate: held-out "
                             "mean relative error (worst 10% left out) at most this")
    min_reports: int = Field(_FIT.min_reports, ge=8, description="reports before the gate can "
                             "open")
    window: int = Field(_FIT.window, ge=8, le=4096, description="reports kept (the newest) for "
                        "the fit (the job's state keeps 4096)")
    warmup_steps: int = Field(_FIT.warmup_steps, ge=0, description="each world's first steps "
                              "are not fitted")

    @model_validator(mode="after")
    def _valid_fit(self) -> ComputeBalancingConfig:
        self.fit_settings()  # the fit owns the rules between fields
        return self

    def fit_settings(self) -> FitSettings:
        return FitSettings(window=self.window, min_reports=self.min_reports,
                           max_error=self.max_error, warmup_steps=self.warmup_steps)


class BatchingConfig(_Model):
    """A job's batching settings. These defaults are the only ones: `serve` uses them and `plan`
    takes its defaults from here too, so a dry run plans what the service would."""

    token_budget: int = Field(16384, gt=0)
    collate: Literal["padded", "packed"] = "padded"
    attn_a: float = Field(1.0, ge=0.0, description="compute cost a*L + b*L^2 per sample")
    attn_b: float = Field(0.0, ge=0.0)
    max_visual_tokens: int | None = Field(None, gt=0)
    lookahead_tokens: int | None = Field(
        None, gt=0, description="the planner's online window in tokens (>= token_budget); "
        f"None = {LOOKAHEAD_BUDGETS} x token_budget")
    max_window_samples: int = Field(MAX_WINDOW_SAMPLES, gt=0,
                                    description="safety cap on the samples in that window")
    pool_steps: int | None = Field(
        None, gt=0, description="steps' worth of batches pooled for rank balancing; "
        "None = the planner's default (~256 batches). Smaller starts streaming sooner.")
    ramp_up: bool = Field(
        True, description="start each epoch's planning with a small window and pool that "
        "double with every step (the first batch after a few budgets of samples, not after "
        "lookahead_tokens + ~256 batches); false = full window and pool from the first step")
    over_budget: OverBudgetPolicy = Field(
        OverBudgetPolicy.TRUNCATE, description="a sample over token_budget / max_visual_tokens: "
        "`truncate` = preprocessing cuts every sample to fit a batch alone "
        "(TrainingJobConfig.max_sample_tokens); "
        "`alone` = a batch of its own, flagged; `quarantine` = set aside as over_budget")
    compute_balancing: ComputeBalancingConfig = ComputeBalancingConfig()
    pad_to_multiple: int | None = Field(
        None, ge=1, description="pad every sequence to a multiple of this, with no loss tokens "
        "on the padding (context parallelism needs 2 x CP, sequence parallelism TP, FP8 "
        "kernels 8 or 16; docs/trainer-client.md); the budget caps the padded lengths. "
        "None = no padding. A job served to model-parallel groups (BatchStream(group_size=k), "
        "k > 1) must set it, to 1 when its layout needs no multiple")
    global_token_budget: int | None = Field(
        None, gt=0, description="the tokens of one optimizer step, all ranks together "
        "(>= token_budget): a step's samples then do not depend on the world size, and each "
        "rank accumulates its micro-batches of up to token_budget (docs/global-steps.md); "
        "None = a step is one batch of up to token_budget per rank")

    @model_validator(mode="after")
    def _valid_policy(self) -> BatchingConfig:
        self.policy()  # the planner owns the rules between fields; its ValueError names them
        return self

    def policy(self) -> BatchingPolicy:
        """The planner's policy for these settings: the one place a config becomes a policy."""
        return BatchingPolicy(
            token_budget=self.token_budget, collate=self.collate, attn_a=self.attn_a,
            attn_b=self.attn_b, max_visual_tokens=self.max_visual_tokens,
            lookahead_tokens=self.lookahead_tokens, max_window_samples=self.max_window_samples,
            over_budget=self.over_budget, ramp_up=self.ramp_up,
            pad_to_multiple=self.pad_to_multiple,
            global_token_budget=self.global_token_budget,
        )


class EmbeddingConfig(_Model):
    """Where a sample's frozen embedding comes from: a packaged/local model, or a column."""

    model: str | None = Field(None, description="sentence-embedding model: a packaged name "
                              "(all-MiniLM-L6-v2) or a local sentence-transformers folder; "
                              "None with no column = all-MiniLM-L6-v2")
    column: str | None = Field(None, description="record field holding a precomputed vector")
    cache_dir: str | None = Field(None, description="None = embeddings/ in the cache dir "
                                  "($XDG_CACHE_HOME/odb-pipeline, else ~/.cache/odb-pipeline)")

    @model_validator(mode="after")
    def _one_source(self) -> EmbeddingConfig:
        if self.model is not None and self.column is not None:
            raise ValueError("give one of model or column, not both")
        return self


class OrganizationConfig(_Model):
    """Structure-aware data organization (docs/sdo.md): which samples train together, how often."""

    kind: Literal["none", "sdo"] = "none"
    knn_k: int = Field(16, ge=1, le=256)
    locality: float = Field(0.5, ge=0.0, le=1.0,
                            description="0 = ODB's window (padding), 1 = traversal order")
    coverage_epochs: int = Field(2, ge=1, description="every sample at least once per window")
    visits_per_epoch: int | None = Field(None, gt=0, description="None = the dataset size")
    embedding: EmbeddingConfig = EmbeddingConfig()


class RefillConfig(_Model):
    """A `mode: refill` job (docs/refill.md): requests for inference consumers, admitted under
    each consumer's free token capacity. A request costs its prompt tokens plus its planned
    generation tokens, from `generation_tokens` (one rule for the job), else the record field
    `generation_tokens_field`, else the length of the record's reference answer."""

    generation_tokens: int | None = Field(None, gt=0, description="planned generation tokens "
                                          "of every request")
    generation_tokens_field: str | None = Field(
        None, min_length=1, description="record field holding a request's planned generation "
        "tokens (a record without a positive integer there is quarantined as bad_record)")
    lease_seconds: float = Field(30.0, gt=0, description="a consumer silent this long loses its "
                                 "admitted-but-unfinished requests: they are re-admitted")
    max_request_tokens: int | None = Field(
        None, gt=0, description="the largest request any consumer can hold; None = no limit")
    over_budget: OverBudgetPolicy = Field(
        OverBudgetPolicy.QUARANTINE, description="a request costing more than max_request_tokens: "
        "`quarantine` = set aside as over_budget; `alone` = admitted flagged, by itself, to a "
        "consumer with nothing in flight; `truncate` = its planned generation is cut to fit")
    queue_depth: int = Field(1024, gt=0, description="requests the producer keeps waiting in "
                             "Redis ahead of the consumers (back-pressure)")

    @model_validator(mode="after")
    def _one_rule(self) -> RefillConfig:
        if self.generation_tokens is not None and self.generation_tokens_field is not None:
            raise ValueError("give one of generation_tokens or generation_tokens_field, not both")
        return self


class _JobOptions(_Model):
    """What every job has, whatever its kind: identity, credential, input and preprocessing."""

    job_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    token_env: str | None = Field(None, description="env var holding the job's bearer token")
    allow_unauthenticated: bool = Field(
        False, description="serve this job without a token on a grpc.host beyond loopback "
        "(anyone who reaches it can stream, read and rescale it); `serve` refuses such a job "
        "otherwise (docs/security.md)")
    seed: int = 0
    epochs: int = Field(1, ge=1)
    source: SourceConfig
    preprocess: PreprocessConfig = PreprocessConfig()

    def token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The bearer token, read from the environment at use (never stored in the config)."""
        if self.token_env is None:
            return None
        env = os.environ if environ is None else environ
        value = env.get(self.token_env)
        if not value:
            raise ConfigError(f"jobs[{self.job_id}].token_env: environment variable "
                              f"{self.token_env} is unset or empty")
        return value


def _refuse_options(data: Any, names: tuple[str, ...], why: str) -> None:
    """A job mapping holding another kind's options: refused naming them (not ignored)."""
    if isinstance(data, Mapping):
        given = [n for n in names if n in data]
        if given:
            raise ValueError(f"{', '.join(given)}: {why}")


class TrainingJobConfig(_JobOptions):
    """A training job (`mode: join | quota`): ranks of a world, a plan of steps under a token
    budget, optionally a structure-aware data organization."""

    world_size: int = Field(ge=1, le=65536, description="the world the job starts with")
    elastic: bool = Field(False, description="an Open with another world size, once the "
                          "current world's ranks ended or their leases lapsed, reconfigures the "
                          "job onto it (torchrun elastic restarts; docs/elastic.md)")
    max_world_size: int | None = Field(
        None, ge=1, le=65536, description="the largest world a reconfiguration may move the job "
        "onto; None = max(world_size, 1024)")
    mode: JobMode = Field(JobMode.JOIN, description="join | quota: how the ranks end an epoch")
    batching: BatchingConfig = BatchingConfig()
    organization: OrganizationConfig = OrganizationConfig()

    @model_validator(mode="before")
    @classmethod
    def _no_refill_options(cls, data: Any) -> Any:
        mode = data.get("mode", JobMode.JOIN) if isinstance(data, Mapping) else None
        _refuse_options(data, _REFILL_ONLY, f"options of `mode: refill` jobs, this job has mode "
                        f"{str(mode)!r}")
        return data

    @field_validator("mode")
    @classmethod
    def _dgap_mode(cls, mode: JobMode) -> JobMode:
        if mode not in DGAP_MODES:  # (a `mode: refill` job is a RefillJobConfig)
            raise ValueError(f"a training job's mode is join or quota, not {str(mode)!r}")
        return mode

    @model_validator(mode="after")
    def _sdo_plans_its_own_order(self) -> TrainingJobConfig:
        if self.organization.kind == "sdo" and self.source.mixture is not None:
            raise ValueError("source.mixture cannot go with organization.kind sdo: SDO's epochs "
                             "are visits in traversal order, not a mixture's (docs/sdo.md)")
        return self

    @model_validator(mode="after")
    def _max_world_holds_the_first(self) -> TrainingJobConfig:
        if self.max_world_size is not None and self.max_world_size < self.world_size:
            raise ValueError(f"max_world_size ({self.max_world_size}) is below world_size "
                             f"({self.world_size})")
        return self

    @model_validator(mode="after")
    def _limits_can_hold_a_sample(self) -> TrainingJobConfig:
        cap = self.batching.max_visual_tokens
        least = self.preprocess.min_image_visual_tokens
        if cap is not None and cap < least:
            raise ValueError(
                f"batching.max_visual_tokens ({cap}) is below the {least} visual tokens of the "
                f"smallest image (preprocess.image_min_pixels = {self.preprocess.image_min_pixels}"
                f" pixels): no image could ever be batched; raise it or lower image_min_pixels")
        return self

    def world_size_cap(self) -> int:
        """The largest world size the job may run with (servers size their pools for it)."""
        return self.max_world_size or max(self.world_size, 1024)

    def max_sample_tokens(self) -> int:
        """The most tokens one preprocessed sample may have: the one owner of this rule.

        `over_budget: truncate`: min(preprocess.max_seq_len, batching.token_budget), so every
        sample fits a batch alone, the planner never cuts one and the loss tokens measured in
        preprocessing stay exact. Otherwise preprocess.max_seq_len (the planner then applies
        `alone` / `quarantine` to samples over the budget). A sample's cost alone is its token
        count under both collates (rounded up to `batching.pad_to_multiple`), so fitting the
        budget alone means num_tokens <= token_budget (with a multiple: the largest multiple
        within the budget, `BatchingPolicy.max_alone_tokens`).
        """
        if self.batching.over_budget is OverBudgetPolicy.TRUNCATE:
            return min(self.preprocess.max_seq_len, self.batching.policy().max_alone_tokens)
        return self.preprocess.max_seq_len

    def max_sample_visual_tokens(self) -> int | None:
        """The most visual tokens one preprocessed sample may carry: batching.max_visual_tokens
        under `over_budget: truncate` (preprocessing drops trailing images to fit), else None."""
        if self.batching.over_budget is OverBudgetPolicy.TRUNCATE:
            return self.batching.max_visual_tokens
        return None

    def sample_limit_text(self) -> str:
        """Where `max_sample_tokens()` (and the visual cap) come from, for messages."""
        if self.batching.over_budget is OverBudgetPolicy.TRUNCATE:
            m = self.batching.pad_to_multiple
            text = (f"limit {self.max_sample_tokens()} = min(preprocess.max_seq_len "
                    f"{self.preprocess.max_seq_len}, batching.token_budget "
                    f"{self.batching.token_budget}"
                    + (f" rounded down to batching.pad_to_multiple {m}" if m else "") + ")")
        else:
            text = f"limit preprocess.max_seq_len {self.preprocess.max_seq_len}"
        cap = self.max_sample_visual_tokens()
        return text + (f", batching.max_visual_tokens {cap}" if cap is not None else "")

    def sample_cost(self, num_tokens: int) -> int:
        """A sample's cost alone: its tokens (padded or packed), or a*L + b*L^2 when b > 0;
        on its length as sent (rounded up to `batching.pad_to_multiple`)."""
        b = self.batching
        m = b.pad_to_multiple or 1
        n = -(-num_tokens // m) * m
        if b.attn_b > 0:
            return math.ceil(b.attn_a * n + b.attn_b * n**2)
        return n


class RefillJobConfig(_JobOptions):
    """A refill job (`mode: refill`, docs/refill.md): requests for inference consumers, admitted
    under each consumer's free token capacity. No ranks, world or plan: no world size, batching
    or organization (and the service's rank failure policy does not apply)."""

    mode: Literal[JobMode.REFILL] = JobMode.REFILL
    refill: RefillConfig = RefillConfig()

    @model_validator(mode="before")
    @classmethod
    def _no_training_options(cls, data: Any) -> Any:
        _refuse_options(data, _TRAINING_ONLY, "options of training jobs; a `mode: refill` job "
                        "has consumers, not ranks, and no plan")
        return data

    @model_validator(mode="after")
    def _no_mixture(self) -> RefillJobConfig:
        if self.source.mixture is not None or self.source.epoch_samples is not None:
            raise ValueError("source.mixture and source.epoch_samples are for training jobs: a "
                             "refill job admits its requests in file order")
        return self

    def max_sample_tokens(self) -> int:
        """The most tokens one preprocessed sample (a request's prompt and reference answer)
        may have: preprocess.max_seq_len."""
        return self.preprocess.max_seq_len

    def max_sample_visual_tokens(self) -> None:
        """No visual-token cap: a request's images are priced in its prompt tokens."""
        return None

    def sample_limit_text(self) -> str:
        return f"limit preprocess.max_seq_len {self.preprocess.max_seq_len}"

    def sample_cost(self, num_tokens: int) -> int:
        """A sample's cost alone: its tokens (a request is priced from its prompt instead)."""
        return num_tokens


_TRAINING_ONLY = tuple(n for n in TrainingJobConfig.model_fields if n not in
                       _JobOptions.model_fields and n != "mode")
_REFILL_ONLY = tuple(n for n in RefillJobConfig.model_fields if n not in
                     _JobOptions.model_fields and n != "mode")


_TRAINING, _REFILL = "training", "refill"  # a job's kind, as the union tags it


def _job_kind(data: Any) -> str:
    mode = data.get("mode") if isinstance(data, Mapping) else getattr(data, "mode", None)
    return _REFILL if mode == JobMode.REFILL else _TRAINING


# A job of either kind, told apart by `mode` (absent: join, a training job). Validation errors
# name the job's fields as `jobs[i].field` (the kind is left out: `format_validation_error`).
JobConfig = Annotated[
    Annotated[TrainingJobConfig, Tag(_TRAINING)] | Annotated[RefillJobConfig, Tag(_REFILL)],
    Discriminator(_job_kind),
]
_JOB_KINDS = frozenset({_TRAINING, _REFILL})
_JOB = TypeAdapter(JobConfig)


def parse_job(data: Mapping[str, Any], *, names: Mapping[tuple[str, ...], str] | None = None
              ) -> TrainingJobConfig | RefillJobConfig:
    """One job mapping (its kind from `mode`), validated; ConfigError names the field (as
    `names` calls it, e.g. the CLI flag that set it)."""
    try:
        return _JOB.validate_python(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, names)) from None


def job_from_json(text: str | bytes) -> TrainingJobConfig | RefillJobConfig:
    """A job from its `model_dump_json()` (how a job travels to Ray workers and actors)."""
    return _JOB.validate_json(text)


class GrpcConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="0 = pick a free port")
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    max_message_mb: int = Field(64, gt=0, description="the largest message sent (a batch)")
    max_request_mb: int = Field(
        1, gt=0, description="the largest request accepted (requests are small: a larger one "
        "is refused with RESOURCE_EXHAUSTED before it is read)")
    prefetch_steps: int = Field(4, gt=0, description="steps in flight per rank (flow control)")
    chunk_kb: int = Field(
        1024, gt=0, description="a batch whose tensors hold more bytes travels as a header and "
        "chunks of this size, one message each (at most half of max_message_mb); larger "
        "chunks leave more of the client's memory in transit copies and allocator slack")
    # Liveness (Guarantee 8): a silent peer is noticed within keepalive_time_s +
    # keepalive_timeout_s on both ends of every connection.
    keepalive_time_s: float = Field(
        4.0, gt=0, description="ping each client connection this often when it sends nothing")
    keepalive_timeout_s: float = Field(
        4.0, gt=0, description="a ping unanswered this long closes the connection (its streams "
        "end; their ranks' leases lapse unless the client reconnects)")
    min_client_ping_interval_s: float = Field(
        2.0, gt=0, description="accept client keepalive pings this often (also without calls); "
        "clients must not ping more often (BatchStream pings every 4 s by default)")

    @model_validator(mode="after")
    def _tls_pair(self) -> GrpcConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be set together")
        return self

    @model_validator(mode="after")
    def _chunk_fits_a_message(self) -> GrpcConfig:
        if self.chunk_kb * 2 > self.max_message_mb * 1024:  # room for a batch's metadata
            raise ValueError(f"chunk_kb ({self.chunk_kb}) must be at most half of "
                             f"max_message_mb ({self.max_message_mb} MiB)")
        return self


class RayConfig(_Model):
    address: str | None = Field(None, description="None = start a private local Ray")
    num_cpus: int | None = Field(None, gt=0)
    object_store_mb: int = Field(512, gt=0)


def default_state_dir() -> str:
    """Where the embedded default keeps its state: $XDG_STATE_HOME/odb-pipeline, else
    ~/.local/state/odb-pipeline."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                             "state")
    return os.path.join(base, "odb-pipeline")


def default_cache_dir() -> str:
    """Where caches go unless configured (never beside the data: a checkout stays clean):
    $XDG_CACHE_HOME/odb-pipeline, else ~/.cache/odb-pipeline."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "odb-pipeline")


class ServiceConfig(_Model):
    redis_url: str | None = Field(
        None, description="None = the embedded default: a private Redis with its AOF in "
        "state_dir, so restarting `serve` resumes every job where it was")
    state_dir: str = Field(default_factory=default_state_dir,
                           description="the embedded Redis's data directory (AOF)")
    fsync_publish: bool = Field(
        False, description="wait until Redis fsynced each publication (WAITAOF: Redis >= 7.2 "
        "or Valkey with appendonly) so a step a rank saw survives a Redis crash")
    resume_grace_seconds: float = Field(
        60.0, ge=0, description="an Open naming a step beyond the published plan (a Redis that "
        "lost its last publications: the producer publishes them again) opens its stream and "
        "waits for the step as long as the plan grows; this long with nothing new published, "
        "it ends OUT_OF_RANGE (so does an END of its epoch published before it)")
    lease_seconds: float = Field(
        10.0, gt=0, description="a rank's lease lasts this long after the last sign of life "
        "from its client (an Open, an Ack or a Heartbeat; BatchStream sends one every 2 s)")
    state_timeout_seconds: float = Field(
        5.0, gt=0, description="a replica that cannot complete a call to the job's state "
        "(Redis) for this long ends its rank streams with UNAVAILABLE: their clients reconnect, "
        "to another replica if they have one")
    payload_timeout_seconds: float = Field(
        10.0, gt=0, description="the longest a replica waits for a batch's payloads from Ray "
        "before it rebuilds them itself; a rebuild gets as long again before the stream ends "
        "with UNAVAILABLE")
    rank_timeout_seconds: float = Field(
        60.0, gt=0, description="how long a rank may be gone (its lease lapsed, or never "
        "claimed since the world's first rank connected) before the failure policy applies; "
        "it must cover the trainer ranks' start-up skew")
    # What a training job's live ranks get once a rank has been gone for rank_timeout_seconds:
    # `fail` = a clear ABORTED error naming the rank; `wait` = keep waiting for it to come
    # back; `shrink` = a reconfiguration onto the live ranks (docs/elastic.md).
    rank_failure_policy: RankFailurePolicy = RankFailurePolicy.FAIL
    allow_unauthenticated: bool = Field(
        False, description="allow_unauthenticated for every job of this server")
    metrics_port: int | None = Field(9464, ge=0, le=65535)
    metrics_host: str = Field(
        "127.0.0.1", description="where /metrics, /status and /status.json listen; beyond "
        "loopback (0.0.0.0 on Kubernetes, for Prometheus) the status pages require "
        "status_token_env's token (docs/security.md)")
    status_token_env: str | None = Field(
        None, description="env var holding the bearer token of /status and /status.json when "
        "metrics_host is beyond loopback (required there; /metrics stays open to scrapers)")
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    grpc: GrpcConfig = GrpcConfig()
    ray: RayConfig = RayConfig()
    jobs: list[JobConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_jobs(self) -> ServiceConfig:
        seen: set[str] = set()
        for job in self.jobs:
            if job.job_id in seen:
                raise ValueError(f"duplicate job_id {job.job_id!r}")
            seen.add(job.job_id)
        return self

    def client_problems(self) -> list[str]:
        """What in these settings cannot work with the trainers' clients at their defaults
        (`trainer_client.wire_format`): each problem names the fields and the fix. `serve`
        refuses such a config (Guarantee 7); tests that tune their clients may start a service
        with tighter settings in-process."""
        from trainer_client.wire_format import (
            DEFAULT_HEARTBEAT_S,
            DEFAULT_KEEPALIVE_TIME_S,
            DEFAULT_KEEPALIVE_TIMEOUT_S,
        )

        out = []
        ping = self.grpc.min_client_ping_interval_s
        if ping > DEFAULT_KEEPALIVE_TIME_S:
            out.append(
                f"grpc.min_client_ping_interval_s = {ping:g} is above the trainers' keepalive "
                f"interval (BatchStream keepalive_time_s {DEFAULT_KEEPALIVE_TIME_S:g} s): the "
                "service would answer their pings with GOAWAY \"too_many_pings\" and they would "
                f"stop noticing a dead replica; set it to at most {DEFAULT_KEEPALIVE_TIME_S:g}")
        if self.lease_seconds <= DEFAULT_HEARTBEAT_S:
            out.append(
                f"lease_seconds = {self.lease_seconds:g} is not above the trainers' heartbeat "
                f"period (BatchStream heartbeat_s {DEFAULT_HEARTBEAT_S:g} s): a rank busy in a "
                "long step would lose its lease between two heartbeats; set it above "
                f"{DEFAULT_HEARTBEAT_S:g} (default 10)")
        # A replica cut off from the state ends a stream UNAVAILABLE after state_timeout_seconds:
        # a call that failed only after the clients' detection bound looks like a working
        # connection to their outage clock. (resume_grace_seconds waits on an open stream and
        # ends it OUT_OF_RANGE, which clients do not retry: it is no part of this.)
        bound = DEFAULT_KEEPALIVE_TIME_S + DEFAULT_KEEPALIVE_TIMEOUT_S
        if self.state_timeout_seconds >= bound:
            out.append(
                f"state_timeout_seconds = {self.state_timeout_seconds:g} is not below the "
                "trainers' detection bound (BatchStream keepalive_time_s + keepalive_timeout_s "
                f"= {bound:g} s): a stream that fails only after that long looks like a working "
                "connection to the client, which would then reconnect without end instead of "
                f"giving up after its reconnect_timeout; set it below {bound:g} (default 5)")
        return out

    def status_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The status pages' bearer token, read from `status_token_env` at use (None: unset)."""
        if self.status_token_env is None:
            return None
        value = (os.environ if environ is None else environ).get(self.status_token_env)
        if not value:
            raise ConfigError(f"status_token_env: environment variable {self.status_token_env} "
                              "is unset or empty")
        return value

    def job(self, job_id: str) -> TrainingJobConfig | RefillJobConfig:
        for job in self.jobs:
            if job.job_id == job_id:
                return job
        raise KeyError(job_id)


def env_var_names(model: type[BaseModel] = ServiceConfig, prefix: str = ENV_PREFIX) -> list[str]:
    """Every environment variable the config reads (scalar fields of nested models, not lists)."""
    names: list[str] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names += env_var_names(ann, f"{prefix}{name.upper()}__")
        elif name != "jobs":
            names.append(f"{prefix}{name.upper()}")
    return names


def _env_overrides(environ: Mapping[str, str], model: type[BaseModel], prefix: str) -> dict:
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested = _env_overrides(environ, ann, f"{prefix}{name.upper()}__")
            if nested:
                out[name] = nested
        elif name != "jobs" and f"{prefix}{name.upper()}" in environ:
            raw = environ[f"{prefix}{name.upper()}"]
            # Empty string means "unset" (None) for optional fields, as in k8s env blocks.
            out[name] = None if raw == "" else raw
    return out


def _spelling(name: str) -> str:
    return name.upper().replace("_", "")


def _misspelt(name: str, setting: str) -> bool:
    """`name` is `setting` with its separators wrong or a letter or two off (not another name
    that merely resembles it, such as a token variable `ODB_STATUS_TOKEN`)."""
    a, b = _spelling(name), _spelling(setting)
    return a == b or (abs(len(a) - len(b)) <= 2
                      and difflib.SequenceMatcher(None, a, b).ratio() >= 0.9)


def check_env_names(environ: Mapping[str, str], config: ServiceConfig) -> None:
    """An `ODB_*` variable that names no setting (nor a token the config names) would be
    ignored: one that looks like a misspelt setting (`ODB_GRPC_PORT` for `ODB_GRPC__PORT`) is
    refused, any other is warned about; both name the closest setting."""
    settings = env_var_names()
    tokens = {j.token_env for j in config.jobs} | {config.status_token_env}
    typos = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in settings or name in tokens:
            continue
        near = difflib.get_close_matches(name, settings, n=1, cutoff=0.6)
        closest = next((s for s in settings if _spelling(s) == _spelling(name)),
                       near[0] if near else None)
        if closest is not None and _misspelt(name, closest):
            typos.append(f"{name} (did you mean {closest}?)")
        else:
            logging.getLogger(__name__).warning(
                "environment variable %s names no setting and is ignored%s", name,
                f" (the closest setting is {closest})" if closest else "")
    if typos:
        raise ConfigError(f"environment variables that name no setting: {', '.join(typos)}; "
                          "a nested setting joins its path with two underscores "
                          "(ODB_GRPC__PORT is grpc.port): rename or unset them")


def deep_merge(base: dict, top: Mapping) -> dict:
    """`base` with `top` merged in, nested mappings key by key (`top` wins)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_config_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as exc:  # YAML and JSON raise different error types
        raise ConfigError(f"config file {p} is not valid {p.suffix.lstrip('.')}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at top level")
    return data


def format_validation_error(exc: ValidationError,
                            names: Mapping[tuple[str, ...], str] | None = None) -> str:
    """One line naming each wrong field by its path (`jobs[0].batching.token_budget`, or what
    `names` calls that path) and its value."""
    parts = []
    for err in exc.errors():
        path = tuple(x for i, x in enumerate(err["loc"])  # a job's kind is no part of its path
                     if not (x in _JOB_KINDS and (i == 0 or isinstance(err["loc"][i - 1], int))))
        loc = ".".join(str(x) if not isinstance(x, int) else f"[{x}]" for x in path)
        loc = (names or {}).get(path, loc.replace(".[", "["))
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        parts.append(f"{loc or '<root>'}{shown}: {err['msg']}")
    return "invalid config: " + "; ".join(parts)


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServiceConfig:
    """File, then ODB_* environment, then explicit overrides (CLI flags); validated once."""
    environ = os.environ if environ is None else environ
    data = read_config_file(path) if path is not None else {}
    data = deep_merge(data, _env_overrides(environ, ServiceConfig, ENV_PREFIX))
    data = deep_merge(data, overrides or {})
    try:
        config = ServiceConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
    check_env_names(environ, config)
    return config
