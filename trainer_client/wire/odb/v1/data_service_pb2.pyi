from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    JOIN: _ClassVar[Mode]
    QUOTA: _ClassVar[Mode]
    REFILL: _ClassVar[Mode]

class EndReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    END_REASON_UNSPECIFIED: _ClassVar[EndReason]
    END_REASON_EPOCH: _ClassVar[EndReason]
    END_REASON_RECONFIGURE: _ClassVar[EndReason]
DTYPE_UNSPECIFIED: DType
INT32: DType
INT64: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
UINT8: DType
BOOL: DType
MODE_UNSPECIFIED: Mode
JOIN: Mode
QUOTA: Mode
REFILL: Mode
END_REASON_UNSPECIFIED: EndReason
END_REASON_EPOCH: EndReason
END_REASON_RECONFIGURE: EndReason

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PixelNorm(_message.Message):
    __slots__ = ("rescale", "mean", "std")
    RESCALE_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    rescale: float
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rescale: _Optional[float] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Pong(_message.Message):
    __slots__ = ("server_version",)
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    def __init__(self, server_version: _Optional[str] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "resume_step", "resume_epoch", "client_id", "credits", "wire_version", "prefetch_bytes", "held_bytes", "group_size", "group_rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUME_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    resume_step: int
    resume_epoch: int
    client_id: str
    credits: int
    wire_version: int
    prefetch_bytes: int
    held_bytes: int
    group_size: int
    group_rank: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., resume_step: _Optional[int] = ..., resume_epoch: _Optional[int] = ..., client_id: _Optional[str] = ..., credits: _Optional[int] = ..., wire_version: _Optional[int] = ..., prefetch_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., group_size: _Optional[int] = ..., group_rank: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("consumed_step", "credits", "credit_bytes", "compute")
    CONSUMED_STEP_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    CREDIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    consumed_step: int
    credits: int
    credit_bytes: int
    compute: _containers.RepeatedCompositeFieldContainer[ComputeReport]
    def __init__(self, consumed_step: _Optional[int] = ..., credits: _Optional[int] = ..., credit_bytes: _Optional[int] = ..., compute: _Optional[_Iterable[_Union[ComputeReport, _Mapping]]] = ...) -> None: ...

class ComputeReport(_message.Message):
    __slots__ = ("step", "seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    seconds: float
    def __init__(self, step: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("open", "ack", "heartbeat")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    open: Open
    ack: Ack
    heartbeat: Heartbeat
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class StepInfo(_message.Message):
    __slots__ = ("step_samples", "step_tokens", "rank_samples", "rank_tokens", "step_loss_tokens", "rank_loss_tokens", "world_size", "micro_index", "micro_count", "optimizer_step")
    STEP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RANK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_INDEX_FIELD_NUMBER: _ClassVar[int]
    MICRO_COUNT_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    step_samples: int
    step_tokens: int
    rank_samples: int
    rank_tokens: int
    step_loss_tokens: int
    rank_loss_tokens: int
    world_size: int
    micro_index: int
    micro_count: int
    optimizer_step: int
    def __init__(self, step_samples: _Optional[int] = ..., step_tokens: _Optional[int] = ..., rank_samples: _Optional[int] = ..., rank_tokens: _Optional[int] = ..., step_loss_tokens: _Optional[int] = ..., rank_loss_tokens: _Optional[int] = ..., world_size: _Optional[int] = ..., micro_index: _Optional[int] = ..., micro_count: _Optional[int] = ..., optimizer_step: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("step", "epoch", "rank", "sample_ids", "info", "collate", "over_budget", "tensors", "pixel_norm", "filler")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    COLLATE_FIELD_NUMBER: _ClassVar[int]
    OVER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PIXEL_NORM_FIELD_NUMBER: _ClassVar[int]
    FILLER_FIELD_NUMBER: _ClassVar[int]
    step: int
    epoch: int
    rank: int
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    info: StepInfo
    collate: str
    over_budget: bool
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    pixel_norm: PixelNorm
    filler: bool
    def __init__(self, step: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., sample_ids: _Optional[_Iterable[str]] = ..., info: _Optional[_Union[StepInfo, _Mapping]] = ..., collate: _Optional[str] = ..., over_budget: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., pixel_norm: _Optional[_Union[PixelNorm, _Mapping]] = ..., filler: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class BatchHeader(_message.Message):
    __slots__ = ("batch", "tensors")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tensor", "offset", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    offset: int
    data: bytes
    def __init__(self, tensor: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ("epoch", "final_step", "mode", "epoch_steps", "job_done", "reason", "world_size")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_STEPS_FIELD_NUMBER: _ClassVar[int]
    JOB_DONE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    final_step: int
    mode: Mode
    epoch_steps: int
    job_done: bool
    reason: EndReason
    world_size: int
    def __init__(self, epoch: _Optional[int] = ..., final_step: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., epoch_steps: _Optional[int] = ..., job_done: _Optional[bool] = ..., reason: _Optional[_Union[EndReason, str]] = ..., world_size: _Optional[int] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("batch", "end", "batch_header", "chunk")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    BATCH_HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    end: End
    batch_header: BatchHeader
    chunk: Chunk
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ..., batch_header: _Optional[_Union[BatchHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "acked_step", "client_id", "connected", "delivered_step", "members")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ACKED_STEP_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    acked_step: int
    client_id: str
    connected: bool
    delivered_step: int
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    def __init__(self, rank: _Optional[int] = ..., acked_step: _Optional[int] = ..., client_id: _Optional[str] = ..., connected: _Optional[bool] = ..., delivered_step: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ...) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("member", "client_id", "acked_step", "lag_steps", "connected", "delivered_step", "lapsed_seconds", "released")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_STEP_FIELD_NUMBER: _ClassVar[int]
    LAG_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_STEP_FIELD_NUMBER: _ClassVar[int]
    LAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    member: int
    client_id: str
    acked_step: int
    lag_steps: int
    connected: bool
    delivered_step: int
    lapsed_seconds: float
    released: bool
    def __init__(self, member: _Optional[int] = ..., client_id: _Optional[str] = ..., acked_step: _Optional[int] = ..., lag_steps: _Optional[int] = ..., connected: _Optional[bool] = ..., delivered_step: _Optional[int] = ..., lapsed_seconds: _Optional[float] = ..., released: _Optional[bool] = ...) -> None: ...

class EpochSummary(_message.Message):
    __slots__ = ("epoch", "steps", "final_step", "carried_over")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FINAL_STEP_FIELD_NUMBER: _ClassVar[int]
    CARRIED_OVER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    steps: int
    final_step: _containers.RepeatedScalarFieldContainer[int]
    carried_over: int
    def __init__(self, epoch: _Optional[int] = ..., steps: _Optional[int] = ..., final_step: _Optional[_Iterable[int]] = ..., carried_over: _Optional[int] = ...) -> None: ...

class World(_message.Message):
    __slots__ = ("generation", "world_size", "first_step", "last_step", "rank_last_steps", "reason", "requested_at", "returned_samples", "adopted_seconds", "first_batch_seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_LAST_STEPS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    RETURNED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    world_size: int
    first_step: int
    last_step: int
    rank_last_steps: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    requested_at: float
    returned_samples: int
    adopted_seconds: float
    first_batch_seconds: float
    def __init__(self, generation: _Optional[int] = ..., world_size: _Optional[int] = ..., first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., rank_last_steps: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ..., requested_at: _Optional[float] = ..., returned_samples: _Optional[int] = ..., adopted_seconds: _Optional[float] = ..., first_batch_seconds: _Optional[float] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("job_id", "world_size")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    world_size: int
    def __init__(self, job_id: _Optional[str] = ..., world_size: _Optional[int] = ...) -> None: ...

class ScaleReply(_message.Message):
    __slots__ = ("job_id", "changed", "world", "previous")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    changed: bool
    world: World
    previous: World
    def __init__(self, job_id: _Optional[str] = ..., changed: _Optional[bool] = ..., world: _Optional[_Union[World, _Mapping]] = ..., previous: _Optional[_Union[World, _Mapping]] = ...) -> None: ...

class SourceShare(_message.Message):
    __slots__ = ("name", "samples", "loss_tokens", "quarantined", "share", "target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    samples: int
    loss_tokens: int
    quarantined: int
    share: float
    target: float
    def __init__(self, name: _Optional[str] = ..., samples: _Optional[int] = ..., loss_tokens: _Optional[int] = ..., quarantined: _Optional[int] = ..., share: _Optional[float] = ..., target: _Optional[float] = ...) -> None: ...

class MixChange(_message.Message):
    __slots__ = ("step", "by", "weights")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    by: str
    weights: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., by: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MixtureStatus(_message.Message):
    __slots__ = ("epoch", "mix_by", "sources", "changes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MIX_BY_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    mix_by: str
    sources: _containers.RepeatedCompositeFieldContainer[SourceShare]
    changes: _containers.RepeatedCompositeFieldContainer[MixChange]
    def __init__(self, epoch: _Optional[int] = ..., mix_by: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[SourceShare, _Mapping]]] = ..., changes: _Optional[_Iterable[_Union[MixChange, _Mapping]]] = ...) -> None: ...

class MixRequest(_message.Message):
    __slots__ = ("job_id", "weights")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    weights: _containers.ScalarMap[str, float]
    def __init__(self, job_id: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MixReply(_message.Message):
    __slots__ = ("job_id", "seq", "weights")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seq: int
    weights: _containers.ScalarMap[str, float]
    def __init__(self, job_id: _Optional[str] = ..., seq: _Optional[int] = ..., weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "world_size", "mode", "epochs", "published_through", "done", "ranks", "epoch_ends", "samples_in", "quarantined", "lapsed_ranks", "error", "replica_id", "worlds", "reconfiguring", "open", "batch_size_notice", "sources", "refill")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_ENDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_IN_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    LAPSED_RANKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    WORLDS_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURING_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_NOTICE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    REFILL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    world_size: int
    mode: Mode
    epochs: int
    published_through: int
    done: bool
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    epoch_ends: _containers.RepeatedCompositeFieldContainer[EpochSummary]
    samples_in: int
    quarantined: int
    lapsed_ranks: _containers.RepeatedScalarFieldContainer[int]
    error: str
    replica_id: str
    worlds: _containers.RepeatedCompositeFieldContainer[World]
    reconfiguring: bool
    open: bool
    batch_size_notice: str
    sources: MixtureStatus
    refill: RefillCounts
    def __init__(self, job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., epochs: _Optional[int] = ..., published_through: _Optional[int] = ..., done: _Optional[bool] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., epoch_ends: _Optional[_Iterable[_Union[EpochSummary, _Mapping]]] = ..., samples_in: _Optional[int] = ..., quarantined: _Optional[int] = ..., lapsed_ranks: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., replica_id: _Optional[str] = ..., worlds: _Optional[_Iterable[_Union[World, _Mapping]]] = ..., reconfiguring: _Optional[bool] = ..., open: _Optional[bool] = ..., batch_size_notice: _Optional[str] = ..., sources: _Optional[_Union[MixtureStatus, _Mapping]] = ..., refill: _Optional[_Union[RefillCounts, _Mapping]] = ...) -> None: ...

class RefillOpen(_message.Message):
    __slots__ = ("job_id", "consumer_id", "held_ids", "retry_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_IDS_FIELD_NUMBER: _ClassVar[int]
    RETRY_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    consumer_id: str
    held_ids: _containers.RepeatedScalarFieldContainer[str]
    retry_seq: int
    def __init__(self, job_id: _Optional[str] = ..., consumer_id: _Optional[str] = ..., held_ids: _Optional[_Iterable[str]] = ..., retry_seq: _Optional[int] = ...) -> None: ...

class RefillAsk(_message.Message):
    __slots__ = ("free_tokens", "finished", "call_seq")
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CALL_SEQ_FIELD_NUMBER: _ClassVar[int]
    free_tokens: int
    finished: _containers.RepeatedScalarFieldContainer[str]
    call_seq: int
    def __init__(self, free_tokens: _Optional[int] = ..., finished: _Optional[_Iterable[str]] = ..., call_seq: _Optional[int] = ...) -> None: ...

class RefillMessage(_message.Message):
    __slots__ = ("open", "ask")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ASK_FIELD_NUMBER: _ClassVar[int]
    open: RefillOpen
    ask: RefillAsk
    def __init__(self, open: _Optional[_Union[RefillOpen, _Mapping]] = ..., ask: _Optional[_Union[RefillAsk, _Mapping]] = ...) -> None: ...

class RefillRequest(_message.Message):
    __slots__ = ("id", "input_ids", "cost", "prompt_tokens", "generation_tokens", "over_budget", "pixel_values", "image_grid_thw", "pixel_norm", "epoch", "sample_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    PIXEL_NORM_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    input_ids: Tensor
    cost: int
    prompt_tokens: int
    generation_tokens: int
    over_budget: bool
    pixel_values: Tensor
    image_grid_thw: Tensor
    pixel_norm: PixelNorm
    epoch: int
    sample_id: str
    def __init__(self, id: _Optional[str] = ..., input_ids: _Optional[_Union[Tensor, _Mapping]] = ..., cost: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., over_budget: _Optional[bool] = ..., pixel_values: _Optional[_Union[Tensor, _Mapping]] = ..., image_grid_thw: _Optional[_Union[Tensor, _Mapping]] = ..., pixel_norm: _Optional[_Union[PixelNorm, _Mapping]] = ..., epoch: _Optional[int] = ..., sample_id: _Optional[str] = ...) -> None: ...

class RefillReply(_message.Message):
    __slots__ = ("requests", "completed", "stale", "done", "waiting", "in_flight", "revoked")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RefillRequest]
    completed: _containers.RepeatedScalarFieldContainer[str]
    stale: _containers.RepeatedScalarFieldContainer[str]
    done: bool
    waiting: int
    in_flight: int
    revoked: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, requests: _Optional[_Iterable[_Union[RefillRequest, _Mapping]]] = ..., completed: _Optional[_Iterable[str]] = ..., stale: _Optional[_Iterable[str]] = ..., done: _Optional[bool] = ..., waiting: _Optional[int] = ..., in_flight: _Optional[int] = ..., revoked: _Optional[_Iterable[str]] = ...) -> None: ...

class RefillCounts(_message.Message):
    __slots__ = ("enqueued", "waiting", "in_flight", "completed", "readmitted", "admitted", "quarantined", "consumers", "exhausted", "lease_lapses", "epoch", "epochs", "by_epoch")
    ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    READMITTED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_LAPSES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    enqueued: int
    waiting: int
    in_flight: int
    completed: int
    readmitted: int
    admitted: int
    quarantined: int
    consumers: int
    exhausted: bool
    lease_lapses: int
    epoch: int
    epochs: int
    by_epoch: _containers.RepeatedCompositeFieldContainer[RefillEpochCounts]
    def __init__(self, enqueued: _Optional[int] = ..., waiting: _Optional[int] = ..., in_flight: _Optional[int] = ..., completed: _Optional[int] = ..., readmitted: _Optional[int] = ..., admitted: _Optional[int] = ..., quarantined: _Optional[int] = ..., consumers: _Optional[int] = ..., exhausted: _Optional[bool] = ..., lease_lapses: _Optional[int] = ..., epoch: _Optional[int] = ..., epochs: _Optional[int] = ..., by_epoch: _Optional[_Iterable[_Union[RefillEpochCounts, _Mapping]]] = ...) -> None: ...

class RefillEpochCounts(_message.Message):
    __slots__ = ("epoch", "enqueued", "completed", "quarantined")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    enqueued: int
    completed: int
    quarantined: int
    def __init__(self, epoch: _Optional[int] = ..., enqueued: _Optional[int] = ..., completed: _Optional[int] = ..., quarantined: _Optional[int] = ...) -> None: ...
