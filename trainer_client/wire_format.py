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
"""

from __future__ import annotations

import numpy as np

from trainer_client.wire.odb.v1 import data_service_pb2 as pb

WIRE_VERSION = 3

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

# The initial metadata a replica sends on a Stream call once it accepted the Open (the rank is
# claimed): the call works, so the client's outage (if any) is over, even before a batch comes.
# (A server that does not send it: the outage ends with the first message.)
STREAM_ACCEPTED = ("odb-stream", "accepted")

# A client's byte window unless it sets its own (`BatchStream(prefetch_bytes=...)`); `serve`
# tells what a job's largest batch means against it.
DEFAULT_PREFETCH_BYTES = 256 * 1024 * 1024


def version_mismatch(client_version: int, server_version: int = WIRE_VERSION) -> str | None:
    """None when the versions agree, else the FAILED_PRECONDITION details naming both."""
    if client_version == server_version:
        return None
    who = ("a client from before wire versions (0)" if client_version == 0
           else f"version {client_version}")
    return (f"{MISMATCH_PREFIX}: the client decodes odb.v1 wire {who}, this server sends "
            f"version {server_version}; install the trainer_client that matches the server")
