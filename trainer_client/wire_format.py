"""The wire format's version and dtype table: what both ends must agree on beyond the .proto.

The .proto says how bytes are framed; this module says what they mean: which numpy dtype each
`DType` is (one table, used by the server's encoder and the client's decoder) and which version
of the tensor layout a client decodes. A change of tensor names, dtypes or layouts bumps
`WIRE_VERSION`, and the server refuses a client that speaks another one (`Open.wire_version`).

Version history:
  0  (no field) int64 ids/labels/mask/position_ids, float32 pixel patches
  2  int32 ids and labels, bool mask, position_ids only in packed batches (int32), pixel
     patches as raw uint8 plus `Batch.pixel_norm` (or normalized bfloat16/float32)
  3  a batch larger than one chunk travels as `BatchHeader` + `Chunk`s (reassembled by
     `trainer_client.batch_assembly`); byte credits (`Open.prefetch_bytes`, `Ack.credit_bytes`)
     count a batch's tensor bytes (`TensorSpec.nbytes` summed)
  4  global steps: a rank gets several Batches per step, its micro-batches (`StepInfo.
     micro_index`, `micro_count`, `optimizer_step`), acknowledged once the step's last was
     taken. Tensors as in 3, so a version-3 client is still served jobs without global steps;
     a job with global steps refuses it (it would take each micro-batch for a step).
"""

from __future__ import annotations

import numpy as np

from trainer_client.wire.odb.v1 import data_service_pb2 as pb

WIRE_VERSION = 4
# The oldest version served: the tensors have not changed since, and a job without global steps
# sends what it sent then.
OLDEST_WIRE_VERSION = 3
GLOBAL_STEPS_WIRE_VERSION = 4  # what a client needs for a job with global steps

# numpy has no bfloat16: the server side holds bfloat16 arrays as their uint16 bit patterns,
# which is what travels under BFLOAT16 (the wire has no uint16 of its own).
NUMPY_DTYPES: dict[int, np.dtype] = {
    pb.INT32: np.dtype("<i4"),
    pb.INT64: np.dtype("<i8"),
    pb.FLOAT32: np.dtype("<f4"),
    pb.BFLOAT16: np.dtype("<u2"),
    pb.FLOAT16: np.dtype("<f2"),
    pb.UINT8: np.dtype("u1"),
    pb.BOOL: np.dtype("?"),
}
WIRE_DTYPES: dict[np.dtype, int] = {v: k for k, v in NUMPY_DTYPES.items()}

MISMATCH_PREFIX = "wire version mismatch"
# Trailing metadata of a status the client must not retry whatever its code: the job failed
# for good (its producer's permanent failure) or has nothing left to give. A client ends at
# once with it instead of reconnecting until its reconnect_timeout.
FINAL_STATUS_KEY = "odb-final"
# A model-parallel group the job cannot serve (no batching.pad_to_multiple): configuration, not
# a passing state, so the client does not retry it.
GROUP_REFUSED_PREFIX = "group refused"
MAX_GROUP_SIZE = 1024  # clients of one rank's group (Open.group_size)

# The initial metadata a replica sends on a Stream call once it accepted the Open (the rank is
# claimed): the call works, so the client's outage (if any) is over, even before a batch comes.
# (A server that does not send it: the outage ends with the first message.)
STREAM_ACCEPTED = ("odb-stream", "accepted")

# A client's byte window unless it sets its own (`BatchStream(prefetch_bytes=...)`); `serve`
# tells what a job's largest batch means against it.
DEFAULT_PREFETCH_BYTES = 256 * 1024 * 1024

# A client's liveness settings unless it sets its own (`BatchStream(keepalive_time_s=...,
# keepalive_timeout_s=..., heartbeat_s=...)`); `serve` refuses settings of its own that cannot
# work with them (`pipeline.config.ServiceConfig.client_problems`).
DEFAULT_KEEPALIVE_TIME_S = 4.0  # a keepalive ping when nothing arrived for this long
DEFAULT_KEEPALIVE_TIMEOUT_S = 4.0  # a ping unanswered this long drops the connection
DEFAULT_HEARTBEAT_S = 2.0  # a Heartbeat on the stream when nothing else went out for this long


def version_mismatch(client_version: int, server_version: int = WIRE_VERSION, *,
                     global_steps: bool = False) -> str | None:
    """None when this server serves a client of `client_version` (a job with `global_steps`
    needs micro-batches), else the FAILED_PRECONDITION details naming both versions."""
    oldest = OLDEST_WIRE_VERSION if server_version == WIRE_VERSION else server_version
    if global_steps:
        oldest = max(oldest, GLOBAL_STEPS_WIRE_VERSION)
    if oldest <= client_version <= server_version:
        return None
    who = ("a client from before wire versions (0)" if client_version == 0
           else f"version {client_version}")
    why = (f" (this job has global steps: its micro-batches need version {oldest} or later)"
           if global_steps and client_version < oldest <= server_version else "")
    return (f"{MISMATCH_PREFIX}: the client decodes odb.v1 wire {who}, this server sends "
            f"version {server_version}{why}; install the trainer_client that matches the server")
